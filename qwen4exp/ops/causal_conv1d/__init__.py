"""Causal depthwise conv1d over packed variable-length sequences: ``reference`` (readable torch, the contract). No
kernel is registered: every device runs the reference. Tests: ``tests/ops/test_causal_conv1d.py``."""

from .. import _registry
from . import reference
from .reference import causal_conv1d_update, state_len

KERNELS = _registry.Kernels(__name__)  # no kernels registered: every device runs the reference
pick = KERNELS.pick


def causal_conv1d(x, weight, cu_seqlens, initial_state=None, dilation=1, activation="silu"):
    fn = pick("causal_conv1d", x.device, reference.causal_conv1d)
    return fn(x, weight, cu_seqlens, initial_state, dilation, activation)


__all__ = ["causal_conv1d", "causal_conv1d_update", "state_len", "reference"]
