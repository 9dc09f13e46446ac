"""Pick an op implementation: a registered fast kernel for the tensor's device, else the torch reference.

Kernels register themselves per (op, device type); ``QWEN4EXP_OPS=reference`` forces the references everywhere.
"""

from __future__ import annotations

import os
from typing import Callable

_KERNELS: dict[tuple[str, str], Callable] = {}
_LOADED: set[str] = set()


def register_kernel(op: str, device_type: str, fn: Callable) -> None:
    _KERNELS[(op, device_type)] = fn


def pick(op: str, device: "torch.device", reference: Callable) -> Callable:  # noqa: F821
    if os.environ.get("QWEN4EXP_OPS", "") == "reference":
        return reference
    if device.type == "cuda" and "cuda" not in _LOADED:  # the Triton kernels: imported on first CUDA use only
        _LOADED.add("cuda")
        try:
            from . import cuda  # noqa: F401  (registers them)
        except ImportError as e:  # no Triton here: the references serve
            import warnings
            warnings.warn(f"qwen4exp: CUDA kernels unavailable ({e}); using the torch references")
    return _KERNELS.get((op, device.type), reference)
