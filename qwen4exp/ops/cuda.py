"""CUDA (Triton) kernels for the dispatcher: imported lazily by ``_dispatch.pick`` the first time it sees a CUDA
tensor, so that importing ``qwen4exp.ops`` never imports Triton (the CPU environment has none).

Each kernel is a torch custom operator ``qwen4exp::<name>`` (with a fake implementation) so that CUDA-graph capture
and torch.compile treat it as one opaque call.  The registered wrappers check what the kernel covers (dtype,
decode-size batches, shapes) and send everything else to the torch reference, outside the custom op.

The operators are defined straight in a ``torch.library.Library`` fragment (schema inferred from the type hints,
the kernel as its CUDA implementation, the fake as the Meta one) rather than through ``torch.library.custom_op``,
whose Python wrapper (autograd routing, aliasing checks) costs ~20 us more per call (CPU measurement: 26.5 against
6.9 us for an empty op): in eager steps (prefill and mixed batches, outside CUDA graphs) the model calls about ten of
these per layer.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._dispatch import register_kernel
from .gated_delta_rule import fla_kernel as gdn_fla
from .gated_delta_rule import reference as gdn_ref
from .hyper_connection import adjacent_rows as hc_adjacent_rows
from .hyper_connection import reference as hc_ref
from .hyper_connection import triton_kernel as hc_tk
from .moe_combine import reference as moe_ref
from .moe_combine import triton_kernel as moe_tk
from .norm import reference as norm_ref
from .norm import triton_kernel as norm_tk
from .ple import reference as ple_ref
from .ple import triton_kernel as ple_tk
from .qsa import reference as qsa_ref
from .qsa import triton_kernel as qsa_tk
from .rope import reference as rope_ref
from .rope import triton_kernel as rope_tk

Tensor = torch.Tensor
_LIB = torch.library.Library("qwen4exp", "FRAGMENT")  # lives as long as this module: the operators with it


class _CustomOp:
    """``qwen4exp::<name>`` defined from ``fn``'s signature, ``fn`` as its CUDA kernel; calling this object calls
    the operator (the dispatcher, then ``fn``). ``register_fake`` works as a decorator, as custom_op's does."""

    def __init__(self, name: str, fn, mutates_args: tuple[str, ...]):
        self.name = name
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIB.impl(name, fn, "CUDA")  # (any CUDA tensor among the arguments: e.g. a pinned host table + GPU rows)
        self._op = getattr(torch.ops.qwen4exp, name).default

    def register_fake(self, fake):
        torch.library.register_fake(f"qwen4exp::{self.name}", fake, lib=_LIB)
        return fake

    def __call__(self, *args, **kwargs):
        return self._op(*args, **kwargs)


def _custom_op(qualname: str, mutates_args=()):
    ns, _, name = qualname.partition("::")
    assert ns == "qwen4exp", qualname
    return lambda fn: _CustomOp(name, fn, tuple(mutates_args))


# ------------------------------------------------------------------------------------------------ hyper-connection
@_custom_op("qwen4exp::hc_mix", mutates_args=())
def hc_mix_op(H: Tensor, norm_weight: Tensor, down: Tensor, up: Tensor, inj: Optional[Tensor], n: int,
              eps: float, Hn: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return hc_tk.hc_mix_triton(H, norm_weight, down, up, inj, n, eps, Hn)


@hc_mix_op.register_fake
def _(H, norm_weight, down, up, inj, n, eps, Hn=None):
    lead = H.shape[:-1]
    return H.new_empty(*lead, H.shape[-1] // n), H.new_empty(*lead, 0 if inj is None else n)


@_custom_op("qwen4exp::hc_gate_mean", mutates_args=())
def hc_gate_mean_op(g: Tensor, Hn: Tensor, n: int) -> Tensor:
    return hc_tk.hc_gate_mean_triton(g, Hn, n)


@hc_gate_mean_op.register_fake
def _(g, Hn, n):
    return g.new_empty(g.shape[0], g.shape[1] // n)


def hc_mix(H, norm_weight, down, up, inj, n, eps, Hn=None):
    T = H.numel() // max(H.shape[-1], 1)
    if (Hn is None and hc_tk.IN_KERNEL_NORM_MAX_T < T <= hc_tk.MAX_T_HN
            and hc_tk.supported(H, norm_weight, down, up, inj, n, H)):
        # no write-back before this mixer made the norm (the first layer's, the PLE layer's): past a few tokens one
        # norm launch + the kernels' Hn path beat their in-kernel norm (8 tokens) and the cuBLAS path (32)
        Hn = rms_norm(H, norm_weight, H.shape[-1] // n, eps)
    if hc_tk.supported(H, norm_weight, down, up, inj, n, Hn):  # decode sizes: two fused launches
        x, c = hc_mix_op(H, norm_weight, down, up, inj, n, eps, Hn)
        return x, (None if inj is None else c)
    if hc_tk.gemm_path_supported(H, norm_weight, down, up, inj, n, Hn):  # prefill sizes
        return _hc_mix_many_tokens(H, norm_weight, down, up, inj, n, eps, Hn)
    return hc_ref.hc_mix(H, norm_weight, down, up, inj, n, eps, Hn)


@_custom_op("qwen4exp::hc_finish", mutates_args=())
def hc_finish_op(d: Tensor, R: int, n: int, ni: int) -> tuple[Tensor, Tensor]:
    return hc_tk.hc_finish_triton(d, R, n, ni=ni)


@hc_finish_op.register_fake
def _(d, R, n, ni):
    return d.new_empty(d.shape[0], R), d.new_empty(d.shape[0], ni)


def _hc_mix_many_tokens(H, norm_weight, down, up, inj, n, eps, Hn=None):
    """``hc_mix`` past the fused kernel's token count: the reference's projections on cuBLAS (W_down and W_inj as
    one GEMM where they sit together in memory), its grouped norm, its activations (SiLU of the low-rank
    projection, sigmoid of the injection logits) and its gated stream mean as one Triton pass each (in the reference
    the norm and the mean are fp32 elementwise passes over [T, nD]: most of its time at prefill sizes, and the
    activations ~7 small launches)."""
    NK = H.shape[-1]
    D, R = NK // n, down.shape[0]
    Hn = rms_norm(H.reshape(-1, NK), norm_weight, D, eps) if Hn is None else Hn.reshape(-1, NK)
    # padded to 8 rows where the buffer has them: an output row of 324 bf16 columns is not 16-byte aligned, and
    # cuBLAS then runs an sm_80 CUTLASS kernel (run 10: 8.5 us + a split-K reduce for this 6.6 MB GEMM at 32 tokens)
    both = hc_adjacent_rows(down, inj, pad=8)
    NI = 0 if inj is None else inj.shape[0]
    if inj is None:
        d = F.linear(Hn, down)
    elif both is not None:
        d = F.linear(Hn, both)
    else:
        d = torch.cat([F.linear(Hn, down), F.linear(Hn, inj)], -1)
    a, c = hc_finish_op(d, R, n, NI)
    x = hc_gate_mean_op(F.linear(a, up), Hn, n)
    lead = H.shape[:-1]
    return x.view(*lead, D), (None if inj is None else c.view(*lead, n))


@_custom_op("qwen4exp::hc_inject", mutates_args=())
def hc_inject_op(H: Tensor, c: Tensor, y: Tensor) -> Tensor:
    return hc_tk.hc_inject_triton(H, c, y)


@hc_inject_op.register_fake
def _(H, c, y):
    return torch.empty_like(H)


def hc_inject(H, c, y):
    if not hc_tk.hc_inject_supported(H, c, y):
        return hc_ref.hc_inject(H, c, y)
    return hc_inject_op(H, c, y)


@_custom_op("qwen4exp::hc_inject_norm", mutates_args=())
def hc_inject_norm_op(H: Tensor, c: Tensor, y: Tensor, norm_weight: Tensor, n: int, eps: float
                      ) -> tuple[Tensor, Tensor]:
    return hc_tk.hc_inject_norm_triton(H, c, y, norm_weight, n, eps)


@hc_inject_norm_op.register_fake
def _(H, c, y, norm_weight, n, eps):
    return torch.empty_like(H), torch.empty_like(H)


def hc_inject_norm(H, c, y, norm_weight, n, eps):
    if not (hc_tk.hc_inject_supported(H, c, y) and c.shape[-1] == n and norm_weight.numel() == H.shape[-1]
            and y.shape[-1] <= norm_tk.MAX_GROUP):
        return hc_ref.hc_inject_norm(H, c, y, norm_weight, n, eps)
    return hc_inject_norm_op(H, c, y, norm_weight, n, eps)


# ------------------------------------------------------------------------------------------------------------ QSA
@_custom_op("qwen4exp::qsa_attention", mutates_args=())
def qsa_attention_op(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, index_q: Optional[Tensor],
                     block_keys: Optional[Tensor], r: int, budget: int, scale: float, index_scale: float) -> Tensor:
    return qsa_tk.qsa_attention_triton(q, k, v, q_pos, index_q, block_keys, r, budget, scale, index_scale)


@qsa_attention_op.register_fake
def _(q, k, v, q_pos, index_q, block_keys, r, budget, scale, index_scale):
    return torch.empty_like(q)


def qsa_attention(q, k, v, q_pos, index_q, block_keys, r, budget, scale, index_scale, q_chunk: int = 512):
    if not qsa_tk.supported(q, k, v, q_pos, index_q, block_keys, r, budget):
        return qsa_ref.qsa_attention(q, k, v, q_pos, index_q, block_keys, r, budget, scale, index_scale, q_chunk)
    return qsa_attention_op(q, k, v, q_pos, index_q, block_keys, r, budget, float(scale), float(index_scale))


@_custom_op("qwen4exp::qsa_decode_paged", mutates_args=())
def qsa_decode_paged_op(q: Tensor, q_pos: Tensor, index_q: Tensor, kv: Tensor, block_table: Tensor, index_kv: Tensor,
                        index_block_table: Tensor, n_blocks: int, r: int, budget: int, scale: float,
                        index_scale: float) -> Tensor:
    return qsa_tk.qsa_decode_paged_triton(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, n_blocks,
                                          r, budget, scale, index_scale)


@qsa_decode_paged_op.register_fake
def _(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, n_blocks, r, budget, scale, index_scale):
    return torch.empty_like(q)


def qsa_decode_paged(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, n_blocks, r, budget, scale,
                     index_scale):
    if not qsa_tk.paged_supported(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, r, budget):
        return qsa_ref.qsa_decode_paged(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, n_blocks,
                                        r, budget, scale, index_scale)
    return qsa_decode_paged_op(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, int(n_blocks), r,
                               budget, float(scale), float(index_scale))


@_custom_op("qwen4exp::qsa_select_paged", mutates_args=())
def qsa_select_paged_op(q_pos: Tensor, index_q: Tensor, index_kv: Tensor, index_block_table: Tensor, n_blocks: int,
                        r: int, budget: int, index_scale: float) -> Tensor:
    return qsa_tk.qsa_select_paged_triton(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget,
                                          index_scale).long()


@qsa_select_paged_op.register_fake
def _(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget, index_scale):
    return q_pos.new_empty((q_pos.shape[0], budget // r), dtype=torch.long)


def qsa_select_paged(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget, index_scale):
    if not qsa_tk.select_paged_supported(index_q, index_kv, index_block_table, r):
        return qsa_ref.qsa_select_paged(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget, index_scale)
    return qsa_select_paged_op(q_pos, index_q, index_kv, index_block_table, int(n_blocks), r, budget,
                               float(index_scale))


@_custom_op("qwen4exp::qsa_attend_paged", mutates_args=())
def qsa_attend_paged_op(q: Tensor, q_pos: Tensor, kv: Tensor, block_table: Tensor, block_ids: Tensor, r: int,
                        scale: float) -> Tensor:
    return qsa_tk.qsa_attend_paged_triton(q, q_pos, kv, block_table, block_ids, r, scale)


@qsa_attend_paged_op.register_fake
def _(q, q_pos, kv, block_table, block_ids, r, scale):
    return torch.empty_like(q)


def qsa_attend_paged(q, q_pos, kv, block_table, block_ids, r, budget, scale):
    if not qsa_tk.attend_paged_supported(q, kv, block_table, r):
        return qsa_ref.qsa_attend_paged(q, q_pos, kv, block_table, block_ids, r, budget, scale)
    return qsa_attend_paged_op(q, q_pos, kv, block_table, block_ids, r, float(scale))


@_custom_op("qwen4exp::qsa_prefill_paged", mutates_args=())
def qsa_prefill_paged_op(q: Tensor, q_pos: Tensor, index_q: Tensor, kv: Tensor, block_row: Tensor, index_kv: Tensor,
                         seq_len: int, r: int, budget: int, scale: float, index_scale: float) -> Tensor:
    return qsa_tk.qsa_prefill_paged_triton(q, q_pos, index_q, kv, block_row, index_kv, seq_len, r, budget, scale,
                                           index_scale)


@qsa_prefill_paged_op.register_fake
def _(q, q_pos, index_q, kv, block_row, index_kv, seq_len, r, budget, scale, index_scale):
    return torch.empty_like(q)


def qsa_prefill_paged(q, q_pos, index_q, kv, block_row, index_kv, seq_len, r, budget, scale, index_scale):
    if not qsa_tk.prefill_paged_supported(q, q_pos, index_q, kv, block_row, index_kv, r, budget):
        return qsa_ref.qsa_prefill_paged(q, q_pos, index_q, kv, block_row, index_kv, seq_len, r, budget, scale,
                                         index_scale)
    return qsa_prefill_paged_op(q, q_pos, index_q, kv, block_row, index_kv, int(seq_len), r, budget, float(scale),
                                float(index_scale))


# ------------------------------------------------------------------------------------------------------------ PLE
@_custom_op("qwen4exp::ple_lookup", mutates_args=())
def ple_lookup_op(table: Tensor, rows: Tensor, scale: Optional[Tensor], out_dtype: torch.dtype) -> Tensor:
    return ple_tk.ple_lookup_triton(table, rows, scale, out_dtype)


@ple_lookup_op.register_fake
def _(table, rows, scale, out_dtype):
    return rows.new_empty(*rows.shape[:-1], rows.shape[-1] * table.shape[1], dtype=out_dtype)


def ple_lookup(table, rows, scale=None, out_dtype=None):
    """``table`` on the GPU or pinned on the host (gathered through UVA); ``rows`` on the GPU."""
    if not ple_tk.supported(table, rows, scale, out_dtype):
        return ple_ref.ple_lookup(table, rows, scale, out_dtype)
    dt = out_dtype or (table.dtype if scale is None else torch.bfloat16)
    return ple_lookup_op(table, rows, scale, dt)


@_custom_op("qwen4exp::ngram_lookup_decode", mutates_args=())
def ngram_lookup_decode_op(ids: Tensor, prev: Tensor, eos: int, multipliers: Tensor, head_sizes: Tensor,
                           head_offsets: Tensor, heads_per_ngram: int, table: Tensor, scale: Optional[Tensor],
                           out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return ple_tk.ngram_lookup_decode_triton(ids, prev, eos, multipliers, head_sizes, head_offsets, heads_per_ngram,
                                             table, scale, out_dtype)


@ngram_lookup_decode_op.register_fake
def _(ids, prev, eos, multipliers, head_sizes, head_offsets, heads_per_ngram, table, scale, out_dtype):
    return (ids.new_empty(ids.shape[0], head_sizes.shape[0] * table.shape[1], dtype=out_dtype),
            torch.empty_like(prev))


def ngram_lookup_decode(ids, prev, eos, multipliers, head_sizes, head_offsets, heads_per_ngram, table, scale=None,
                        out_dtype=None):
    """Decode: n-gram context, hashing and the gather in one launch (table on the GPU or pinned on the host)."""
    if not ple_tk.ngram_lookup_decode_supported(ids, prev, table, scale, out_dtype):
        return ple_ref.ngram_lookup_decode(ids, prev, eos, multipliers, head_sizes, head_offsets, heads_per_ngram,
                                           table, scale, out_dtype)
    dt = out_dtype or (table.dtype if scale is None else torch.bfloat16)
    return ngram_lookup_decode_op(ids, prev, int(eos), multipliers, head_sizes, head_offsets, int(heads_per_ngram),
                                  table, scale, dt)


@_custom_op("qwen4exp::ple_mix_decode", mutates_args=())
def ple_mix_decode_op(H: Tensor, k: Tensor, v: Tensor, query_norm_weight: Tensor, conv_norm_weight: Tensor,
                      conv_weight: Tensor, conv_state: Tensor, n: int, eps: float,
                      dilation: int) -> tuple[Tensor, Tensor]:
    return ple_tk.ple_mix_decode_triton(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, conv_state, n,
                                        eps, dilation)


@ple_mix_decode_op.register_fake
def _(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, conv_state, n, eps, dilation):
    return torch.empty_like(H), conv_state.new_empty(conv_state.shape, dtype=conv_weight.dtype)


def ple_mix(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, cu_seqlens, conv_state, n, eps, dilation):
    """One token per sequence (decode): one launch; prefill and mixed batches: the reference."""
    if not ple_tk.ple_mix_decode_supported(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, cu_seqlens,
                                           conv_state, n):
        return ple_ref.ple_mix(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, cu_seqlens, conv_state,
                               n, eps, dilation)
    return ple_mix_decode_op(H, k, v, query_norm_weight, conv_norm_weight, conv_weight, conv_state, n, float(eps),
                             int(dilation))


@_custom_op("qwen4exp::qsa_write_paged", mutates_args=("kv",))
def write_paged_op(kv: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    qsa_tk.write_paged_triton(kv, slots, k, v)


@write_paged_op.register_fake
def _(kv, slots, k, v):
    return None


def write_paged(kv, slots, k, v):
    if not qsa_tk.write_paged_supported(kv, slots, k, v):
        return qsa_ref.write_paged(kv, slots, k, v)
    write_paged_op(kv, slots, k, v)


@_custom_op("qwen4exp::qsa_index_update_decode", mutates_args=("index_kv",))
def index_update_op(index_kv: Tensor, slots: Tensor, block_table: Tensor, pos: Tensor, valid: Tensor, raw: Tensor,
                    norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor, r: int) -> None:
    qsa_tk.index_update_triton(index_kv, slots, block_table, pos, valid, raw, norm_weight, eps, cos, sin, r)


@index_update_op.register_fake
def _(index_kv, slots, block_table, pos, valid, raw, norm_weight, eps, cos, sin, r):
    return None


def index_update_decode(index_kv, slots, block_table, pos, valid, raw, norm_weight, eps, cos, sin, r):
    if not qsa_tk.index_update_supported(index_kv, slots, block_table, pos, valid, raw, norm_weight, cos, sin, r):
        return qsa_ref.index_update_decode(index_kv, slots, block_table, pos, valid, raw, norm_weight, eps, cos,
                                           sin, r)
    index_update_op(index_kv, slots, block_table, pos, valid, raw, norm_weight, float(eps), cos, sin, int(r))


# ------------------------------------------------------------------------------------------------- MoE output
@_custom_op("qwen4exp::shared_gate_combine", mutates_args=())
def shared_gate_combine_op(x: Tensor, gate_weight: Tensor, shared: Tensor, routed: Tensor) -> Tensor:
    return moe_tk.shared_gate_combine_triton(x, gate_weight, shared, routed)


@shared_gate_combine_op.register_fake
def _(x, gate_weight, shared, routed):
    return torch.empty_like(routed)


def shared_gate_combine(x, gate_weight, shared, routed):
    if not moe_tk.supported(x, gate_weight, shared, routed):
        return moe_ref.shared_gate_combine(x, gate_weight, shared, routed)
    return shared_gate_combine_op(x, gate_weight, shared, routed)


# ------------------------------------------------------------------------------------------------- norm, RoPE
@_custom_op("qwen4exp::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, group: int, eps: float) -> Tensor:
    return norm_tk.rms_norm_triton(x, weight, group, eps)


@rms_norm_op.register_fake
def _(x, weight, group, eps):
    return torch.empty_like(x)


def rms_norm(x, weight, group, eps):
    if not norm_tk.supported(x, weight, group):
        return norm_ref.grouped_rms_norm(x, weight, group, eps)
    return rms_norm_op(x, weight, int(group), float(eps))


@_custom_op("qwen4exp::apply_rope", mutates_args=())
def apply_rope_op(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return rope_tk.apply_rope_triton(x, cos, sin)


@apply_rope_op.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)


@_custom_op("qwen4exp::norm_rope", mutates_args=())
def norm_rope_op(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    return rope_tk.norm_rope_triton(x, weight, eps, cos, sin)


@norm_rope_op.register_fake
def _(x, weight, eps, cos, sin):
    return x.new_empty(x.shape)


def norm_rope(x, weight, eps, cos, sin):
    if not rope_tk.norm_rope_supported(x, weight, cos, sin):  # (the two kernels, or their references)
        return apply_rope(rms_norm(x, weight, x.shape[-1], eps), cos, sin)
    return norm_rope_op(x, weight, float(eps), cos, sin)


def apply_rope(x, cos, sin):
    if not rope_tk.supported(x, cos, sin):
        return rope_ref.apply_rope(x, cos, sin)
    return apply_rope_op(x, cos, sin)


# ------------------------------------------------------------------------------------ gated delta rule (fla-core)
_FLA = gdn_fla.load()


@_custom_op("qwen4exp::gdn_chunk", mutates_args=())
def gdn_chunk_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                 initial_state: Optional[Tensor], scale: Optional[float], use_qk_l2norm: bool) -> tuple[Tensor, Tensor]:
    return gdn_fla.run(_FLA[0], q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


@_custom_op("qwen4exp::gdn_recurrent", mutates_args=())
def gdn_recurrent_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                     initial_state: Optional[Tensor], scale: Optional[float],
                     use_qk_l2norm: bool) -> tuple[Tensor, Tensor]:
    return gdn_fla.run(_FLA[1], q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


@gdn_chunk_op.register_fake
@gdn_recurrent_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    N = cu_seqlens.shape[0] - 1
    return v.new_empty(v.shape), v.new_empty(N, v.shape[-2], q.shape[-1], v.shape[-1], dtype=torch.float32)


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True):
    if _FLA is None or not gdn_fla.supported(q, k, v, g, beta):
        return gdn_ref.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    return gdn_chunk_op(q, k, v, g, beta, cu_seqlens, initial_state, scale, bool(use_qk_l2norm))


def recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True):
    if _FLA is None or not gdn_fla.supported(q, k, v, g, beta):
        return gdn_ref.recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    return gdn_recurrent_op(q, k, v, g, beta, cu_seqlens, initial_state, scale, bool(use_qk_l2norm))


register_kernel("chunk_gated_delta_rule", "cuda", chunk_gated_delta_rule)
register_kernel("recurrent_gated_delta_rule", "cuda", recurrent_gated_delta_rule)
register_kernel("hc_mix", "cuda", hc_mix)
register_kernel("hc_inject", "cuda", hc_inject)
register_kernel("hc_inject_norm", "cuda", hc_inject_norm)
register_kernel("qsa_attention", "cuda", qsa_attention)
register_kernel("qsa_decode_paged", "cuda", qsa_decode_paged)
register_kernel("qsa_select_paged", "cuda", qsa_select_paged)
register_kernel("qsa_attend_paged", "cuda", qsa_attend_paged)
register_kernel("qsa_prefill_paged", "cuda", qsa_prefill_paged)
register_kernel("qsa_write_paged", "cuda", write_paged)
register_kernel("qsa_index_update_decode", "cuda", index_update_decode)
register_kernel("ple_lookup", "cuda", ple_lookup)
register_kernel("ple_mix", "cuda", ple_mix)
register_kernel("ngram_lookup_decode", "cuda", ngram_lookup_decode)
register_kernel("rms_norm", "cuda", rms_norm)
register_kernel("shared_gate_combine", "cuda", shared_gate_combine)
register_kernel("apply_rope", "cuda", apply_rope)
register_kernel("norm_rope", "cuda", norm_rope)
