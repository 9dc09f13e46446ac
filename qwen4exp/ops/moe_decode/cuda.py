"""The MoE decode kernels (``triton_kernel``) as the ``qwen4exp::router_topk`` and ``qwen4exp::experts_nvfp4`` custom
operators (``_registry``), and the host wrappers the dispatcher (``__init__``) picks on CUDA: the kernels run only
with ``QWEN4EXP_MOE_DECODE=1`` and where ``host`` says they cover the call; the rest goes to the torch reference,
outside the custom op. Imported on the first CUDA call (it imports Triton)."""

from __future__ import annotations

import torch

from ... import envs
from .. import _registry
from . import host
from . import reference as ref
from . import triton_kernel as tk

Tensor = torch.Tensor


@_registry.custom_op("qwen4exp::router_topk", mutates_args=())
def router_topk_op(x: Tensor, weight: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    return tk.router_topk_triton(x, weight, top_k, renormalize)


@router_topk_op.register_fake
def _(x, weight, top_k, renormalize):
    M, E = x.shape[0], weight.shape[0]
    return (x.new_empty(M, E), x.new_empty(M, top_k), torch.empty(M, top_k, dtype=torch.int64, device=x.device))


@_registry.custom_op("qwen4exp::experts_nvfp4", mutates_args=())
def experts_nvfp4_op(x: Tensor, w13: Tensor, w13_scale: Tensor, w13_gs: Tensor, w2: Tensor, w2_scale: Tensor,
                     w2_gs: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    return tk.experts_nvfp4_triton(x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, topk_weights, topk_ids)


@experts_nvfp4_op.register_fake
def _(x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, topk_weights, topk_ids):
    return torch.empty_like(x)


def _on(*tensors) -> bool:
    return envs.QWEN4EXP_MOE_DECODE and tensors[0].is_cuda and all(t.device == tensors[0].device for t in tensors)


def router_topk(x, weight, top_k, renormalize):
    if not (_on(x, weight) and host.router_covers(x, weight, top_k)):
        _registry.ran("router_topk", "reference")
        return ref.router_topk(x, weight, top_k, renormalize)
    _registry.ran("router_topk", "kernel")
    return router_topk_op(x, weight, int(top_k), bool(renormalize))


def experts_nvfp4(x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, topk_weights, topk_ids):
    args = (x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, topk_weights, topk_ids)
    if not (_on(*args) and host.experts_covers(*args)):
        _registry.ran("experts_nvfp4", "reference")
        return ref.experts_nvfp4(*args)
    _registry.ran("experts_nvfp4", "kernel")
    return experts_nvfp4_op(*args)


KERNELS = {"router_topk": router_topk, "experts_nvfp4": experts_nvfp4}
