"""PLE's CUDA kernels as ``qwen4exp::`` custom operators (``_registry``), and the host wrappers the dispatcher
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
def supported(table, rows, scale, out_dtype) -> bool:
    """``ple_lookup``: rows on the GPU; the table on the GPU or pinned on the host (read through UVA); a scale on
    the GPU or on the host (passed by value)."""
    return (rows.is_cuda and (table.is_cuda or (table.device.type == "cpu" and table.is_pinned()))
            and (scale is None or scale.is_cuda or scale.device.type == "cpu")
            and host.lookup_covers(table, rows, scale, out_dtype))


def ngram_lookup_decode_supported(ids, prev, table, scale, out_dtype) -> bool:
    return (ids.is_cuda and prev.is_cuda and host.ngram_lookup_decode_covers(ids, prev)
            and supported(table, ids.unsqueeze(1), scale, out_dtype))


def ple_mix_decode_supported(H, k, v, qw, cw, wc, cu_seqlens, state, n: int) -> bool:
    return H.is_cuda and host.ple_mix_decode_covers(H, k, v, qw, cw, wc, cu_seqlens, state, n)


# ------------------------------------------------------------------------------------------------------ lookups
@_registry.custom_op("qwen4exp::ple_lookup", mutates_args=())
def ple_lookup_op(table: Tensor, rows: Tensor, scale: Optional[Tensor], out_dtype: torch.dtype) -> Tensor:
    return tk.ple_lookup_triton(table, rows, scale, out_dtype)


@ple_lookup_op.register_fake
def _(table, rows, scale, out_dtype):
    return rows.new_empty(*rows.shape[:-1], rows.shape[-1] * table.shape[1], dtype=out_dtype)


def ple_lookup(table, rows, scale=None, out_dtype=None):
    """``table`` on the GPU or pinned on the host (gathered through UVA); ``rows`` on the GPU."""
    if not supported(table, rows, scale, out_dtype):
        return ref.ple_lookup(table, rows, scale, out_dtype)
    _registry.ran("ple_lookup", "kernel")
    return ple_lookup_op(table, rows, scale, host.out_dtype_of(table, scale, out_dtype))


@_registry.custom_op("qwen4exp::ngram_lookup_decode", mutates_args=())
def ngram_lookup_decode_op(ids: Tensor, prev: Tensor, eos: int, multipliers: Tensor, head_sizes: Tensor,
                           head_offsets: Tensor, heads_per_ngram: int, table: Tensor, scale: Optional[Tensor],
                           out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return tk.ngram_lookup_decode_triton(ids, prev, eos, multipliers, head_sizes, head_offsets, heads_per_ngram,
                                         table, scale, out_dtype)


@ngram_lookup_decode_op.register_fake
def _(ids, prev, eos, multipliers, head_sizes, head_offsets, heads_per_ngram, table, scale, out_dtype):
    return (ids.new_empty(ids.shape[0], head_sizes.shape[0] * table.shape[1], dtype=out_dtype),
            torch.empty_like(prev))


def ngram_lookup_decode(ids, prev, eos, multipliers, head_sizes, head_offsets, heads_per_ngram, table, scale=None,
                        out_dtype=None):
    """Decode: n-gram context, hashing and the gather in one launch (table on the GPU or pinned on the host)."""
    if not ngram_lookup_decode_supported(ids, prev, table, scale, out_dtype):
        return ref.ngram_lookup_decode(ids, prev, eos, multipliers, head_sizes, head_offsets, heads_per_ngram,
                                       table, scale, out_dtype, lookup=ple_lookup)
    _registry.ran("ngram_lookup_decode", "kernel")
    return ngram_lookup_decode_op(ids, prev, int(eos), multipliers, head_sizes, head_offsets, int(heads_per_ngram),
                                  table, scale, host.out_dtype_of(table, scale, out_dtype))


# ---------------------------------------------------------------------------------------------------------- mix
@_registry.custom_op("qwen4exp::ple_mix_decode", mutates_args=())
def ple_mix_decode_op(H: Tensor, k: Tensor, v: Tensor, query_norm_weight: Tensor, conv_norm_weight: Tensor,
                      conv_weight: Tensor, conv_state: Tensor, n: int, eps: float,
                      dilation: int) -> tuple[Tensor, Tensor]:
    return tk.ple_mix_decode_triton(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, conv_state, n,
                                    eps, dilation)


@ple_mix_decode_op.register_fake
def _(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, conv_state, n, eps, dilation):
    return torch.empty_like(H), conv_state.new_empty(conv_state.shape, dtype=conv_weight.dtype)


def ple_mix(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, cu_seqlens, conv_state, n, eps, dilation):
    """One token per sequence (decode): one launch; prefill and mixed batches: the reference."""
    if not ple_mix_decode_supported(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, cu_seqlens,
                                    conv_state, n):
        return ref.ple_mix(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, cu_seqlens, conv_state,
                           n, eps, dilation)
    _registry.ran("ple_mix", "kernel")
    return ple_mix_decode_op(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, conv_state, n, float(eps),
                             int(dilation))


KERNELS = {"ple_lookup": ple_lookup, "ngram_lookup_decode": ngram_lookup_decode, "ple_mix": ple_mix}
