"""Causal depthwise conv1d over packed variable-length sequences: ``reference`` (readable torch, the contract). No
kernel is registered: every device runs the reference (off the CPU its packed form, which never syncs). Tests:
``tests/ops/test_causal_conv1d.py``."""

from .. import _registry
from . import reference
from .reference import causal_conv1d_packed, causal_conv1d_update, state_len

KERNELS = _registry.Kernels(__name__)  # no kernels registered: every device runs the reference
pick = KERNELS.pick


def causal_conv1d(x, weight, cu_seqlens, initial_state=None, dilation=1, activation="silu"):
    # off the CPU the packed form, which reads nothing back to the host: the padded form's length read and masked
    # copies are three syncs a call (the PLE mix of every eager GPU step)
    default = reference.causal_conv1d if x.device.type == "cpu" else reference.causal_conv1d_packed
    fn = pick("causal_conv1d", x.device, default)
    return fn(x, weight, cu_seqlens, initial_state, dilation, activation)


__all__ = ["causal_conv1d", "causal_conv1d_packed", "causal_conv1d_update", "state_len", "reference"]
