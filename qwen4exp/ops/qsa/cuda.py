"""QSA's CUDA kernels as ``qwen4exp::`` custom operators (``_registry``), and the host wrappers the dispatcher
(``__init__``) picks on CUDA: each checks what its kernel covers (``host``) and sends everything else to the torch
reference, outside the custom op. Imported on the first CUDA call (it imports Triton)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _registry
from . import host
from . import reference as ref
from . import triton_kernel as tk

Tensor = torch.Tensor


# ------------------------------------------------------------------------------ what the kernels cover, on CUDA
def supported(q, k, v, q_pos, index_q, block_keys, r, budget) -> bool:
    return q.is_cuda and host.attention_covers(q, k, v, q_pos, index_q, block_keys, r, budget)


def select_paged_supported(index_q, index_kv, index_block_table, r) -> bool:
    return index_q.is_cuda and host.select_paged_covers(index_q, index_kv, index_block_table, r)


def attend_paged_supported(q, kv, block_table, r) -> bool:
    return q.is_cuda and host.attend_paged_covers(q, kv, block_table, r)


def paged_supported(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, r, budget) -> bool:
    return (index_q.is_cuda and q.is_cuda
            and host.paged_covers(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, r, budget))


def prefill_paged_supported(q, q_pos, index_q, kv, block_row, index_kv, r, budget) -> bool:
    return (index_q.is_cuda and q.is_cuda
            and host.prefill_paged_covers(q, q_pos, index_q, kv, block_row, index_kv, r, budget))


def write_paged_supported(kv, slots, k, v) -> bool:
    return kv.is_cuda and host.write_paged_covers(kv, slots, k, v)


def index_update_supported(index_kv, ring, slots, pos, valid, raw, norm_weight, cos, sin, r) -> bool:
    return index_kv.is_cuda and host.index_update_covers(index_kv, ring, slots, pos, valid, raw, norm_weight,
                                                         cos, sin, r)


# ------------------------------------------------------------------------------------------ unpaged attention
@_registry.custom_op("qwen4exp::qsa_attention", mutates_args=())
def qsa_attention_op(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, index_q: Optional[Tensor],
                     block_keys: Optional[Tensor], r: int, budget: int, scale: float, index_scale: float) -> Tensor:
    return tk.qsa_attention_triton(q, k, v, q_pos, index_q, block_keys, r, budget, scale, index_scale)


@qsa_attention_op.register_fake
def _(q, k, v, q_pos, index_q, block_keys, r, budget, scale, index_scale):
    return torch.empty_like(q)


def qsa_attention(q, k, v, q_pos, index_q, block_keys, r, budget, scale, index_scale, q_chunk: int = 512):
    if not supported(q, k, v, q_pos, index_q, block_keys, r, budget):
        return ref.qsa_attention(q, k, v, q_pos, index_q, block_keys, r, budget, scale, index_scale, q_chunk)
    _registry.ran("qsa_attention", "kernel")
    return qsa_attention_op(q, k, v, q_pos, index_q, block_keys, r, budget, float(scale), float(index_scale))


# -------------------------------------------------------------------------------------------------- paged decode
@_registry.custom_op("qwen4exp::qsa_decode_paged", mutates_args=())
def qsa_decode_paged_op(q: Tensor, q_pos: Tensor, index_q: Tensor, kv: Tensor, block_table: Tensor, index_kv: Tensor,
                        index_block_table: Tensor, n_blocks: int, r: int, budget: int, scale: float,
                        index_scale: float, gate: Optional[Tensor]) -> Tensor:
    return tk.qsa_decode_paged_triton(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, n_blocks,
                                      r, budget, scale, index_scale, gate)


@qsa_decode_paged_op.register_fake
def _(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, n_blocks, r, budget, scale, index_scale,
      gate):
    return torch.empty_like(q)


def qsa_decode_paged(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, n_blocks, r, budget, scale,
                     index_scale, gate=None):
    if not (paged_supported(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, r, budget)
            and host.gate_covers(q, gate)):
        return ref.qsa_decode_paged(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, n_blocks,
                                    r, budget, scale, index_scale, gate)
    _registry.ran("qsa_decode_paged", "kernel")
    return qsa_decode_paged_op(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, int(n_blocks), r,
                               budget, float(scale), float(index_scale), gate)


@_registry.custom_op("qwen4exp::qsa_select_paged", mutates_args=())
def qsa_select_paged_op(q_pos: Tensor, index_q: Tensor, index_kv: Tensor, index_block_table: Tensor, n_blocks: int,
                        r: int, budget: int, index_scale: float) -> Tensor:
    return tk.qsa_select_paged_triton(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget,
                                      index_scale).long()


@qsa_select_paged_op.register_fake
def _(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget, index_scale):
    return q_pos.new_empty((q_pos.shape[0], budget // r), dtype=torch.long)


def qsa_select_paged(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget, index_scale):
    if not select_paged_supported(index_q, index_kv, index_block_table, r):
        return ref.qsa_select_paged(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget, index_scale)
    _registry.ran("qsa_select_paged", "kernel")
    return qsa_select_paged_op(q_pos, index_q, index_kv, index_block_table, int(n_blocks), r, budget,
                               float(index_scale))


@_registry.custom_op("qwen4exp::qsa_attend_paged", mutates_args=())
def qsa_attend_paged_op(q: Tensor, q_pos: Tensor, kv: Tensor, block_table: Tensor, block_ids: Tensor, r: int,
                        scale: float, gate: Optional[Tensor]) -> Tensor:
    return tk.qsa_attend_paged_triton(q, q_pos, kv, block_table, block_ids, r, scale, gate)


@qsa_attend_paged_op.register_fake
def _(q, q_pos, kv, block_table, block_ids, r, scale, gate):
    return torch.empty_like(q)


def qsa_attend_paged(q, q_pos, kv, block_table, block_ids, r, budget, scale, gate=None):
    if not (attend_paged_supported(q, kv, block_table, r) and host.gate_covers(q, gate)):
        return ref.qsa_attend_paged(q, q_pos, kv, block_table, block_ids, r, budget, scale, gate)
    _registry.ran("qsa_attend_paged", "kernel")
    return qsa_attend_paged_op(q, q_pos, kv, block_table, block_ids, r, float(scale), gate)


# ------------------------------------------------------------------------------------------------- paged prefill
@_registry.custom_op("qwen4exp::qsa_prefill_paged", mutates_args=())
def qsa_prefill_paged_op(q: Tensor, q_pos: Tensor, index_q: Tensor, kv: Tensor, block_row: Tensor, index_kv: Tensor,
                         seq_len: int, r: int, budget: int, scale: float, index_scale: float) -> Tensor:
    return tk.qsa_prefill_paged_triton(q, q_pos, index_q, kv, block_row, index_kv, seq_len, r, budget, scale,
                                       index_scale)


@qsa_prefill_paged_op.register_fake
def _(q, q_pos, index_q, kv, block_row, index_kv, seq_len, r, budget, scale, index_scale):
    return torch.empty_like(q)


def qsa_prefill_paged(q, q_pos, index_q, kv, block_row, index_kv, seq_len, r, budget, scale, index_scale):
    if not prefill_paged_supported(q, q_pos, index_q, kv, block_row, index_kv, r, budget):
        return ref.qsa_prefill_paged(q, q_pos, index_q, kv, block_row, index_kv, seq_len, r, budget, scale,
                                     index_scale)
    _registry.ran("qsa_prefill_paged", "kernel")
    return qsa_prefill_paged_op(q, q_pos, index_q, kv, block_row, index_kv, int(seq_len), r, budget, float(scale),
                                float(index_scale))


# -------------------------------------------------------------------------------------------------- cache writes
@_registry.custom_op("qwen4exp::qsa_write_paged", mutates_args=("kv",))
def write_paged_op(kv: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    tk.write_paged_triton(kv, slots, k, v)


@write_paged_op.register_fake
def _(kv, slots, k, v):
    return None


def write_paged(kv, slots, k, v):
    if not write_paged_supported(kv, slots, k, v):
        return ref.write_paged(kv, slots, k, v)
    _registry.ran("qsa_write_paged", "kernel")
    write_paged_op(kv, slots, k, v)


@_registry.custom_op("qwen4exp::qsa_index_update_decode", mutates_args=("index_kv", "ring"))
def index_update_op(index_kv: Tensor, ring: Tensor, slots: Tensor, pos: Tensor, valid: Tensor, raw: Tensor,
                    norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor, r: int) -> None:
    tk.index_update_triton(index_kv, ring, slots, pos, valid, raw, norm_weight, eps, cos, sin, r)


@index_update_op.register_fake
def _(index_kv, ring, slots, pos, valid, raw, norm_weight, eps, cos, sin, r):
    return None


def index_update_decode(index_kv, ring, slots, pos, valid, raw, norm_weight, eps, cos, sin, r):
    if not index_update_supported(index_kv, ring, slots, pos, valid, raw, norm_weight, cos, sin, r):
        return ref.index_update_decode(index_kv, ring, slots, pos, valid, raw, norm_weight, eps, cos, sin, r)
    _registry.ran("qsa_index_update_decode", "kernel")
    index_update_op(index_kv, ring, slots, pos, valid, raw, norm_weight, float(eps), cos, sin, int(r))


@_registry.custom_op("qwen4exp::qsa_decode_writes", mutates_args=("kv", "index_kv", "ring"))
def decode_writes_op(kv: Tensor, index_kv: Tensor, ring: Tensor, slots: Tensor, pos: Tensor, valid: Tensor, k: Tensor,
                     v: Tensor, raw: Tensor, norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                     r: int, nq: int) -> None:
    tk.index_update_triton(index_kv, ring, slots, pos, valid, raw, norm_weight, eps, cos, sin, r, kv, k, v, nq)


@decode_writes_op.register_fake
def _(kv, index_kv, ring, slots, pos, valid, k, v, raw, norm_weight, eps, cos, sin, r, nq):
    return None


def decode_cache_writes(kv, index_kv, ring, slots, pos, valid, k, v, raw, norm_weight, eps, cos, sin, r, nq=1):
    if not (kv.is_cuda and host.decode_writes_covers(kv, index_kv, ring, slots, pos, valid, k, v, raw, norm_weight,
                                                     cos, sin, r, nq)):
        write_paged(kv, slots, k, v)
        if nq > 1:  # (the reference's order: the step's raw keys into the rings before the update reads them)
            ref.write_ring(ring, index_kv.shape[2], slots, pos, raw, write_paged)
        return index_update_decode(index_kv, ring, slots, pos, valid, raw, norm_weight, eps, cos, sin, r)
    _registry.ran("qsa_decode_writes", "kernel")
    decode_writes_op(kv, index_kv, ring, slots, pos, valid, k, v, raw, norm_weight, float(eps), cos, sin, int(r),
                     int(nq))


KERNELS = {
    "qsa_decode_writes": decode_cache_writes,
    "qsa_attention": qsa_attention,
    "qsa_decode_paged": qsa_decode_paged,
    "qsa_select_paged": qsa_select_paged,
    "qsa_attend_paged": qsa_attend_paged,
    "qsa_prefill_paged": qsa_prefill_paged,
    "qsa_write_paged": write_paged,
    "qsa_index_update_decode": index_update_decode,
    "qsa_warm_up_prefill": tk.warm_up_prefill,
    "qsa_warm_up_decode": tk.warm_up_decode,
}
