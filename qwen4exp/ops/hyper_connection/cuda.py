"""The HC kernels (``triton_kernel``) as ``qwen4exp::`` custom operators (``_registry``), and the host wrappers the
dispatcher (``__init__``) picks on CUDA: each takes the path ``host`` chooses for the call (the decode launches,
the many-token path, or the torch reference outside the custom ops). Imported on the first CUDA call (it imports
Triton); the norm kernel comes from ``ops.norm.cuda``."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _registry
from ..norm import cuda as norm_cuda
from . import host
from . import reference as ref
from . import triton_kernel as tk

Tensor = torch.Tensor


# ------------------------------------------------------------------------------------------------------ mixer
@_registry.custom_op("qwen4exp::hc_mix", mutates_args=())
def hc_mix_op(H: Tensor, norm_weight: Tensor, down: Tensor, up: Tensor, inj: Optional[Tensor], n: int,
              eps: float, Hn: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return tk.hc_mix_triton(H, norm_weight, down, up, inj, n, eps, Hn)


@hc_mix_op.register_fake
def _(H, norm_weight, down, up, inj, n, eps, Hn=None):
    lead = H.shape[:-1]
    return H.new_empty(*lead, H.shape[-1] // n), H.new_empty(*lead, 0 if inj is None else n)


@_registry.custom_op("qwen4exp::hc_finish", mutates_args=())
def hc_finish_op(d: Tensor, R: int, n: int, ni: int) -> tuple[Tensor, Tensor]:
    return tk.hc_finish_triton(d, R, n, ni=ni)


@hc_finish_op.register_fake
def _(d, R, n, ni):
    return d.new_empty(d.shape[0], R), d.new_empty(d.shape[0], ni)


@_registry.custom_op("qwen4exp::hc_gate_mean", mutates_args=())
def hc_gate_mean_op(g: Tensor, Hn: Tensor, n: int) -> Tensor:
    return tk.hc_gate_mean_triton(g, Hn, n)


@hc_gate_mean_op.register_fake
def _(g, Hn, n):
    return g.new_empty(g.shape[0], g.shape[1] // n)


def mix_many_tokens(H, norm_weight, down, up, inj, n, eps, Hn=None):
    """``host.mix_many_tokens`` with the CUDA pieces: the norm kernel, cuBLAS, the finish and gate-mean kernels."""
    return host.mix_many_tokens(H, norm_weight, down, up, inj, n, eps, Hn, rms_norm=norm_cuda.rms_norm,
                                finish=hc_finish_op, gate_mean=hc_gate_mean_op)


def hc_mix(H, norm_weight, down, up, inj, n, eps, Hn=None):
    if not H.is_cuda:
        return ref.hc_mix(H, norm_weight, down, up, inj, n, eps, Hn)
    if host.norm_first(H, norm_weight, down, up, inj, n, Hn):
        Hn = norm_cuda.rms_norm(H, norm_weight, H.shape[-1] // n, eps)
    path = host.mix_path(H, norm_weight, down, up, inj, n, Hn)
    if path == "reference":
        return ref.hc_mix(H, norm_weight, down, up, inj, n, eps, Hn)
    _registry.ran("hc_mix", "kernel")
    if path == "decode":  # two fused launches
        x, c = hc_mix_op(H, norm_weight, down, up, inj, n, eps, Hn)
        return x, (None if inj is None else c)
    return mix_many_tokens(H, norm_weight, down, up, inj, n, eps, Hn)


# ------------------------------------------------------------------------------------------------- write-back
@_registry.custom_op("qwen4exp::hc_inject", mutates_args=())
def hc_inject_op(H: Tensor, c: Tensor, y: Tensor) -> Tensor:
    return tk.hc_inject_triton(H, c, y)


@hc_inject_op.register_fake
def _(H, c, y):
    return torch.empty_like(H)


def hc_inject(H, c, y):
    if not (H.is_cuda and host.inject_covers(H, c, y)):
        return ref.hc_inject(H, c, y)
    _registry.ran("hc_inject", "kernel")
    return hc_inject_op(H, c, y)


@_registry.custom_op("qwen4exp::hc_inject_norm", mutates_args=())
def hc_inject_norm_op(H: Tensor, c: Tensor, y: Tensor, norm_weight: Tensor, n: int, eps: float
                      ) -> tuple[Tensor, Tensor]:
    return tk.hc_inject_norm_triton(H, c, y, norm_weight, n, eps)


@hc_inject_norm_op.register_fake
def _(H, c, y, norm_weight, n, eps):
    return torch.empty_like(H), torch.empty_like(H)


def hc_inject_norm(H, c, y, norm_weight, n, eps):
    if not (H.is_cuda and host.inject_norm_covers(H, c, y, norm_weight, n)):
        return ref.hc_inject_norm(H, c, y, norm_weight, n, eps)
    _registry.ran("hc_inject_norm", "kernel")
    return hc_inject_norm_op(H, c, y, norm_weight, n, eps)


KERNELS = {"hc_mix": hc_mix, "hc_inject": hc_inject, "hc_inject_norm": hc_inject_norm}
