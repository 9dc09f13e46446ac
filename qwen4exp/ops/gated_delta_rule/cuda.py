"""flash-linear-attention's gated-delta-rule kernels (``fla_kernel``) as the ``qwen4exp::gdn_chunk`` /
``qwen4exp::gdn_recurrent`` custom operators (``_registry``), and the host wrappers the dispatcher (``__init__``)
picks on CUDA: what fla does not take (``fla_kernel.covers``) goes to the torch reference, outside the custom ops.
Imported on the first CUDA call; it imports fla (``fla-core``, the ``gpu`` extra), so where fla is missing or does
not import, the dispatcher sends this op alone to its reference (with one warning)."""

from __future__ import annotations

from typing import Optional

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

from .. import _registry
from . import fla_kernel
from . import reference as ref

Tensor = torch.Tensor


def supported(q, k, v, g, beta) -> bool:
    return q.is_cuda and k.device == v.device == q.device and fla_kernel.covers(q, k, v, g, beta)


@_registry.custom_op("qwen4exp::gdn_chunk", mutates_args=())
def gdn_chunk_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                 initial_state: Optional[Tensor], scale: Optional[float], use_qk_l2norm: bool) -> tuple[Tensor, Tensor]:
    return fla_kernel.run(fla_chunk, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


@_registry.custom_op("qwen4exp::gdn_recurrent", mutates_args=())
def gdn_recurrent_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                     initial_state: Optional[Tensor], scale: Optional[float],
                     use_qk_l2norm: bool) -> tuple[Tensor, Tensor]:
    return fla_kernel.run(fla_recurrent, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


@gdn_chunk_op.register_fake
@gdn_recurrent_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    N = cu_seqlens.shape[0] - 1
    return v.new_empty(v.shape), v.new_empty(N, v.shape[-2], q.shape[-1], v.shape[-1], dtype=torch.float32)


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True):
    if not supported(q, k, v, g, beta):
        return ref.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    _registry.ran("chunk_gated_delta_rule", "kernel")
    return gdn_chunk_op(q, k, v, g, beta, cu_seqlens, initial_state, scale, bool(use_qk_l2norm))


def recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True):
    if not supported(q, k, v, g, beta):
        return ref.recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    _registry.ran("recurrent_gated_delta_rule", "kernel")
    return gdn_recurrent_op(q, k, v, g, beta, cu_seqlens, initial_state, scale, bool(use_qk_l2norm))


KERNELS = {"chunk_gated_delta_rule": chunk_gated_delta_rule, "recurrent_gated_delta_rule": recurrent_gated_delta_rule}
