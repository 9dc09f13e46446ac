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


def apply_knobs(namespace: dict, op: str) -> None:
    """Override an op module's launch settings (its upper-case module constants) from the environment variable
    ``QWEN4EXP_KNOBS``, e.g. ``hc.FUSED=1,qsa.TOPK_SMALL_BITS=8``: A/B runs of a whole engine (whose workers import
    the kernels themselves) without code changes. Entries of other ops are left to them; an unknown setting or a
    value of the wrong kind is an error naming it."""
    for item in filter(None, (s.strip() for s in os.environ.get("QWEN4EXP_KNOBS", "").split(","))):
        key, sep, val = item.partition("=")
        name_op, _, name = key.strip().partition(".")
        if name_op != op:
            continue
        if not sep or not name.isupper() or name not in namespace:
            raise ValueError(f"QWEN4EXP_KNOBS: {item!r} is not <op>.<SETTING>=<value> with a setting of {op!r}")
        old, val = namespace[name], val.strip()
        if isinstance(old, bool):
            if val.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"QWEN4EXP_KNOBS: {key} wants 0/1/true/false, got {val!r}")
            new = val.lower() in ("1", "true")
        elif isinstance(old, (int, float, str)):
            try:
                new = type(old)(val)
            except ValueError:
                raise ValueError(f"QWEN4EXP_KNOBS: {key} wants a {type(old).__name__}, got {val!r}") from None
        else:
            raise ValueError(f"QWEN4EXP_KNOBS: {key} cannot be set from the environment")
        namespace[name] = new
