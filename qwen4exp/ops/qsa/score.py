"""QSA stage 1, the indexer's block scores: s_j = scale * sum_h relu(q_h . K_j) (fp32 accumulation of exact bf16
products) for every block key a query can see, as int64 sort keys (orderable score bits << 32) | (2^32 - 1 - j)
(INT64_MIN for blocks the query cannot see yet): unique, and ordered like the reference's stable sort ("higher score
first, lower block id on ties"). ``_qsa_score_kernel`` over unpaged block keys, ``_qsa_score_paged_kernel`` (one
query a row, keys read through the block table; or fp32 scores + visible counts for vLLM's select),
``_qsa_score_prefill_kernel`` (tiles of queries x block keys of one sequence)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import dot as _dot
from . import launch

_KEY_MIN = tl.constexpr(launch.INT64_MIN)


@triton.jit(do_not_specialize_on_alignment=launch.ROW_VIEWS)
def _qsa_score_kernel(IQ, BK, QPOS, KEYS, Nb, r, scale,
                      stride_qt, stride_qh, stride_kb, stride_keys_t,
                      HI: tl.constexpr, HI_P: tl.constexpr, DI: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.program_id(1)
    offs_h = tl.arange(0, HI_P)
    offs_d = tl.arange(0, DI)
    q = tl.load(IQ + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=(offs_h < HI)[:, None],
                other=0.0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < Nb
    k = tl.load(BK + offs_n[:, None] * stride_kb + offs_d[None, :], mask=nmask[:, None], other=0.0)
    n_complete = (tl.load(QPOS + t).to(tl.int64) + 1) // r
    key = _order_key(_dot(k, tl.trans(q)), offs_n, n_complete, scale)
    tl.store(KEYS + t * stride_keys_t + offs_n, key, mask=nmask)


@triton.jit
def _sort_key(s, ids, visible):
    """Final scores (fp32), block ids, visibility (broadcast together) -> int64 sort keys (orderable score bits
    << 32) | (2^32 - 1 - id); INT64_MIN where not visible."""
    s = s + 0.0  # -0.0 -> +0.0 (they tie in the reference)
    bits = s.to(tl.int32, bitcast=True)
    key32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
    key = (key32.to(tl.int64) << 32) + (4294967295 - ids.to(tl.int64))
    return tl.where(visible, key, _KEY_MIN)


@triton.jit
def _order_key(s, offs_n, n_complete, scale):
    """Scores [BLOCK_N, HI_P] (q . K per head, fp32) of one query -> its sort keys (``_sort_key``)."""
    return _sort_key(tl.sum(tl.maximum(s, 0.0), axis=1) * scale, offs_n, offs_n < n_complete)


# The key stores are masked by offs_n < Nb, Nb not specialised: Triton cannot vectorise them whatever the row stride's
# divisibility, so specialising stride_keys_t (n_blocks, or it rounded up to 4) bought nothing but a second variant
# (a context of a multiple of 16 blocks compiled it mid-serving; MTP verifications reach it).
@triton.jit(do_not_specialize=['Nb', 'n_bt', 'stride_bt', 'stride_keys_t'],
            do_not_specialize_on_alignment=launch.ROW_VIEWS)
def _qsa_score_paged_kernel(IQ, IKV, IBT, QPOS, KEYS, VIS, Nb, r, scale, n_bt,
                            stride_qt, stride_qh, stride_kvb, stride_kvl, stride_bt, stride_keys_t,
                            HI: tl.constexpr, HI_P: tl.constexpr, DI: tl.constexpr, IBS: tl.constexpr,
                            BLOCK_N: tl.constexpr, LOGITS: tl.constexpr = False):
    """``_qsa_score_kernel`` for a batch of single queries, each reading its own block keys out of the paged index
    cache: block j's key is the V half of the row of token j*r + r - 1 (the token that completed it). LOGITS: the
    fp32 scores themselves instead of sort keys (blocks past a query's end: 0), and each query's visible block
    count min(n_complete, Nb) into VIS (int32, what vLLM's select reads; written by the row's first program)."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < Nb
    n_complete = (tl.load(QPOS + t).to(tl.int64) + 1) // r
    vis = nmask & (offs_n < n_complete)  # blocks past a query's end load nothing (its key is INT64_MIN)
    offs_h = tl.arange(0, HI_P)
    offs_d = tl.arange(0, DI)
    q = tl.load(IQ + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=(offs_h < HI)[:, None],
                other=0.0)
    tok = offs_n.to(tl.int64) * r + r - 1
    page = tl.minimum(tok // IBS, n_bt - 1)
    phys = tl.load(IBT + t * stride_bt + page, mask=vis, other=0).to(tl.int64)
    row = phys * stride_kvb + (tok % IBS) * stride_kvl + DI
    k = tl.load(IKV + row[:, None] + offs_d[None, :], mask=vis[:, None], other=0.0).to(tl.bfloat16)  # FP8: exact
    if LOGITS:
        sc = tl.sum(tl.maximum(_dot(k, tl.trans(q)), 0.0), axis=1) * scale
        tl.store(KEYS + t * stride_keys_t + offs_n, sc + 0.0, mask=nmask)  # (-0.0 -> +0.0, as the sort keys)
        tl.store(VIS + t, tl.minimum(n_complete, Nb).to(tl.int32), mask=pid == 0)
    else:
        key = _order_key(_dot(k, tl.trans(q)), offs_n, n_complete, scale)
        tl.store(KEYS + t * stride_keys_t + offs_n, key, mask=nmask)


@triton.jit(do_not_specialize=['Tq', 'Nb', 'n_bt', 'stride_keys_t'], do_not_specialize_on_alignment=launch.ROW_VIEWS)
def _qsa_score_prefill_kernel(IQ, IKV, IBT, QPOS, KEYS, Tq, Nb, r, scale, n_bt,
                              stride_qt, stride_qh, stride_kvb, stride_kvl, stride_keys_t,
                              HI: tl.constexpr, DI: tl.constexpr, IBS: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, LOGITS: tl.constexpr = False, STACK: tl.constexpr = False):
    """Sort keys of BLOCK_M queries of ONE sequence x BLOCK_N of its block keys (read through its block-table row
    IBT from the paged index cache, as ``_qsa_score_paged_kernel``): one load of the block keys serves BLOCK_M
    queries (prefill), and each head's scores are a [BLOCK_M, DI] x [DI, BLOCK_N] product (STACK: the HI heads'
    queries as the rows of one [BLOCK_M * HI, DI] x [DI, BLOCK_N] product; HI a power of two; the heads' ReLU
    terms still summed in head order, so the same bits). LOGITS: the fp32 scores themselves (what vLLM's select
    reads; a query's blocks past its end hold values it does not read, so tiles past every query's end store
    nothing)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < Tq
    n_complete = (tl.load(QPOS + offs_m, mask=mmask, other=0).to(tl.int64) + 1) // r
    n_seen = tl.max(n_complete, axis=0)
    if LOGITS:
        if pid_n * BLOCK_N >= n_seen:  # (the causal triangle's far side: a prefill's first chunks)
            return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    vis = (offs_n < Nb) & (offs_n < n_seen)  # blocks no query of the tile sees: not loaded
    offs_d = tl.arange(0, DI)
    tok = offs_n.to(tl.int64) * r + r - 1
    phys = tl.load(IBT + tl.minimum(tok // IBS, n_bt - 1), mask=vis, other=0).to(tl.int64)
    row = phys * stride_kvb + (tok % IBS) * stride_kvl + DI
    k = tl.load(IKV + row[:, None] + offs_d[None, :], mask=vis[:, None], other=0.0).to(tl.bfloat16)  # FP8: exact
    s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if STACK:
        offs_i = tl.arange(0, BLOCK_M * HI)  # row i: query i // HI, head i % HI
        t_i = pid_m * BLOCK_M + offs_i // HI
        qa = tl.load(IQ + t_i[:, None] * stride_qt + (offs_i % HI)[:, None] * stride_qh + offs_d[None, :],
                     mask=(t_i < Tq)[:, None], other=0.0)
        sa = tl.reshape(tl.maximum(_dot(qa, tl.trans(k)), 0.0), (BLOCK_M, HI, BLOCK_N))
        heads = tl.arange(0, HI)[None, :, None]
        for h in tl.static_range(HI):  # head h's terms alone (the others masked to +0.0: exact), in head order
            s += tl.sum(tl.where(heads == h, sa, 0.0), axis=1)
    else:
        for h in tl.static_range(HI):
            qh = tl.load(IQ + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mmask[:, None],
                         other=0.0)
            s += tl.maximum(_dot(qh, tl.trans(k)), 0.0)
    if LOGITS:
        out = s * scale + 0.0  # (-0.0 -> +0.0, as the sort keys)
    else:
        out = _sort_key(s * scale, offs_n[None, :], offs_n[None, :] < n_complete[:, None])
    tl.store(KEYS + offs_m[:, None].to(tl.int64) * stride_keys_t + offs_n[None, :], out,
             mask=mmask[:, None] & (offs_n < Nb)[None, :])


def score_keys(q_pos, index_q, block_keys, r: int, index_scale: float):
    """[Tq, Nb] int64 sort keys of the indexer scores (INT64_MIN for blocks a query cannot see)."""
    Tq = q_pos.shape[0]
    Nb = block_keys.shape[0]
    HI, DI = index_q.shape[1], index_q.shape[2]
    keys = torch.empty(Tq, Nb, dtype=torch.int64, device=q_pos.device)
    BLOCK_N = 64
    launch.LAUNCHED.keep("qsa_score", _qsa_score_kernel[(triton.cdiv(Nb, BLOCK_N), Tq)](
        index_q, block_keys, q_pos, keys, Nb, r, float(index_scale),
        index_q.stride(0), index_q.stride(1), block_keys.stride(0), keys.stride(0),
        HI=HI, HI_P=max(16, triton.next_power_of_2(HI)), DI=DI, BLOCK_N=BLOCK_N, num_warps=4))
    return keys


def paged_score_keys(q_pos, index_q, index_kv, index_block_table, n_blocks: int, r: int, index_scale: float,
                     logits: bool = False):
    """[B, n_blocks] int64 sort keys of single queries against their paged block keys (``_qsa_score_paged_kernel``);
    ``logits``: (the fp32 scores instead, rows 16-byte aligned (vLLM's select reads them with TMA), the visible
    block counts [B] int32) -- the counts from the same kernel, not four small torch ops a layer."""
    B, HI, DI = index_q.shape
    if logits:
        keys = torch.empty(B, -(-n_blocks // 4) * 4, dtype=torch.float32, device=index_q.device)[:, :n_blocks]
        vis = torch.empty(B, dtype=torch.int32, device=index_q.device)
    else:
        keys = torch.empty(B, n_blocks, dtype=torch.int64, device=index_q.device)
        vis = keys  # (not written)
    BN = launch.SCORE_PAGED_BLOCK_N
    launch.LAUNCHED.keep("qsa_score_paged", _qsa_score_paged_kernel[(triton.cdiv(n_blocks, BN), B)](
        index_q, index_kv, index_block_table, q_pos, keys, vis, n_blocks, r, float(index_scale),
        index_block_table.shape[1], index_q.stride(0), index_q.stride(1), index_kv.stride(0),
        index_kv.stride(2), index_block_table.stride(0), keys.stride(0),
        HI=HI, HI_P=max(16, triton.next_power_of_2(HI)), DI=DI, IBS=index_kv.shape[2], BLOCK_N=BN,
        LOGITS=logits, num_warps=launch.SCORE_PAGED_WARPS))
    return (keys, vis) if logits else keys


def prefill_score_keys(q_pos, index_q, index_kv, block_row, n_blocks: int, r: int, index_scale: float,
                       logits: bool = False):
    """[Tq, n_blocks] int64 sort keys of queries of one sequence against its paged block keys (tiled kernel);
    ``logits``: (the fp32 scores, rows 16-byte aligned, the visible block counts [Tq] int32) for vLLM's select."""
    Tq, HI, DI = index_q.shape
    if logits:
        keys = torch.empty(Tq, -(-n_blocks // 4) * 4, dtype=torch.float32, device=index_q.device)[:, :n_blocks]
    else:
        keys = torch.empty(Tq, n_blocks, dtype=torch.int64, device=index_q.device)
    launch.LAUNCHED.keep("qsa_score_prefill", _qsa_score_prefill_kernel[
        (triton.cdiv(n_blocks, launch.SCORE_BLOCK_N), triton.cdiv(Tq, launch.SCORE_BLOCK_M))](
        index_q, index_kv, block_row, q_pos, keys, Tq, n_blocks, r, float(index_scale), block_row.shape[0],
        index_q.stride(0), index_q.stride(1), index_kv.stride(0), index_kv.stride(2), keys.stride(0),
        HI=HI, DI=DI, IBS=index_kv.shape[2], BLOCK_M=launch.SCORE_BLOCK_M, BLOCK_N=launch.SCORE_BLOCK_N,
        LOGITS=logits, STACK=launch.SCORE_STACK_HEADS and HI & (HI - 1) == 0, num_warps=launch.SCORE_WARPS))
    if logits:
        vis = torch.clamp(torch.div(q_pos + 1, r, rounding_mode="floor"), max=n_blocks).to(torch.int32)
        return keys, vis
    return keys
