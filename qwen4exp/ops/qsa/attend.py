"""QSA stage 3, attention of the query heads of one GQA group over the selected tokens: slot i < m*r is token
ids[i // r] * r + i % r, slot m*r + j is tail token n_complete*r + j (<= q_pos). ``_qsa_attn_kernel`` (split over slot
ranges, one program per (range, KV head, query), an online softmax over the range's chunks of ATTN_SLOT_BLOCK
slots) + ``_qsa_merge_kernel`` (the fp32 partials merged across ranges, the output gate applied); for long prefill
chunks ``_qsa_attn_loop_kernel`` (one program per (query, KV head) loops over the slots, no partials through
memory). Softmax in fp32 (exp2), P rounded to bf16 for the P.V product (as flash kernels do). FP8 caches are read and
widened exactly to bf16. The split's launch: ``host.attn_split``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import dot as _dot
from ..triton_utils import round_bf16 as _rbf
from ..triton_utils import sigmoid as _sigmoid
from . import host, launch

_KEY_MIN = tl.constexpr(launch.INT64_MIN)


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


@triton.jit(do_not_specialize=['m', 'n_chunks', 'cpp', 'stride_bt', 'n_bt'],
            do_not_specialize_on_alignment=launch.ROW_VIEWS)
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


@triton.jit(do_not_specialize=['m', 'n_chunks', 'stride_bt', 'n_bt'], do_not_specialize_on_alignment=launch.ROW_VIEWS)
def _qsa_attn_loop_kernel(Q, K, V, QPOS, IDS, O, r, m, n_chunks, scale_log2,
                          stride_qt, stride_qh, stride_kl, stride_kh, stride_vl, stride_vh, stride_ids_t,
                          BT, stride_bt, n_bt, stride_kb, stride_vb, stride_ot, stride_oh,
                          G: tl.constexpr, G_P: tl.constexpr, HD: tl.constexpr, SB: tl.constexpr,
                          TAIL: tl.constexpr, KEYS: tl.constexpr, PAGED: tl.constexpr, PBS: tl.constexpr,
                          PREFETCH: tl.constexpr):
    """All slots of one (query, KV head) in one program (prefill: many queries fill the GPU without a split, and no
    fp32 partials go through memory; PREFETCH: the next chunk's rows looked up during this chunk's loads)."""
    g = tl.program_id(0)
    t = tl.program_id(1)
    acc, m_i, l_i = _attn_chunks(Q, K, V, QPOS, IDS, BT, t, g, 0, n_chunks, r, m, scale_log2, stride_qt, stride_qh,
                                 stride_kl, stride_kh, stride_vl, stride_vh, stride_ids_t, stride_bt, n_bt,
                                 stride_kb, stride_vb, G, G_P, HD, SB, TAIL, KEYS, PAGED, PBS, PREFETCH)
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
        SB = launch.LOOP_SLOT_BLOCK
        launch.LAUNCHED.keep("qsa_attn_loop", _qsa_attn_loop_kernel[(Hkv, Tq)](
            q, k, v, q_pos, sel, out, r, m, triton.cdiv(max(n_slots, 1), SB), scale_log2,
            q.stride(0), q.stride(1), *strides, sel.stride(0), *paged, out.stride(0), out.stride(1),
            G=G, G_P=G_P, HD=HD, SB=SB, TAIL=r - 1, KEYS=keys, PAGED=block_table is not None, PBS=pbs,
            PREFETCH=launch.LOOP_PREFETCH, num_warps=launch.LOOP_WARPS, num_stages=launch.LOOP_STAGES))
        return out
    many, SB, warps, n_chunks, cpp, n_split = host.attn_split(Tq, Hkv, n_slots)
    op = torch.empty(Tq * Hkv * n_split * G_P * HD, dtype=torch.float32, device=dev)
    mp = torch.empty(Tq * Hkv * n_split * G_P, dtype=torch.float32, device=dev)
    lp = torch.empty_like(mp)
    launch.LAUNCHED.keep("qsa_attn", _qsa_attn_kernel[(n_split, Hkv, Tq)](
        q, k, v, q_pos, sel, op, mp, lp, r, m, n_chunks, cpp, scale_log2,
        q.stride(0), q.stride(1), *strides, sel.stride(0), *paged,
        G=G, G_P=G_P, HD=HD, SB=SB, TAIL=r - 1, KEYS=keys, PAGED=block_table is not None, PBS=pbs,
        PREFETCH=launch.ATTN_PREFETCH_MANY if many else launch.ATTN_PREFETCH, num_warps=warps,
        num_stages=launch.ATTN_STAGES_MANY if many else launch.ATTN_STAGES))
    gated = gate is not None
    launch.LAUNCHED.keep("qsa_merge", _qsa_merge_kernel[(G, Hkv, Tq)](
        op, mp, lp, out, gate if gated else out, n_split, out.stride(0), out.stride(1),
        gate.stride(0) if gated else 0, gate.stride(1) if gated else 0,
        G=G, G_P=G_P, HD=HD, NSP=triton.next_power_of_2(n_split), CH=16, GATED=gated, num_warps=4))
    return out
