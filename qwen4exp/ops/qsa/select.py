"""QSA stage 2, the top m = budget / r blocks of each query's sort keys (``score``): ``_qsa_topk_small_kernel`` (up to
TOPK_SMALL_MAX blocks, keys held in registers, the threshold found bit by bit; split over chunks of keys for few
queries: TOPK_SPLIT) or ``_qsa_topk_kernel`` (radix select over chunks); ties at the threshold go to the lower block
ids, so the set is exactly the reference's. ``vllm_top_ids``: vLLM's own CUDA select on fp32 scores (where vLLM has
loaded it: ``host.decode_select``; ties: its choice). ``top_keys``: ``torch.topk`` of the sort keys (the unpaged op;
the same set, largest first). A query with at most m complete blocks takes all of them (``dense_ids``: the
reference's dense regime). Which launch runs: ``host.topk_plan``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import host, launch
from .score import score_keys

_KEY_MIN = tl.constexpr(launch.INT64_MIN)


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


def top_keys(keys, m: int):
    """The m largest keys per row, largest first (torch.topk: the unpaged op's select)."""
    return torch.topk(keys, m, dim=1, largest=True, sorted=True).values


def top_ids(keys, m: int):
    """The reference's top-m block ids per row (as a set, in id order; -1 pad), by the Triton radix select."""
    Tq, Nb = keys.shape
    out = torch.empty(Tq, m, dtype=torch.int32, device=keys.device)
    plan = host.topk_plan(Tq, Nb, m)
    M_P = triton.next_power_of_2(m)
    if plan[0] == "split":
        n_chunks, N_P = plan[1], plan[2]
        cand = torch.empty(Tq, n_chunks * m, dtype=torch.int64, device=keys.device)
        launch.LAUNCHED.keep("qsa_topk_split", _qsa_topk_small_kernel[(Tq, n_chunks)](
            keys, cand, Nb, m, keys.stride(0), cand.stride(0), N_P=launch.TOPK_SPLIT, M_P=M_P,
            BITS=launch.TOPK_SPLIT_BITS,
            MODE=1, num_warps=launch.TOPK_SPLIT_WARPS))
        launch.LAUNCHED.keep("qsa_topk", _qsa_topk_small_kernel[(Tq,)](
            cand, out, n_chunks * m, m, cand.stride(0), out.stride(0), N_P=N_P, M_P=M_P, BITS=launch.TOPK_SPLIT_BITS,
            MODE=2, num_warps=launch.TOPK_SPLIT_WARPS))
    elif plan[0] == "small":
        launch.LAUNCHED.keep("qsa_topk", _qsa_topk_small_kernel[(Tq,)](
            keys, out, Nb, m, keys.stride(0), out.stride(0), N_P=plan[1], M_P=M_P, BITS=launch.TOPK_SMALL_BITS,
            num_warps=launch.TOPK_SMALL_WARPS))
    else:
        launch.LAUNCHED.keep("qsa_topk", _qsa_topk_kernel[(Tq,)](keys, out, Nb, m, keys.stride(0), out.stride(0),
                                                          CH=launch.TOPK_CHUNK, M_P=M_P, num_warps=16))
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
        ws = _VLLM_TOPK_WORKSPACE[dev] = torch.empty(launch.VLLM_TOPK_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    if visible is None:
        visible = torch.clamp(torch.div(q_pos + 1, r, rounding_mode="floor"), max=n_blocks).to(torch.int32)
    out = torch.empty(rows, m, dtype=torch.int32, device=dev)
    # (past its row limit vLLM's persistent select, as upstream's prefill: same arguments)
    op = torch.ops._C.cooperative_topk if rows <= host.VLLM_COOPERATIVE_MAX_ROWS else torch.ops._C.persistent_topk
    op(logits, visible, out, ws, m, n_blocks)
    return out


def dense_ids(q_pos, r, m):
    """Every complete block [Tq, m] (-1 pad), int32 as the selects' ids: the attention kernels then compile one
    variant for both regimes (a warm-up that ran one regime leaves nothing for the other to compile)."""
    n_complete = torch.div(q_pos + 1, r, rounding_mode="floor")
    dense = torch.arange(m, dtype=torch.int32, device=q_pos.device).unsqueeze(0).expand(q_pos.shape[0], m)
    return torch.where(dense < n_complete.unsqueeze(1), dense, -1)


def uses_indexer(index_q, block_keys, m):
    # With Nb <= m block keys every query the contract allows (n_complete <= Nb) is in the dense regime.
    return index_q is not None and block_keys is not None and block_keys.shape[0] > m and m > 0


def select_block_ids(q_pos, index_q, block_keys, r: int, budget: int, index_scale: float):
    """The selection of ``qsa_attention_triton``: top-m block ids [Tq, m] (-1 pad) in the reference's order (the
    sort keys' torch.topk); no host sync."""
    m = budget // r
    if not uses_indexer(index_q, block_keys, m):
        return dense_ids(q_pos, r, m)
    top = top_keys(score_keys(q_pos, index_q, block_keys, r, index_scale), m)
    return torch.where(top == launch.INT64_MIN, -1, 4294967295 - (top & 4294967295))
