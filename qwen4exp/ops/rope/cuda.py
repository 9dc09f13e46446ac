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


KERNELS = {"apply_rope": apply_rope, "norm_rope": norm_rope}
