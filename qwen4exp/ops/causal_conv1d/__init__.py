from .._dispatch import pick
from . import reference
from .reference import causal_conv1d_update, state_len


def causal_conv1d(x, weight, cu_seqlens, initial_state=None, dilation=1, activation="silu"):
    fn = pick("causal_conv1d", x.device, reference.causal_conv1d)
    return fn(x, weight, cu_seqlens, initial_state, dilation, activation)


__all__ = ["causal_conv1d", "causal_conv1d_update", "state_len", "reference"]
