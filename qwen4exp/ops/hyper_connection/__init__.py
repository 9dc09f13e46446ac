import torch

from ...layers.linear import stacked_weight
from .._dispatch import pick
from . import reference
from .reference import grouped_rms_norm


def hc_mix(H, norm_weight, down, up, inj, n, eps, Hn=None):
    """``down``/``up``/``inj`` are weight tensors or linear modules. A fused kernel (when registered for the device)
    takes plain weights; quantized modules go through the reference, which calls them. ``Hn``: the streams' norm
    when the caller already has it (``hc_inject_norm``)."""
    fn = pick("hc_mix", H.device, reference.hc_mix)
    if fn is not reference.hc_mix and not all(isinstance(w, torch.Tensor) or w is None
                                              for w in (down, up, inj)):
        fn = reference.hc_mix
    return fn(H, norm_weight, down, up, inj, n, eps, Hn)


def adjacent_rows(down, inj, pad: int = 1):
    """[W_down; W_inj] as ONE [R + n, nD] view when W_inj's rows follow W_down's in memory (the vLLM model lays
    them out so: ``qwen4exp.vllm.layers.colocate_projections``), else None: the many-token GPU path then runs
    both projections as one GEMM. ``pad``: the view's rows rounded up to a multiple of it where the storage holds
    them (the vLLM layout zero-pads to 8 rows, so the GEMM's output rows are 16-byte aligned); rows past R + n are
    not W_inj's."""
    return stacked_weight([down, inj], pad)


def hc_inject(H, c, y):
    return pick("hc_inject", H.device, reference.hc_inject)(H, c, y)


def hc_inject_norm(H, c, y, norm_weight, n, eps):
    return pick("hc_inject_norm", H.device, reference.hc_inject_norm)(H, c, y, norm_weight, n, eps)


__all__ = ["hc_mix", "hc_inject", "hc_inject_norm", "adjacent_rows", "grouped_rms_norm", "reference"]
