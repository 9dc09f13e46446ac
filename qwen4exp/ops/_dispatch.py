"""Pick an op implementation: a registered fast kernel for the tensor's device, else the torch reference.

Kernels register themselves per (op, device type); ``QWEN4EXP_OPS=reference`` forces the references everywhere.
"""

from __future__ import annotations

import os
from typing import Callable

_KERNELS: dict[tuple[str, str], Callable] = {}


def register_kernel(op: str, device_type: str, fn: Callable) -> None:
    _KERNELS[(op, device_type)] = fn


def pick(op: str, device: "torch.device", reference: Callable) -> Callable:  # noqa: F821
    if os.environ.get("QWEN4EXP_OPS", "") == "reference":
        return reference
    return _KERNELS.get((op, device.type), reference)
