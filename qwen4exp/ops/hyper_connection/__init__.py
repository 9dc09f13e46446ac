"""Gated hyper-connection (HC) mixer and write-back over n residual streams: ``reference`` (readable torch, the
contract), ``triton_kernel`` (the CUDA kernels), ``cuda`` (their registration as custom operators and the host
wrappers), ``host`` (what the kernels cover, which path a call takes, the many-token path from its pieces;
Triton-free). Tests: ``tests/ops/test_hyper_connection.py``."""

import torch

from .. import _registry
from . import reference
from .host import adjacent_rows
from .reference import grouped_rms_norm

KERNELS = _registry.Kernels(__name__, cuda=".cuda")  # the CUDA kernels (cuda.py), loaded on the first CUDA call
pick = KERNELS.pick


def hc_mix(H, norm_weight, down, up, inj, n, eps, Hn=None):
    """``down``/``up``/``inj`` are weight tensors or linear modules. A fused kernel (when registered for the device)
    takes plain weights; quantized modules go through the reference, which calls them. ``Hn``: the streams' norm
    when the caller already has it (``hc_inject_norm``)."""
    fn = pick("hc_mix", H.device, reference.hc_mix)
    if fn is not reference.hc_mix and not all(isinstance(w, torch.Tensor) or w is None
                                              for w in (down, up, inj)):
        fn = reference.hc_mix
    return fn(H, norm_weight, down, up, inj, n, eps, Hn)


def hc_inject(H, c, y):
    return pick("hc_inject", H.device, reference.hc_inject)(H, c, y)


def hc_inject_norm(H, c, y, norm_weight, n, eps):
    return pick("hc_inject_norm", H.device, reference.hc_inject_norm)(H, c, y, norm_weight, n, eps)


__all__ = ["hc_mix", "hc_inject", "hc_inject_norm", "adjacent_rows", "grouped_rms_norm", "reference"]
