"""Triton kernels for QSA: decode (one query per sequence, or few), paged prefill (many queries of one sequence),
and the paged cache writes. Imported only on the CUDA path.

Three stages, no host synchronisation (so the decode op can be captured in a CUDA graph):

1. ``_qsa_score_kernel``: indexer scores s_j = scale * sum_h relu(q_h . K_j) (fp32 accumulation of exact bf16
   products) for every block key, written as an int64 sort key  (orderable score bits << 32) | (2^32 - 1 - j),
   or INT64_MIN for blocks the query cannot see yet.  The keys are unique and order like the reference's stable
   sort ("higher score first, lower block id on ties").
2. Selection of the top m = budget / r blocks per query (``top_ids``): ``_qsa_topk_small_kernel`` (up to
   TOPK_SMALL_MAX blocks, keys held in registers, the threshold found bit by bit; split over chunks of keys for few
   queries: TOPK_SPLIT) or ``_qsa_topk_kernel`` (radix select over chunks); ties at the threshold go to the lower
   block ids, so the set is exactly the reference's.  The paged decode hands fp32 scores to vLLM's own CUDA select
   instead where vLLM has loaded it (``host.decode_select``; ties: its choice); the unpaged op takes
   ``torch.topk`` of the sort keys (``top_keys``: the same set, largest first).  A query with at most m complete
   blocks takes all of them (the reference's dense regime).
3. ``_qsa_attn_kernel`` (split over slot ranges, one program per (range, kv head, query), an online softmax over
   the range's chunks of ATTN_SLOT_BLOCK slots) + ``_qsa_merge_kernel``: attention of the query heads of one GQA
   group over the selected tokens: slot i < m*r is token ids[i // r] * r + i % r, slot m*r + j is tail token
   n_complete*r + j (<= q_pos).  Softmax in fp32 (exp2), P rounded to bf16 for the P.V product (as flash kernels
   do), fp32 partials merged across ranges.

Prefill (``qsa_prefill_paged_triton``): ``_qsa_score_prefill_kernel`` scores a tile of 64 queries against 64 block
keys per program (one load of the keys serves the tile), the same top-k, and ``_qsa_attn_loop_kernel``: one program
per (query, KV head) loops over the slots with an online softmax (no partials through memory). Query chunks keep the
int64 sort keys under ``PREFILL_KEYS_BYTES``. FP8 caches are read and widened exactly to bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._registry import Launches
from ..triton_utils import dot as _dot
from ..triton_utils import round_bf16 as _rbf
from ..triton_utils import rsqrt as _rsqrt
from ..triton_utils import sigmoid as _sigmoid
from . import host

INT64_MIN = -(1 << 63)
_KEY_MIN = tl.constexpr(INT64_MIN)


# Positions and block-table rows reach the kernels as views into the step's batch (``positions[s:e]``,
# ``block_table[b]``): their start is 16-byte aligned or not depending on where the request sits, and Triton would
# compile one variant per alignment, in the middle of serving. Not specialised on it (their loads are tiny).
_ROW_VIEWS = ['QPOS', 'POS', 'BT', 'IBT']


@triton.jit(do_not_specialize_on_alignment=_ROW_VIEWS)
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
            do_not_specialize_on_alignment=_ROW_VIEWS)
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


@triton.jit(do_not_specialize=['Tq', 'Nb', 'n_bt', 'stride_keys_t'], do_not_specialize_on_alignment=_ROW_VIEWS)
def _qsa_score_prefill_kernel(IQ, IKV, IBT, QPOS, KEYS, Tq, Nb, r, scale, n_bt,
                              stride_qt, stride_qh, stride_kvb, stride_kvl, stride_keys_t,
                              HI: tl.constexpr, DI: tl.constexpr, IBS: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr):
    """Sort keys of BLOCK_M queries of ONE sequence x BLOCK_N of its block keys (read through its block-table row
    IBT from the paged index cache, as ``_qsa_score_paged_kernel``): one load of the block keys serves BLOCK_M
    queries (prefill), and each head's scores are a [BLOCK_M, DI] x [DI, BLOCK_N] product."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < Tq
    n_complete = (tl.load(QPOS + offs_m, mask=mmask, other=0).to(tl.int64) + 1) // r
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    vis = (offs_n < Nb) & (offs_n < tl.max(n_complete, axis=0))  # blocks no query of the tile sees: not loaded
    offs_d = tl.arange(0, DI)
    tok = offs_n.to(tl.int64) * r + r - 1
    phys = tl.load(IBT + tl.minimum(tok // IBS, n_bt - 1), mask=vis, other=0).to(tl.int64)
    row = phys * stride_kvb + (tok % IBS) * stride_kvl + DI
    k = tl.load(IKV + row[:, None] + offs_d[None, :], mask=vis[:, None], other=0.0).to(tl.bfloat16)  # FP8: exact
    s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in tl.static_range(HI):
        qh = tl.load(IQ + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mmask[:, None],
                     other=0.0)
        s += tl.maximum(_dot(qh, tl.trans(k)), 0.0)
    key = _sort_key(s * scale, offs_n[None, :], offs_n[None, :] < n_complete[:, None])
    tl.store(KEYS + offs_m[:, None].to(tl.int64) * stride_keys_t + offs_n[None, :], key,
             mask=mmask[:, None] & (offs_n < Nb)[None, :])


@triton.jit
def _radix_digit(h, bins, k_rem):
    """One radix-select pass: h [bins] = counts of the still-tied keys by digit; k_rem = the threshold's rank among
    them. -> (the threshold's digit: the largest with >= k_rem keys at or above it, the rank left inside it)."""
    above = tl.cumsum(h, axis=0, reverse=True)  # keys with digit >= bin
    d = tl.max(tl.where(above >= k_rem, bins, 0), axis=0)
    return d, k_rem - tl.sum(tl.where(bins > d, h, 0), axis=0)


@triton.jit(do_not_specialize=['Nb', 'm', 'stride_kt', 'stride_ot'])
def _qsa_topk_kernel(KEYS, OUT, Nb, m, stride_kt, stride_ot, CH: tl.constexpr, M_P: tl.constexpr):
    """Top-m of one query's int64 sort keys, one program per query: an exact 4-pass radix select (8 bits a pass)
    on the score half of the key, then ties at the threshold broken by the lower block id (the id half).  Writes
    the selected block ids in id order (the attention does not care about order), -1 in the unused slots."""
    t = tl.program_id(0)
    offs = tl.arange(0, CH)
    bins = tl.arange(0, 256)
    base = KEYS + t * stride_kt
    # number of visible blocks (the score kernel marked the others _KEY_MIN)
    n_valid = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, Nb, CH):
        kv = tl.load(base + c0 + offs, mask=(c0 + offs) < Nb, other=_KEY_MIN)
        n_valid += tl.sum((kv != _KEY_MIN).to(tl.int32), axis=0)
    k_rem = tl.minimum(m, n_valid)
    prefix = tl.zeros([], dtype=tl.int32)  # the threshold's digits found so far
    for p in tl.static_range(4):
        SHIFT = 24 - 8 * p  # a compile-time value (p is)
        h = tl.zeros([256], dtype=tl.int32)
        for c0 in range(0, Nb, CH):
            kv = tl.load(base + c0 + offs, mask=(c0 + offs) < Nb, other=_KEY_MIN)
            u = ((kv >> 32).to(tl.int32) ^ -2147483648).to(tl.uint32, bitcast=True)  # unsigned order = key order
            active = kv != _KEY_MIN
            if p > 0:
                active = active & ((u >> (SHIFT + 8)).to(tl.int32) == prefix)
            h += tl.histogram(((u >> SHIFT) & 255).to(tl.int32), 256, mask=active)
        dstar, k_rem = _radix_digit(h, bins, k_rem)
        prefix = prefix * 256 + dstar
    thr = prefix.to(tl.uint32, bitcast=True)
    # select: key half > thr, plus the first k_rem (by id) equal to thr
    n_eq = tl.zeros([], dtype=tl.int32)
    n_sel = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, Nb, CH):
        kv = tl.load(base + c0 + offs, mask=(c0 + offs) < Nb, other=_KEY_MIN)
        u = ((kv >> 32).to(tl.int32) ^ -2147483648).to(tl.uint32, bitcast=True)
        valid = kv != _KEY_MIN
        eq = valid & (u == thr)
        rank = n_eq + tl.cumsum(eq.to(tl.int32), axis=0)
        sel = (valid & (u > thr)) | (eq & (rank <= k_rem))
        pos = n_sel + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(OUT + t * stride_ot + pos, (c0 + offs).to(tl.int32), mask=sel)
        n_eq += tl.sum(eq.to(tl.int32), axis=0)
        n_sel += tl.sum(sel.to(tl.int32), axis=0)
    slots = tl.arange(0, M_P)
    tl.store(OUT + t * stride_ot + slots, tl.full([M_P], -1, tl.int32), mask=(slots >= n_sel) & (slots < m))


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit(do_not_specialize=['Nb', 'm', 'stride_kt', 'stride_ot'])
def _qsa_topk_small_kernel(KEYS, OUT, Nb, m, stride_kt, stride_ot, N_P: tl.constexpr, M_P: tl.constexpr,
                           BITS: tl.constexpr, MODE: tl.constexpr = 0):
    """Same selection as ``_qsa_topk_kernel`` for Nb <= N_P keys held in registers: the threshold (the m-th
    largest score half of the keys) by a search of counts over the bits where the keys differ, stopping once exactly
    k keys are at or above the candidate (BITS = 0: one bit a step; BITS = 2: two bits a step, three counts packed
    into one block-wide sum), then ties by block id; the output positions come out of ONE prefix sum (the counts of
    "above the threshold" and "at it" packed into the two halves of an int32).
    MODE 0: the selected positions (block ids) in id order, -1 padded. The two stages of the split select
    (``top_ids``, TOPK_SPLIT): MODE 1, program (t, c) selects among keys c * N_P .. of row t and writes the selected
    KEYS themselves (id order, INT64_MIN padded) to OUT[t, c * m ..]; MODE 2 selects among those candidates and
    writes the block ids the keys carry (their low 32 bits: 2^32 - 1 - id), still in id order (the candidates are)."""
    t = tl.program_id(0)
    c0 = tl.program_id(1) * N_P if MODE == 1 else 0
    offs = tl.arange(0, N_P)
    kv = tl.load(KEYS + t * stride_kt + c0 + offs, mask=offs < Nb - c0, other=_KEY_MIN)
    valid = kv != _KEY_MIN
    u = ((kv >> 32).to(tl.int32) ^ -2147483648).to(tl.uint32, bitcast=True)  # unsigned order = key order
    k = tl.minimum(m, tl.sum(valid.to(tl.int32), axis=0))
    prefix = tl.zeros([], dtype=tl.uint32)  # invariant: at least k valid keys are >= prefix
    # one or two bits a step, but only over the bits where the valid keys differ, and no further once exactly k
    # keys are >= the candidate (then every key at or above it is selected: no tie to split)
    umax = tl.max(tl.where(valid, u, tl.zeros([N_P], dtype=tl.uint32)), axis=0)
    differ = tl.reduce(tl.where(valid, u ^ umax, tl.zeros([N_P], dtype=tl.uint32)), 0, _bit_or)
    lz = tl.zeros([], dtype=tl.int32)  # leading bits every valid key shares (32: all equal)
    tz = tl.zeros([], dtype=tl.int32)  # trailing bits every valid key shares
    d64 = differ.to(tl.int64)
    for j in tl.static_range(32):
        lz += ((d64 >> (31 - j)) == 0).to(tl.int32)
        tz += ((d64 & ((2 << j) - 1)) == 0).to(tl.int32)
    low = tl.maximum(32 - lz, 1).to(tl.uint32)  # (shift counts stay below 32)
    prefix = tl.where(lz == 0, prefix, tl.where(lz >= 32, umax, (umax >> low) << low))
    if BITS == 0:
        b = lz
        while b < 32 - tz:
            cand = prefix | (tl.full([], 1, tl.uint32) << (31 - b).to(tl.uint32))
            cnt = tl.sum((valid & (u >= cand)).to(tl.int32), axis=0)
            prefix = tl.where(cnt >= k, cand, prefix)
            b = tl.where(cnt == k, 32, b + 1)
    else:  # two bits a step: the counts of keys >= prefix | d for the digits d = 1, 2, 3 in ONE block-wide sum
        # (16-bit fields of an int64, as in the final prefix sum below); the pairs are aligned to even bit numbers
        # (a pair reaching into the shared leading bits re-decides a shared bit: harmless)
        uv = tl.where(valid, u, tl.zeros([N_P], dtype=tl.uint32))  # candidates are >= 1: invalid keys never count
        b = lz - lz % 2
        while b < 32 - tz:
            sh = (30 - b).to(tl.uint32)
            c1 = prefix | (tl.full([], 1, tl.uint32) << sh)
            c2 = prefix | (tl.full([], 2, tl.uint32) << sh)
            c3 = prefix | (tl.full([], 3, tl.uint32) << sh)
            packed = tl.sum((uv >= c1).to(tl.int64) + ((uv >= c2).to(tl.int64) << 16)
                            + ((uv >= c3).to(tl.int64) << 32), axis=0)
            n1 = packed & 0xFFFF
            n2 = (packed >> 16) & 0xFFFF
            n3 = packed >> 32
            d = tl.where(n3 >= k, 3, tl.where(n2 >= k, 2, tl.where(n1 >= k, 1, 0)))
            cnt = tl.where(d == 3, n3, tl.where(d == 2, n2, tl.where(d == 1, n1, -1)))
            prefix = prefix | (d.to(tl.uint32) << sh)
            b = tl.where(cnt == k, 32, b + 2)
    # the shared trailing bits (every key has them: the threshold too)
    tail = (tl.full([], 1, tl.int64) << tz.to(tl.int64)) - 1
    prefix = prefix | (umax.to(tl.int64) & tail).to(tl.uint32)
    thr = prefix
    gt = valid & (u > thr)
    eq = valid & (u == thr)
    k_rem = k - tl.sum(gt.to(tl.int32), axis=0)
    c = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)  # N_P <= 16384 < 2^16: no carry
    n_eq = c >> 16  # equal keys up to here (id order): the first k_rem of them are taken
    sel = gt | (eq & (n_eq <= k_rem))
    pos = (c & 0xFFFF) + tl.minimum(n_eq, k_rem) - 1
    slots = tl.arange(0, M_P)  # k slots filled (every visible block when fewer than m)
    if MODE == 1:
        out = OUT + t * stride_ot + tl.program_id(1) * m
        tl.store(out + pos, kv, mask=sel)
        tl.store(out + slots, tl.full([M_P], _KEY_MIN, tl.int64), mask=(slots >= k) & (slots < m))
    else:
        ids = offs.to(tl.int32) if MODE == 0 else (4294967295 - (kv & 4294967295)).to(tl.int32)
        tl.store(OUT + t * stride_ot + pos, ids, mask=sel)
        tl.store(OUT + t * stride_ot + slots, tl.full([M_P], -1, tl.int32), mask=(slots >= k) & (slots < m))


@triton.jit
def _slot_rows(IDS, QPOS, BT, t, slots, r, m, stride_kl, stride_vl, stride_ids_t, stride_bt, n_bt, stride_kb,
               stride_vb, TAIL: tl.constexpr, KEYS: tl.constexpr, PAGED: tl.constexpr, PBS: tl.constexpr):
    """Element offsets of the K and V rows (head 0) of query t's selected-token slots, and which slots hold a
    token: slot i < m*r is token ids[i // r] * r + i % r, slot m*r + j is tail token n_complete*r + j (<= q_pos).
    PAGED: token p lives in block BT[t, p // PBS] (block strides ``stride_kb``/``stride_vb``), else row p."""
    qpos = tl.load(QPOS + t).to(tl.int64)
    n_complete = (qpos + 1) // r
    n_blk_slots = m * r
    in_blk = slots < n_blk_slots
    raw = tl.load(IDS + t * stride_ids_t + slots // r, mask=in_blk, other=-1).to(tl.int64)
    if KEYS:  # the top-k sort keys themselves: decode the block id (INT64_MIN: no block)
        bid = tl.where(in_blk & (raw != _KEY_MIN), 4294967295 - (raw & 4294967295), -1)
    else:
        bid = raw
    tok_b = bid * r + slots % r
    j = slots - n_blk_slots
    tok_t = n_complete * r + j
    tok = tl.where(in_blk, tok_b, tok_t)
    valid = tl.where(in_blk, bid >= 0, (j >= 0) & (j < TAIL) & (tok_t <= qpos))
    tok = tl.where(valid, tok, 0)
    if PAGED:
        phys = tl.load(BT + t * stride_bt + tl.minimum(tok // PBS, n_bt - 1), mask=valid, other=0).to(tl.int64)
        k_row = phys * stride_kb + (tok % PBS) * stride_kl
        v_row = phys * stride_vb + (tok % PBS) * stride_vl
    else:
        k_row = tok * stride_kl
        v_row = tok * stride_vl
    return k_row, v_row, valid


@triton.jit
def _attn_chunks(Q, K, V, QPOS, IDS, BT, t, g, c0, c1, r, m, scale_log2, stride_qt, stride_qh, stride_kl, stride_kh,
                 stride_vl, stride_vh, stride_ids_t, stride_bt, n_bt, stride_kb, stride_vb,
                 G: tl.constexpr, G_P: tl.constexpr, HD: tl.constexpr, SB: tl.constexpr, TAIL: tl.constexpr,
                 KEYS: tl.constexpr, PAGED: tl.constexpr, PBS: tl.constexpr, PREFETCH: tl.constexpr):
    """Online softmax of the G query heads of KV head g of query t over slot chunks [c0, c1) of SB slots:
    (acc [G_P, HD] = sum_j 2^(s_j - m) v_j unnormalised, m [G_P] the running max in log2 units, l = sum 2^(s_j - m)).
    PREFETCH: the next chunk's rows (selected ids -> block table -> row offsets: two dependent loads) are looked up
    while this chunk's K/V loads are in flight, so an iteration waits on one memory round trip instead of three."""
    offs_g = tl.arange(0, G_P)
    offs_d = tl.arange(0, HD)
    gmask = offs_g < G
    q = tl.load(Q + t * stride_qt + (g * G + offs_g)[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None],
                other=0.0)
    m_i = tl.full([G_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_P], dtype=tl.float32)
    acc = tl.zeros([G_P, HD], dtype=tl.float32)
    if PREFETCH:
        k_row, v_row, valid = _slot_rows(IDS, QPOS, BT, t, c0 * SB + tl.arange(0, SB), r, m, stride_kl, stride_vl,
                                         stride_ids_t, stride_bt, n_bt, stride_kb, stride_vb, TAIL, KEYS, PAGED, PBS)
    for c in range(c0, c1):
        if not PREFETCH:
            k_row, v_row, valid = _slot_rows(IDS, QPOS, BT, t, c * SB + tl.arange(0, SB), r, m, stride_kl,
                                             stride_vl, stride_ids_t, stride_bt, n_bt, stride_kb, stride_vb, TAIL,
                                             KEYS, PAGED, PBS)
        k = tl.load(K + k_row[:, None] + g * stride_kh + offs_d[None, :], mask=valid[:, None],
                    other=0.0).to(tl.bfloat16)  # FP8 caches widen exactly
        v = tl.load(V + v_row[:, None] + g * stride_vh + offs_d[None, :], mask=valid[:, None],
                    other=0.0).to(tl.bfloat16)
        if PREFETCH:  # (past the last chunk the slots are invalid: masked loads, nothing read)
            nk_row, nv_row, nvalid = _slot_rows(IDS, QPOS, BT, t, (c + 1) * SB + tl.arange(0, SB), r, m, stride_kl,
                                                stride_vl, stride_ids_t, stride_bt, n_bt, stride_kb, stride_vb, TAIL,
                                                KEYS, PAGED, PBS)
        s = _dot(q, tl.trans(k)) * scale_log2  # [G_P, SB], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(tl.bfloat16), v)
        m_i = m_new
        if PREFETCH:
            k_row, v_row, valid = nk_row, nv_row, nvalid
    return acc, m_i, l_i


@triton.jit(do_not_specialize=['m', 'n_chunks', 'cpp', 'stride_bt', 'n_bt'], do_not_specialize_on_alignment=_ROW_VIEWS)
def _qsa_attn_kernel(Q, K, V, QPOS, IDS, OP, MP, LP, r, m, n_chunks, cpp, scale_log2,
                     stride_qt, stride_qh, stride_kl, stride_kh, stride_vl, stride_vh, stride_ids_t,
                     BT, stride_bt, n_bt, stride_kb, stride_vb,
                     G: tl.constexpr, G_P: tl.constexpr, HD: tl.constexpr, SB: tl.constexpr, TAIL: tl.constexpr,
                     KEYS: tl.constexpr, PAGED: tl.constexpr, PBS: tl.constexpr, PREFETCH: tl.constexpr):
    """Slot chunks [sp * cpp, (sp + 1) * cpp) of one (query, KV head): fp32 partial output (unnormalised), max and
    sum of its G heads for ``_qsa_merge_kernel`` (decode: the split over slot ranges gives the GPU enough programs;
    ranges of several chunks keep the partials, written and read back through memory, few at batch 32)."""
    sp = tl.program_id(0)
    g = tl.program_id(1)
    t = tl.program_id(2)
    n_kvh = tl.num_programs(1)
    n_split = tl.num_programs(0)
    c0 = sp * cpp
    acc, m_i, l_i = _attn_chunks(Q, K, V, QPOS, IDS, BT, t, g, c0, tl.minimum(c0 + cpp, n_chunks), r, m, scale_log2,
                                 stride_qt, stride_qh, stride_kl, stride_kh, stride_vl, stride_vh, stride_ids_t,
                                 stride_bt, n_bt, stride_kb, stride_vb, G, G_P, HD, SB, TAIL, KEYS, PAGED, PBS,
                                 PREFETCH)
    offs_g = tl.arange(0, G_P)
    gmask = offs_g < G
    base = (t * n_kvh + g) * n_split + sp
    tl.store(OP + (base * G_P + offs_g)[:, None] * HD + tl.arange(0, HD)[None, :], acc, mask=gmask[:, None])
    tl.store(MP + base * G_P + offs_g, m_i, mask=gmask)
    tl.store(LP + base * G_P + offs_g, l_i, mask=gmask)


@triton.jit(do_not_specialize=['m', 'n_chunks', 'stride_bt', 'n_bt'], do_not_specialize_on_alignment=_ROW_VIEWS)
def _qsa_attn_loop_kernel(Q, K, V, QPOS, IDS, O, r, m, n_chunks, scale_log2,
                          stride_qt, stride_qh, stride_kl, stride_kh, stride_vl, stride_vh, stride_ids_t,
                          BT, stride_bt, n_bt, stride_kb, stride_vb, stride_ot, stride_oh,
                          G: tl.constexpr, G_P: tl.constexpr, HD: tl.constexpr, SB: tl.constexpr,
                          TAIL: tl.constexpr, KEYS: tl.constexpr, PAGED: tl.constexpr, PBS: tl.constexpr):
    """All slots of one (query, KV head) in one program (prefill: many queries fill the GPU without a split, and no
    fp32 partials go through memory; rows looked up chunk by chunk, no prefetch)."""
    g = tl.program_id(0)
    t = tl.program_id(1)
    acc, m_i, l_i = _attn_chunks(Q, K, V, QPOS, IDS, BT, t, g, 0, n_chunks, r, m, scale_log2, stride_qt, stride_qh,
                                 stride_kl, stride_kh, stride_vl, stride_vh, stride_ids_t, stride_bt, n_bt,
                                 stride_kb, stride_vb, G, G_P, HD, SB, TAIL, KEYS, PAGED, PBS, False)
    offs_g = tl.arange(0, G_P)
    offs_d = tl.arange(0, HD)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + t * stride_ot + (g * G + offs_g)[:, None] * stride_oh + offs_d[None, :], out.to(tl.bfloat16),
             mask=(offs_g < G)[:, None])


# n_split (slot ranges a (query, KV head), set by the row count) only bounds its loop and masks; no address depends
# on its divisibility: not specialised, so one variant per NSP (what the warm-ups cover), none per row count.
@triton.jit(do_not_specialize=['n_split'])
def _qsa_merge_kernel(OP, MP, LP, O, GATE, n_split, stride_ot, stride_oh, stride_gt, stride_gh,
                      G: tl.constexpr, G_P: tl.constexpr, HD: tl.constexpr, NSP: tl.constexpr, CH: tl.constexpr,
                      GATED: tl.constexpr):
    """Merges a (query, head)'s split partials; GATED: then the output gate, o * sigmoid(gate), rounded where
    ``reference.output_gate`` rounds (o to bf16, the sigmoid to bf16, the product) -- no separate gate kernels."""
    i = tl.program_id(0)  # query head within its group
    g = tl.program_id(1)
    t = tl.program_id(2)
    n_kvh = tl.num_programs(1)
    base = (t * n_kvh + g) * n_split
    offs_s = tl.arange(0, NSP)
    smask = offs_s < n_split
    mx = tl.load(MP + (base + offs_s) * G_P + i, mask=smask, other=float("-inf"))
    M = tl.max(mx, axis=0)
    M = tl.where(M == float("-inf"), 0.0, M)
    l = tl.load(LP + (base + offs_s) * G_P + i, mask=smask, other=0.0)
    w_all = tl.where(smask, tl.exp2(mx - M), 0.0)
    den = tl.sum(w_all * l, axis=0)
    offs_d = tl.arange(0, HD)
    acc = tl.zeros([HD], dtype=tl.float32)
    offs_c = tl.arange(0, CH)
    for c0 in range(0, n_split, CH):
        sidx = c0 + offs_c
        cm = sidx < n_split
        mc = tl.load(MP + (base + sidx) * G_P + i, mask=cm, other=float("-inf"))
        wc = tl.where(cm, tl.exp2(mc - M), 0.0)
        oc = tl.load(OP + ((base + sidx) * G_P + i)[:, None] * HD + offs_d[None, :], mask=cm[:, None], other=0.0)
        acc += tl.sum(oc * wc[:, None], axis=0)
    out = acc / den
    if GATED:
        gv = tl.load(GATE + t * stride_gt + (g * G + i) * stride_gh + offs_d).to(tl.float32)
        out = _rbf(_rbf(out) * _rbf(_sigmoid(gv)))
    tl.store(O + t * stride_ot + (g * G + i) * stride_oh + offs_d, out.to(tl.bfloat16))


LAUNCHED = Launches()  # the last launch of each kernel, under _registry.record() (which ran; registers / spills)
# Launch settings (the chosen values; docs/performance.md has the measurements behind them).
# Decode attention, few queries (batch 1): selected-token slots per loop step and warps. 32 x 8 fits the real widths
# (12 heads padded to 16 x 256) in registers without spills; 64 x 8 is a little faster but spills.
ATTN_SLOT_BLOCK = 32
ATTN_WARPS = 8
# Each (query, KV head) is split over slot ranges so that about this many programs run (batch 1: one chunk a
# program; batch 32: several chunks a program, which keeps the fp32 partials the merge reads back few).
ATTN_PROGRAMS = 512
ATTN_STAGES = 1  # software-pipeline stages of its loop over chunks, few queries (1-3 within noise)
ATTN_STAGES_MANY = 3  # many queries: Triton's pipeliner issues the next chunks' K/V loads ahead of the math
ATTN_MANY_QUERIES = 8  # from this many queries (batch-32 decode) the many-query settings: 16 slots x 2 warps
ATTN_SLOT_BLOCK_MANY = 16
ATTN_WARPS_MANY = 2
# Look the next chunk's rows up while this chunk's K/V loads are in flight: a gain for many-query decode; for few
# queries noise-level, and it makes the 32 x 8 launch spill.
ATTN_PREFETCH_MANY = True
ATTN_PREFETCH = False
VLLM_TOPK_WORKSPACE_BYTES = 1 << 20  # vLLM's select's scratch (the size vLLM's callers give it)
TOPK_CHUNK = 8192  # keys per pass step of the chunked radix select (past TOPK_SMALL_MAX blocks)
TOPK_SMALL_MAX = 16384  # up to this many blocks the in-register select (<= 2^16: it packs two counts in an int32)
# Threshold bits per search step of the in-register select in one launch (0: one bit a step; the fastest measured
# against two bits, a search over all 32 bits and 8-bit radix digits)
TOPK_SMALL_BITS = 0
TOPK_SMALL_WARPS = 16  # its warps
# It holds N_P = the next power of two >= the block count, at least this: four variants (2048 .. 16384), each
# compiled at its first use (the kernels' integer sizes are not specialised, so no other length compiles anything).
TOPK_SMALL_MIN = 2048
# Past this many blocks, for up to TOPK_SPLIT_MAX_ROWS queries (decode, MTP verification): the select in two
# launches, chunks of TOPK_SPLIT keys each selecting their top m (one program per chunk: more SMs at work than one
# program per query), then the top m of those candidates (exact: every key of the top m is in its chunk's top m).
# 0: one launch, one program per query (prefill-sized batches always).
TOPK_SPLIT = 4096
TOPK_SPLIT_MAX_ROWS = 128
TOPK_SPLIT_WARPS = 8
TOPK_SPLIT_BITS = 2  # the split select's threshold bits a step (two: faster than one at batch 1 and 32)
LOOP_MIN_QUERIES = 256  # prefill chunks of this many queries on: one looping program per (query, KV head)
# Slots per loop iteration of that kernel, its warps and software-pipeline stages (the fastest of the shapes swept
# at 4,096 queries x 50k context: ``benchmarks/bench_ops.py --tune-prefill``)
LOOP_SLOT_BLOCK = 128
LOOP_WARPS = 4
LOOP_STAGES = 2
SCORE_WARPS = 4
PREFILL_KEYS_BYTES = 256 << 20  # the int64 sort keys of one query chunk of qsa_prefill_paged_triton stay below this
PREFILL_MAX_QUERIES = 16384  # and a chunk has at most this many queries
# Block keys per program of the decode score kernel, and its warps (128 x 8: more of the memory bandwidth at batch
# 32 than 64 x 4; the same at batch 1)
SCORE_PAGED_BLOCK_N = 128
SCORE_PAGED_WARPS = 8
SCORE_BLOCK_M = 64  # queries x block keys per program of the prefill score kernel
SCORE_BLOCK_N = 64


def score_keys(q_pos, index_q, block_keys, r: int, index_scale: float):
    """[Tq, Nb] int64 sort keys of the indexer scores (INT64_MIN for blocks a query cannot see)."""
    Tq = q_pos.shape[0]
    Nb = block_keys.shape[0]
    HI, DI = index_q.shape[1], index_q.shape[2]
    keys = torch.empty(Tq, Nb, dtype=torch.int64, device=q_pos.device)
    BLOCK_N = 64
    LAUNCHED.keep("qsa_score", _qsa_score_kernel[(triton.cdiv(Nb, BLOCK_N), Tq)](
        index_q, block_keys, q_pos, keys, Nb, r, float(index_scale),
        index_q.stride(0), index_q.stride(1), block_keys.stride(0), keys.stride(0),
        HI=HI, HI_P=max(16, triton.next_power_of_2(HI)), DI=DI, BLOCK_N=BLOCK_N, num_warps=4))
    return keys


def top_keys(keys, m: int):
    """The m largest keys per row, largest first (torch.topk: the unpaged op's select)."""
    return torch.topk(keys, m, dim=1, largest=True, sorted=True).values


def topk_plan(Tq: int, Nb: int, m: int) -> tuple:
    """The select ``top_ids`` runs for Tq rows of Nb keys: ("split", n_chunks, N_P of the merge launch), ("small",
    N_P) or ("radix",). Shared with ``prefill_variants`` (what a warm-up must compile)."""
    n_chunks = triton.cdiv(Nb, TOPK_SPLIT) if TOPK_SPLIT else 0
    if n_chunks > 1 and Tq <= TOPK_SPLIT_MAX_ROWS and 2 * m <= TOPK_SPLIT and n_chunks * m <= TOPK_SMALL_MAX:
        return ("split", n_chunks, max(TOPK_SMALL_MIN, triton.next_power_of_2(n_chunks * m)))
    if Nb <= TOPK_SMALL_MAX:  # keys in registers, the threshold by TOPK_SMALL_BITS a step
        return ("small", min(max(TOPK_SMALL_MIN, triton.next_power_of_2(max(Nb, 1))), TOPK_SMALL_MAX))
    return ("radix",)  # radix select over chunks of keys


def top_ids(keys, m: int):
    """The reference's top-m block ids per row (as a set, in id order; -1 pad), by the Triton radix select."""
    Tq, Nb = keys.shape
    out = torch.empty(Tq, m, dtype=torch.int32, device=keys.device)
    plan = topk_plan(Tq, Nb, m)
    M_P = triton.next_power_of_2(m)
    if plan[0] == "split":
        n_chunks, N_P = plan[1], plan[2]
        cand = torch.empty(Tq, n_chunks * m, dtype=torch.int64, device=keys.device)
        LAUNCHED.keep("qsa_topk_split", _qsa_topk_small_kernel[(Tq, n_chunks)](
            keys, cand, Nb, m, keys.stride(0), cand.stride(0), N_P=TOPK_SPLIT, M_P=M_P, BITS=TOPK_SPLIT_BITS,
            MODE=1, num_warps=TOPK_SPLIT_WARPS))
        LAUNCHED.keep("qsa_topk", _qsa_topk_small_kernel[(Tq,)](
            cand, out, n_chunks * m, m, cand.stride(0), out.stride(0), N_P=N_P, M_P=M_P, BITS=TOPK_SPLIT_BITS,
            MODE=2, num_warps=TOPK_SPLIT_WARPS))
    elif plan[0] == "small":
        LAUNCHED.keep("qsa_topk", _qsa_topk_small_kernel[(Tq,)](
            keys, out, Nb, m, keys.stride(0), out.stride(0), N_P=plan[1], M_P=M_P, BITS=TOPK_SMALL_BITS,
            num_warps=TOPK_SMALL_WARPS))
    else:
        LAUNCHED.keep("qsa_topk", _qsa_topk_kernel[(Tq,)](keys, out, Nb, m, keys.stride(0), out.stride(0),
                                                          CH=TOPK_CHUNK, M_P=M_P, num_warps=16))
    return out


_VLLM_TOPK_WORKSPACE = {}


def vllm_top_ids(logits, q_pos, r: int, m: int, visible=None):
    """Top-m block ids [rows, m] (int32, -1 pad) of fp32 scores by vLLM's select. It reads each row's first
    n_complete = (q_pos + 1) // r scores (``visible``: those counts [rows] int32 when the caller has them, e.g. from
    ``paged_score_keys``); ``host.vllm_topk_covers`` says where it serves. Unlike ``top_ids`` its choice among
    blocks tied at the threshold is its own (not the lower ids): the set can differ from the reference's where
    scores tie exactly."""
    rows, n_blocks = logits.shape
    dev = logits.device
    ws = _VLLM_TOPK_WORKSPACE.get(dev)
    if ws is None:  # one per device, kept: its address stays fixed across CUDA-graph replays
        ws = _VLLM_TOPK_WORKSPACE[dev] = torch.empty(VLLM_TOPK_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    if visible is None:
        visible = torch.clamp(torch.div(q_pos + 1, r, rounding_mode="floor"), max=n_blocks).to(torch.int32)
    out = torch.empty(rows, m, dtype=torch.int32, device=dev)
    torch.ops._C.cooperative_topk(logits, visible, out, ws, m, n_blocks)
    return out


def _dense_ids(q_pos, r, m):
    """Every complete block [Tq, m] (-1 pad), int32 as the selects' ids: the attention kernels then compile one
    variant for both regimes (a warm-up that ran one regime leaves nothing for the other to compile)."""
    n_complete = torch.div(q_pos + 1, r, rounding_mode="floor")
    dense = torch.arange(m, dtype=torch.int32, device=q_pos.device).unsqueeze(0).expand(q_pos.shape[0], m)
    return torch.where(dense < n_complete.unsqueeze(1), dense, -1)


def _uses_indexer(index_q, block_keys, m):
    # With Nb <= m block keys every query the contract allows (n_complete <= Nb) is in the dense regime.
    return index_q is not None and block_keys is not None and block_keys.shape[0] > m and m > 0


def select_block_ids(q_pos, index_q, block_keys, r: int, budget: int, index_scale: float):
    """The selection of ``qsa_attention_triton``: top-m block ids [Tq, m] (-1 pad) in the reference's order (the
    sort keys' torch.topk); no host sync."""
    m = budget // r
    if not _uses_indexer(index_q, block_keys, m):
        return _dense_ids(q_pos, r, m)
    top = top_keys(score_keys(q_pos, index_q, block_keys, r, index_scale), m)
    return torch.where(top == INT64_MIN, -1, 4294967295 - (top & 4294967295))


def attn_split(Tq: int, Hkv: int, n_slots: int) -> tuple:
    """The split attention's launch for Tq queries over n_slots slots: (many-query settings, slots a loop step,
    warps, slot chunks, chunks a program, programs a (query, KV head))."""
    many = Tq >= ATTN_MANY_QUERIES
    SB, warps = (ATTN_SLOT_BLOCK_MANY, ATTN_WARPS_MANY) if many else (ATTN_SLOT_BLOCK, ATTN_WARPS)
    n_chunks = triton.cdiv(max(n_slots, 1), SB)
    cpp = triton.cdiv(n_chunks, min(n_chunks, max(1, triton.cdiv(ATTN_PROGRAMS, Tq * Hkv))))  # chunks a program
    return many, SB, warps, n_chunks, cpp, triton.cdiv(n_chunks, cpp)


def sparse_attention_slots(q, k, v, q_pos, sel, r: int, scale: float, keys: bool, block_table=None,
                           loop: bool = False, gate=None):
    """Attention of q [Tq, Hq, d] over the tokens of the selected blocks plus each query's tail.  ``sel`` [Tq, m]:
    block ids (-1 = none), or with ``keys`` the top-k sort keys they decode from. ``block_table`` [Tq, nbt]: k and
    v are paged caches [num_blocks, Hkv, block_size, d] (views with any row stride), query t's tokens in its row
    (rows may repeat: a stride-0 expansion of one sequence's row).  ``loop`` (prefill: many queries, eager): one
    program per (query, KV head) loops over the slots; else (decode, CUDA graphs) the slots are split over programs
    and the partials merged, ``gate`` [Tq, Hq, d] (split path only) applied by the merge."""
    Tq, Hq, HD = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    G_P = max(16, triton.next_power_of_2(G))
    m = sel.shape[1]
    n_slots = m * r + (r - 1)
    dev = q.device
    # block ids as int32 whatever the select gave (sort keys stay int64): one compiled variant for every caller
    sel = sel.contiguous() if keys else sel.to(torch.int32).contiguous()
    if block_table is None:
        paged = (sel, 0, 1, 0, 0)  # unused
        strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1))
        pbs = 1
    else:
        paged = (block_table, block_table.stride(0), block_table.shape[1], k.stride(0), v.stride(0))
        strides = (k.stride(2), k.stride(1), v.stride(2), v.stride(1))
        pbs = k.shape[2]
    out = torch.empty(Tq, Hq, HD, dtype=q.dtype, device=dev)
    scale_log2 = float(scale) * 1.4426950408889634
    assert gate is None or not loop, "the output gate is applied by the split path's merge"
    if loop:
        SB = LOOP_SLOT_BLOCK
        LAUNCHED.keep("qsa_attn_loop", _qsa_attn_loop_kernel[(Hkv, Tq)](
            q, k, v, q_pos, sel, out, r, m, triton.cdiv(max(n_slots, 1), SB), scale_log2,
            q.stride(0), q.stride(1), *strides, sel.stride(0), *paged, out.stride(0), out.stride(1),
            G=G, G_P=G_P, HD=HD, SB=SB, TAIL=r - 1, KEYS=keys, PAGED=block_table is not None, PBS=pbs,
            num_warps=LOOP_WARPS, num_stages=LOOP_STAGES))
        return out
    many, SB, warps, n_chunks, cpp, n_split = attn_split(Tq, Hkv, n_slots)
    op = torch.empty(Tq * Hkv * n_split * G_P * HD, dtype=torch.float32, device=dev)
    mp = torch.empty(Tq * Hkv * n_split * G_P, dtype=torch.float32, device=dev)
    lp = torch.empty_like(mp)
    LAUNCHED.keep("qsa_attn", _qsa_attn_kernel[(n_split, Hkv, Tq)](
        q, k, v, q_pos, sel, op, mp, lp, r, m, n_chunks, cpp, scale_log2,
        q.stride(0), q.stride(1), *strides, sel.stride(0), *paged,
        G=G, G_P=G_P, HD=HD, SB=SB, TAIL=r - 1, KEYS=keys, PAGED=block_table is not None, PBS=pbs,
        PREFETCH=ATTN_PREFETCH_MANY if many else ATTN_PREFETCH, num_warps=warps,
        num_stages=ATTN_STAGES_MANY if many else ATTN_STAGES))
    gated = gate is not None
    LAUNCHED.keep("qsa_merge", _qsa_merge_kernel[(G, Hkv, Tq)](
        op, mp, lp, out, gate if gated else out, n_split, out.stride(0), out.stride(1),
        gate.stride(0) if gated else 0, gate.stride(1) if gated else 0,
        G=G, G_P=G_P, HD=HD, NSP=triton.next_power_of_2(n_split), CH=16, GATED=gated, num_warps=4))
    return out


def qsa_attention_triton(q, k, v, q_pos, index_q, block_keys, r: int, budget: int, scale: float,
                         index_scale: float):
    m = budget // r
    if not _uses_indexer(index_q, block_keys, m):
        return sparse_attention_slots(q, k, v, q_pos, _dense_ids(q_pos, r, m), r, scale, keys=False)
    keys = score_keys(q_pos, index_q, block_keys, r, index_scale)  # the attention decodes the ids from its top keys
    return sparse_attention_slots(q, k, v, q_pos, top_keys(keys, m), r, scale, keys=True)


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
    LAUNCHED.keep("qsa_score_paged", _qsa_score_paged_kernel[(triton.cdiv(n_blocks, SCORE_PAGED_BLOCK_N), B)](
        index_q, index_kv, index_block_table, q_pos, keys, vis, n_blocks, r, float(index_scale),
        index_block_table.shape[1], index_q.stride(0), index_q.stride(1), index_kv.stride(0),
        index_kv.stride(2), index_block_table.stride(0), keys.stride(0),
        HI=HI, HI_P=max(16, triton.next_power_of_2(HI)), DI=DI, IBS=index_kv.shape[2], BLOCK_N=SCORE_PAGED_BLOCK_N,
        LOGITS=logits, num_warps=SCORE_PAGED_WARPS))
    return (keys, vis) if logits else keys


def _topk_variants(plan: tuple) -> set:
    """``topk_plan``'s launches as variant keys (the split's chunk count is a runtime size, not a variant)."""
    if plan[0] == "split":
        return {("topk", "split-chunks"), ("topk", "split", plan[2])}
    return {("topk",) + plan}


def _split_attn_variants(Tq: int, Hkv: int, n_slots: int) -> set:
    """The split attention's two launches (``attn_split``) as variant keys."""
    many, *_, n_split = attn_split(Tq, Hkv, n_slots)
    return {("attn", many), ("merge", triton.next_power_of_2(n_split))}


def _warmup_block_counts(max_blocks: int, m: int) -> list:
    """Block counts up to ``max_blocks`` on both sides of every point where a select's launch changes: the dense
    regime's end (m), the powers of two that set the in-register select's width, the split and radix thresholds."""
    nbs = {min(m, max_blocks), max_blocks, m + 1, TOPK_SPLIT, TOPK_SPLIT + 1, TOPK_SMALL_MAX, TOPK_SMALL_MAX + 1}
    p = TOPK_SMALL_MIN // 2
    while p <= 4 * max(TOPK_SMALL_MAX, TOPK_SPLIT * TOPK_SMALL_MAX // max(m, 1)):
        nbs.update((p, p + 1))
        p *= 2
    return sorted(n for n in nbs if 1 <= n <= max_blocks)


def _cover(cands: list, variants) -> list:
    """The candidates, in order, that each launch a variant (``variants(*cand)``) none before them did."""
    seen, cases = set(), []
    for c in cands:
        v = variants(*c)
        if not v <= seen:
            seen |= v
            cases.append(c)
    return cases


def _warmup_queries(kv, index_kv, n_heads: int, index_heads: int, dtype, seed: int):
    """n -> (queries [n, n_heads, head dim], indexer queries [n, index_heads, its dim]) for a warm-up on these
    caches: random, in ``dtype``, from one generator."""
    HD, DI, dev = kv.shape[-1] // 2, index_kv.shape[-1] // 2, kv.device
    g = torch.Generator(device=dev).manual_seed(seed)
    return lambda n: (torch.randn(n, n_heads, HD, generator=g, device=dev).to(dtype),
                      torch.randn(n, index_heads, DI, generator=g, device=dev).to(dtype))


def decode_variants(B: int, n_blocks: int, m: int, r: int, Hkv: int) -> set:
    """The kernel variants ``qsa_decode_paged_triton`` launches for B single queries over up to n_blocks blocks
    (``prefill_variants``' keys; the select as ``host.decode_select`` picks it: vLLM's, compiled ahead, or ours)."""
    out = _split_attn_variants(B, Hkv, m * r + (r - 1))
    select = host.decode_select(B, n_blocks, m)
    if select != "dense":
        out.add(("score_paged", select == "vllm"))
    if select == "triton":
        out |= _topk_variants(topk_plan(B, n_blocks, m))
    return out


def decode_warmup_cases(max_rows: int, max_blocks: int, m: int, r: int, Hkv: int) -> list:
    """(rows, blocks) cases whose ``qsa_decode_paged_triton`` calls together launch every kernel variant that a call
    of up to ``max_rows`` queries over up to ``max_blocks`` blocks can (``decode_variants``): the decode rows of
    mixed steps and MTP verifications run eagerly, outside the CUDA graphs that compile the pure-decode ones."""
    nbs = _warmup_block_counts(max_blocks, m)
    # the attention's variants change with the rows alone, the select's with rows and blocks: every row count over
    # the cheapest block count, then the block counts over the few row counts where the select changes
    # (past ATTN_PROGRAMS rows the split no longer changes: each (query, KV head) is one program)
    rows_b = sorted({*range(1, min(max_rows, ATTN_PROGRAMS) + 1), max_rows})
    select_rows = sorted(b for b in {1, 64, 65, TOPK_SPLIT_MAX_ROWS, TOPK_SPLIT_MAX_ROWS + 1, max_rows}
                         if b <= max_rows)
    cands = [(b, nbs[0]) for b in rows_b] + sorted(((b, n) for b in select_rows for n in nbs),
                                                   key=lambda c: c[0] * c[1])
    return _cover(cands, lambda b, n: decode_variants(b, n, m, r, Hkv))


def warm_up_decode(kv, index_kv, n_heads: int, index_heads: int, max_len: int, max_rows: int, r: int, budget: int,
                   scale: float, index_scale: float, dtype=torch.bfloat16) -> list:
    """``warm_up_prefill`` for ``qsa_decode_paged_triton``: every variant for up to ``max_rows`` single queries
    (``decode_warmup_cases``) on these caches, reading block 0 only. Returns the cases run."""
    bs, dev = kv.shape[2], kv.device
    cases = decode_warmup_cases(max(1, max_rows), max(1, max_len // r), budget // r, r, kv.shape[1])
    queries = _warmup_queries(kv, index_kv, n_heads, index_heads, dtype, seed=1)
    for i, (B, n_blocks) in enumerate(cases):
        seq_len = n_blocks * r + (r - 1)
        q, iq = queries(B)
        pos = torch.full((B,), seq_len - 1, dtype=torch.long, device=dev)
        bt = torch.zeros(B, triton.cdiv(seq_len, bs), dtype=torch.int32, device=dev)
        if i == 0 and not host.paged_covers(q, pos, iq, kv, bt, index_kv, bt, r, budget):
            return []  # decodes of these caches run the torch reference: nothing to compile
        sel = qsa_select_paged_triton(pos, iq, index_kv, bt, n_blocks, r, budget, index_scale)
        # the attention with and without the output gate in its merge (gated: a uniform decode batch run eagerly,
        # past the captured sizes or in eager mode; ungated: a mixed step's decode rows)
        for gate in (None, q):
            qsa_attend_paged_triton(q, pos, kv, bt, sel, r, scale, gate)
    return cases


def qsa_decode_paged_triton(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, n_blocks: int, r: int,
                            budget: int, scale: float, index_scale: float, gate=None):
    """One query per sequence, caches read through the block tables (``qwen4exp.ops.qsa.reference.
    qsa_decode_paged`` is the contract): scores of every block key in the paged index cache, top-m select, split
    attention over the selected tokens' paged K/V. Fixed grid given ``n_blocks``: no host sync."""
    sel = qsa_select_paged_triton(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget, index_scale)
    return qsa_attend_paged_triton(q, q_pos, kv, block_table, sel, r, scale, gate)


def qsa_select_paged_triton(q_pos, index_q, index_kv, index_block_table, n_blocks: int, r: int, budget: int,
                            index_scale: float):
    """The selection of ``qsa_decode_paged_triton``: block ids [B, m] (-1 pad, int32): scores of every paged block
    key, then top-m (``host.decode_select``: vLLM's select or ``top_ids``); dense ids when no row can be past the
    budget."""
    m = budget // r
    select = host.decode_select(q_pos.shape[0], n_blocks, m)
    if select == "dense":
        return _dense_ids(q_pos, r, m)
    if select == "vllm":
        lg, vis = paged_score_keys(q_pos, index_q, index_kv, index_block_table, n_blocks, r, index_scale, True)
        return vllm_top_ids(lg, q_pos, r, m, vis)
    return top_ids(paged_score_keys(q_pos, index_q, index_kv, index_block_table, n_blocks, r, index_scale), m)


def qsa_attend_paged_triton(q, q_pos, kv, block_table, sel, r: int, scale: float, gate=None):
    """The split attention of ``qsa_decode_paged_triton`` over the selected blocks ``sel`` [B, m] (-1 = none) and
    each query's tail, K/V read through the block table; ``gate``: the output gate applied by the merge."""
    HD = q.shape[-1]
    return sparse_attention_slots(q, kv[..., :HD], kv[..., HD:], q_pos, sel, r, scale, keys=False,
                                  block_table=block_table, gate=gate)


def prefill_score_keys(q_pos, index_q, index_kv, block_row, n_blocks: int, r: int, index_scale: float):
    """[Tq, n_blocks] int64 sort keys of queries of one sequence against its paged block keys (tiled kernel)."""
    Tq, HI, DI = index_q.shape
    keys = torch.empty(Tq, n_blocks, dtype=torch.int64, device=index_q.device)
    LAUNCHED.keep("qsa_score_prefill", _qsa_score_prefill_kernel[
        (triton.cdiv(n_blocks, SCORE_BLOCK_N), triton.cdiv(Tq, SCORE_BLOCK_M))](
        index_q, index_kv, block_row, q_pos, keys, Tq, n_blocks, r, float(index_scale), block_row.shape[0],
        index_q.stride(0), index_q.stride(1), index_kv.stride(0), index_kv.stride(2), keys.stride(0),
        HI=HI, DI=DI, IBS=index_kv.shape[2], BLOCK_M=SCORE_BLOCK_M, BLOCK_N=SCORE_BLOCK_N, num_warps=SCORE_WARPS))
    return keys


def prefill_step(Tq: int, n_blocks: int, m: int) -> tuple[bool, int]:
    """(whether the indexer selects, queries a chunk) of ``qsa_prefill_paged_triton``: chunks whose int64 sort keys
    stay below PREFILL_KEYS_BYTES, at most PREFILL_MAX_QUERIES (the attention grids put queries on an axis limited
    to 65,535)."""
    indexed = n_blocks > m and m > 0
    step = max(1, min(Tq, PREFILL_KEYS_BYTES // (8 * n_blocks))) if indexed else max(Tq, 1)
    return indexed, min(step, PREFILL_MAX_QUERIES)


def prefill_variants(Tq: int, n_blocks: int, m: int, r: int, Hkv: int) -> set:
    """The kernel variants (kernel, what its compiled code depends on) that ``qsa_prefill_paged_triton`` launches
    for Tq queries over n_blocks blocks: its integer sizes are not specialised, so these are what a first use
    compiles."""
    indexed, step = prefill_step(Tq, n_blocks, m)
    n_slots = m * r + (r - 1)
    out = set()
    for c0 in range(0, Tq, step):
        t = min(step, Tq - c0)
        if indexed:
            out |= {("score_prefill",)} | _topk_variants(topk_plan(t, n_blocks, m))
        out |= {("attn_loop",)} if t >= LOOP_MIN_QUERIES else _split_attn_variants(t, Hkv, n_slots)
    return out


def prefill_warmup_cases(max_blocks: int, m: int, r: int, Hkv: int) -> list:
    """(queries, blocks) cases whose ``qsa_prefill_paged_triton`` calls together launch every kernel variant that a
    call over at most ``max_blocks`` blocks can launch (``prefill_variants``; any number of queries: a call's last
    chunk may hold a single one); cheapest first, each adding a variant the ones before did not."""
    nbs = _warmup_block_counts(max_blocks, m)
    tqs = sorted({*range(1, LOOP_MIN_QUERIES + 1), TOPK_SPLIT_MAX_ROWS + 1})
    cands = sorted(((t, n) for t in tqs for n in nbs), key=lambda c: (c[0] * c[1], c))
    return _cover(cands, lambda t, n: prefill_variants(t, n, m, r, Hkv))


def warm_up_prefill(kv, index_kv, n_heads: int, index_heads: int, max_len: int, r: int, budget: int, scale: float,
                    index_scale: float, dtype=torch.bfloat16) -> list:
    """Compile every kernel variant of ``qsa_prefill_paged_triton`` for these caches (``prefill_warmup_cases`` up to
    ``max_len`` tokens) before serving, so no prefill stalls on a Triton compile. It only reads the caches (block
    0 for every block: vLLM's null block) and its outputs are discarded. ``dtype``: the queries' (the model's).
    Returns the cases run."""
    bs, dev = kv.shape[2], kv.device
    cases = prefill_warmup_cases(max(1, max_len // r), budget // r, r, kv.shape[1])
    queries = _warmup_queries(kv, index_kv, n_heads, index_heads, dtype, seed=0)
    for i, (Tq, n_blocks) in enumerate(cases):
        seq_len = n_blocks * r + (r - 1)  # the open tail too
        q, iq = queries(Tq)
        pos = torch.arange(seq_len - Tq, seq_len, device=dev)
        row = torch.zeros(triton.cdiv(seq_len, bs), dtype=torch.int32, device=dev)
        if i == 0 and not host.prefill_paged_covers(q, pos, iq, kv, row, index_kv, r, budget):
            return []  # prefills of these caches run the torch reference: nothing to compile
        qsa_prefill_paged_triton(q, pos, iq, kv, row, index_kv, seq_len, r, budget, scale, index_scale)
    return cases


def qsa_prefill_paged_triton(q, q_pos, index_q, kv, block_row, index_kv, seq_len: int, r: int, budget: int,
                             scale: float, index_scale: float):
    """Queries of ONE sequence over its paged caches (``qwen4exp.ops.qsa.reference.qsa_prefill_paged`` is the
    contract), in query chunks whose sort keys fit ``PREFILL_KEYS_BYTES``: tiled scores of the chunk against the
    sequence's block keys, top-m per query, attention over the selected tokens (looping kernel for long chunks)."""
    Tq, HD = q.shape[0], q.shape[-1]
    m = budget // r
    n_blocks = seq_len // r
    out = torch.empty_like(q)
    if Tq == 0:
        return out
    k_cache, v_cache = kv[..., :HD], kv[..., HD:]
    indexed, step = prefill_step(Tq, n_blocks, m)
    for c0 in range(0, Tq, step):
        qc, pc, iqc = q[c0: c0 + step], q_pos[c0: c0 + step], index_q[c0: c0 + step]
        if indexed:
            sel = top_ids(prefill_score_keys(pc, iqc, index_kv, block_row, n_blocks, r, index_scale), m)
        else:
            sel = _dense_ids(pc, r, m)
        bt = block_row.unsqueeze(0).expand(qc.shape[0], -1)  # stride 0: every query reads the sequence's row
        out[c0: c0 + qc.shape[0]] = sparse_attention_slots(qc, k_cache, v_cache, pc, sel, r, scale, keys=False,
                                                           block_table=bt, loop=qc.shape[0] >= LOOP_MIN_QUERIES)
    return out


@triton.jit
def _write_paged_kernel(KV, SLOTS, K, V, stride_kvb, stride_kvh, stride_kvl, stride_kt, stride_kh, stride_vt,
                        stride_vh, HD: tl.constexpr, BS: tl.constexpr, HD_P: tl.constexpr, FMAX: tl.constexpr,
                        SAT: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(SLOTS + i).to(tl.int64)
    o = tl.arange(0, HD_P)
    m = (o < HD) & (slot >= 0)  # padding (slot < 0): nothing stored
    slot = tl.maximum(slot, 0)
    row = KV + (slot // BS) * stride_kvb + h * stride_kvh + (slot % BS) * stride_kvl
    k = tl.load(K + i * stride_kt + h * stride_kh + o, mask=m, other=0.0).to(tl.float32)
    v = tl.load(V + i * stride_vt + h * stride_vh + o, mask=m, other=0.0).to(tl.float32)
    if SAT:
        k = tl.minimum(tl.maximum(k, -FMAX), FMAX)
        v = tl.minimum(tl.maximum(v, -FMAX), FMAX)
    tl.store(row + o, k.to(KV.dtype.element_ty), mask=m)
    tl.store(row + HD + o, v.to(KV.dtype.element_ty), mask=m)


def write_paged_triton(kv, slots, k, v) -> None:
    N, H, HD = k.shape
    if N:
        _write_paged_kernel[(N, H)](kv, slots, k, v, kv.stride(0), kv.stride(1), kv.stride(2), k.stride(0),
                                    k.stride(1), v.stride(0), v.stride(1), HD=HD, BS=kv.shape[2],
                                    HD_P=triton.next_power_of_2(HD), FMAX=0.0, SAT=False, num_warps=1)


@triton.jit
def _block_mean_seg(RING, RAW, b, pos, ok, offs, m, stride_raw, stride_rl, RR: tl.constexpr, R: tl.constexpr):
    """fp32 mean of the raw keys of tokens pos-R+1 .. pos at columns ``offs`` (the last from RAW, the rest from
    the page's ring ``RING``: position p at row p % RR), rounded to bf16 (``block_mean``)."""
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for j in tl.static_range(R - 1, 0, -1):  # oldest first
        p = tl.maximum(pos - j, 0)
        acc += tl.load(RING + (p % RR) * stride_rl + offs, mask=m & ok, other=0.0).to(tl.float32)
    acc += tl.load(RAW + b * stride_raw + offs, mask=m, other=0.0).to(tl.float32)
    return _rbf(acc / R)


@triton.jit(do_not_specialize_on_alignment=_ROW_VIEWS)
def _index_update_kernel(IKV, RING, SLOTS, POS, VALID, RAW, NW, COS, SIN, eps,
                         stride_kvb, stride_kvl, stride_rb, stride_rl, stride_raw, stride_c,
                         DI: tl.constexpr, RD: tl.constexpr, R: tl.constexpr, IBS: tl.constexpr, RR: tl.constexpr,
                         H_P: tl.constexpr, P_P: tl.constexpr):
    """One program per token: its raw key into its page's ring (row pos % RR); when it completes a block, the
    block's key (mean, zero-centred RMSNorm, RoPE on the first RD dims, each rounded to bf16 where the reference
    rounds) into the block's key row (row ``slot % IBS`` of the ``index_kv`` view, columns [DI, 2 DI)); nothing
    there otherwise (the view's other rows overlap other blocks' keys). The row is split into the two rotated
    halves and the pass-through part, so RoPE needs no shuffle."""
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + b).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int64)
    real = slot >= 0
    ok = real & (tl.load(VALID + b) != 0) & ((pos + 1) % R == 0)
    page = tl.maximum(slot, 0) // IBS
    ring = RING + page * stride_rb
    row = IKV + page * stride_kvb + (tl.maximum(slot, 0) % IBS) * stride_kvl
    HALF: tl.constexpr = RD // 2
    o1 = tl.arange(0, H_P)
    m1 = o1 < HALF
    o3 = RD + tl.arange(0, P_P)
    m3 = o3 < DI
    # block key (the ring's earlier rows: not this token's own row, written below)
    x1 = _block_mean_seg(ring, RAW, b, pos, ok, o1, m1, stride_raw, stride_rl, RR, R)
    x2 = _block_mean_seg(ring, RAW, b, pos, ok, HALF + o1, m1, stride_raw, stride_rl, RR, R)
    x3 = _block_mean_seg(ring, RAW, b, pos, ok, o3, m3, stride_raw, stride_rl, RR, R)
    # raw key -> the ring
    own = ring + (pos % RR) * stride_rl
    tl.store(own + o1, tl.load(RAW + b * stride_raw + o1, mask=m1, other=0.0), mask=m1 & real)
    tl.store(own + HALF + o1, tl.load(RAW + b * stride_raw + HALF + o1, mask=m1, other=0.0), mask=m1 & real)
    tl.store(own + o3, tl.load(RAW + b * stride_raw + o3, mask=m3, other=0.0), mask=m3 & real)
    ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0) + tl.sum(x3 * x3, axis=0)
    rstd = _rsqrt(ss / DI + eps)
    y1 = _rbf((x1 * rstd) * (1.0 + tl.load(NW + o1, mask=m1, other=0.0).to(tl.float32)))
    y2 = _rbf((x2 * rstd) * (1.0 + tl.load(NW + HALF + o1, mask=m1, other=0.0).to(tl.float32)))
    y3 = _rbf((x3 * rstd) * (1.0 + tl.load(NW + o3, mask=m3, other=0.0).to(tl.float32)))
    c1 = tl.load(COS + b * stride_c + o1, mask=m1, other=0.0).to(tl.float32)
    c2 = tl.load(COS + b * stride_c + HALF + o1, mask=m1, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + b * stride_c + o1, mask=m1, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + b * stride_c + HALF + o1, mask=m1, other=0.0).to(tl.float32)
    k1 = _rbf(_rbf(y1 * c1) + _rbf(-y2 * s1))
    k2 = _rbf(_rbf(y2 * c2) + _rbf(y1 * s2))
    tl.store(row + DI + o1, k1.to(IKV.dtype.element_ty), mask=m1 & ok)
    tl.store(row + DI + HALF + o1, k2.to(IKV.dtype.element_ty), mask=m1 & ok)
    tl.store(row + DI + o3, y3.to(IKV.dtype.element_ty), mask=m3 & ok)


def index_update_triton(index_kv, ring, slots, pos, valid, raw, norm_weight, eps, cos, sin, r: int) -> None:
    B, di = raw.shape
    RD = cos.shape[-1]
    if B:
        _index_update_kernel[(B,)](
            index_kv, ring, slots, pos, valid, raw, norm_weight, cos, sin, float(eps),
            index_kv.stride(0), index_kv.stride(2), ring.stride(0), ring.stride(2), raw.stride(0), cos.stride(0),
            DI=di, RD=RD, R=r, IBS=index_kv.shape[2], RR=ring.shape[2], H_P=triton.next_power_of_2(RD // 2),
            P_P=triton.next_power_of_2(max(di - RD, 1)), num_warps=1 if di <= 256 else 4)

