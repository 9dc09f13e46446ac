"""The RoPE kernels (rotate-half RoPE; the per-head norm + RoPE in one pass) as ``qwen4exp::`` custom operators
(``_registry``), and the host wrappers the dispatcher (``__init__``) picks on CUDA: what a kernel does not cover
(``host``) goes to the torch reference (``norm_rope``: to the norm kernel, then the RoPE kernel), outside the
custom ops. Imported on the first CUDA call (it imports Triton)."""

from __future__ import annotations

import torch

from .. import _registry
from ..norm import cuda as norm_cuda
from . import host
from . import reference as ref
from . import triton_kernel as tk

Tensor = torch.Tensor


def supported(x, cos, sin) -> bool:
    return x.is_cuda and cos.device == sin.device == x.device and host.covers(x, cos, sin)


def norm_rope_supported(x, weight, cos, sin) -> bool:
    return (x.is_cuda and cos.device == sin.device == weight.device == x.device
            and host.norm_rope_covers(x, weight, cos, sin))


@_registry.custom_op("qwen4exp::apply_rope", mutates_args=())
def apply_rope_op(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return tk.apply_rope_triton(x, cos, sin)


@apply_rope_op.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)


def apply_rope(x, cos, sin):
    if not supported(x, cos, sin):
        return ref.apply_rope(x, cos, sin)
    _registry.ran("apply_rope", "kernel")
    return apply_rope_op(x, cos, sin)


@_registry.custom_op("qwen4exp::norm_rope", mutates_args=())
def norm_rope_op(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    return tk.norm_rope_triton(x, weight, eps, cos, sin)


@norm_rope_op.register_fake
def _(x, weight, eps, cos, sin):
    return x.new_empty(x.shape)


def norm_rope(x, weight, eps, cos, sin):
    if not norm_rope_supported(x, weight, cos, sin):
        return host.norm_then_rope(x, weight, eps, cos, sin, rms_norm=norm_cuda.rms_norm, apply_rope=apply_rope)
    _registry.ran("norm_rope", "kernel")
    return norm_rope_op(x, weight, float(eps), cos, sin)


@_registry.custom_op("qwen4exp::norm_rope3", mutates_args=())
def norm_rope3_op(x0: Tensor, w0: Tensor, eps0: float, x1: Tensor, w1: Tensor, eps1: float, x2: Tensor, w2: Tensor,
                  eps2: float, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return tk.norm_rope3_triton(x0, w0, eps0, x1, w1, eps1, x2, w2, eps2, cos, sin)


@norm_rope3_op.register_fake
def _(x0, w0, eps0, x1, w1, eps1, x2, w2, eps2, cos, sin):
    return x0.new_empty(x0.shape), x1.new_empty(x1.shape), x2.new_empty(x2.shape)


def norm_rope_many(groups, cos, sin):
    """Three groups in one launch where the kernel covers them all (the QSA layer's q, k and indexer q); else each
    group as ``norm_rope``."""
    groups = list(groups)
    if not (all(norm_rope_supported(x, w, cos, sin) for x, w, _ in groups) and host.norm_rope3_covers(groups, cos,
                                                                                                      sin)):
        return [norm_rope(x, w, eps, cos, sin) for x, w, eps in groups]
    _registry.ran("norm_rope_many", "kernel")
    (x0, w0, e0), (x1, w1, e1), (x2, w2, e2) = groups
    return list(norm_rope3_op(x0, w0, float(e0), x1, w1, float(e1), x2, w2, float(e2), cos, sin))


KERNELS = {"apply_rope": apply_rope, "norm_rope": norm_rope, "norm_rope_many": norm_rope_many}
