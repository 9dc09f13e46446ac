"""QSA (Qwen Sparse Attention) reference ops, vectorised over queries.

Index side: raw indexer keys are mean-pooled in blocks of ``r`` consecutive tokens (fp32 mean, cast back), then
normalised and rotated at the block's first position by the layer. A query at position p sees the
``n(p) = (p + 1) // r`` complete blocks; it scores each as ``scale * sum_h relu(q_h . K_j)`` (fp32) and keeps the top
``m = budget // r`` of them. Its token set is the selected blocks' tokens plus the tail ``n(p)*r .. p`` (< r tokens).
When ``n(p) <= m`` every visible token is selected: attention is then exactly dense causal attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layout import key_slots, ring_slots


def block_mean(raw_keys: torch.Tensor, r: int) -> torch.Tensor:
    """[n*r, d] -> [n, d]: fp32 mean of each block of r keys, cast back to the keys' dtype."""
    n = raw_keys.shape[0] // r
    return raw_keys[: n * r].view(n, r, -1).float().mean(1).to(raw_keys.dtype)


def num_complete_blocks(q_pos: torch.Tensor, r: int) -> torch.Tensor:
    return torch.div(q_pos + 1, r, rounding_mode="floor")


def indexer_scores(q: torch.Tensor, block_keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Tq, h, d], block_keys [Nb, d] (shared) or [Tq, Nb, d] (one set per query) -> [Tq, Nb] fp32
    = scale * sum_h relu(q_h . K_j)."""
    eq = "thd,nd->thn" if block_keys.dim() == 2 else "thd,tnd->thn"
    s = torch.einsum(eq, q.float(), block_keys.float())
    return s.relu_().sum(1) * scale


def _order_keys(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """One int64 per score that orders like (score descending, block id ascending): the fp32 score's bits made
    order-preserving as a signed int in the high half, 2^32 - 1 - id in the low half; ``INT64_MIN`` where not
    visible. The keys are unique, so a plain top-k over them is exact and deterministic (no host sync)."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 -> +0.0 (the two tie)
    key32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
    ids = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    key = (key32.to(torch.int64) << 32) + (0xFFFFFFFF - ids)
    return key.masked_fill(~visible, _KEY_MIN)


_KEY_MIN = -(1 << 63)


def select_blocks(scores: torch.Tensor, n_complete: torch.Tensor, m: int) -> torch.Tensor:
    """Top-m block ids per query among its complete blocks; -1 where a query has fewer than m blocks.
    scores [Tq, Nb]; n_complete [Tq]. Returns [Tq, min(m, Nb)] int64, in score order.
    Ties (frequent: ReLU makes many scores exactly 0) go to the lower block id, so the choice does not depend on
    the padded width of ``scores`` (torch.topk's own tie order does). Fixed shapes, no host sync: usable inside a
    CUDA graph."""
    Tq, Nb = scores.shape
    k = min(m, Nb)
    if k == 0:
        return scores.new_empty((Tq, 0), dtype=torch.long)
    visible = torch.arange(Nb, device=scores.device).unsqueeze(0) < n_complete.unsqueeze(1)
    top = _order_keys(scores, visible).topk(k, dim=-1).values
    ids = 0xFFFFFFFF - (top & 0xFFFFFFFF)
    return ids.masked_fill(top == _KEY_MIN, -1)


def selection_mask(block_ids: torch.Tensor, q_pos: torch.Tensor, kv_len: int, r: int) -> torch.Tensor:
    """Token mask [Tq, kv_len] from selected block ids (-1 = none) plus each query's unfinished tail."""
    Tq = q_pos.shape[0]
    nb = kv_len // r + 1
    blk = torch.zeros(Tq, nb + 1, dtype=torch.bool, device=q_pos.device)
    blk.scatter_(1, torch.where(block_ids >= 0, block_ids, nb), True)
    j = torch.arange(kv_len, device=q_pos.device)
    tail_start = (num_complete_blocks(q_pos, r) * r).unsqueeze(1)
    in_tail = (j.unsqueeze(0) >= tail_start) & (j.unsqueeze(0) <= q_pos.unsqueeze(1))
    return blk.repeat_interleave(r, dim=1)[:, :kv_len] | in_tail  # token j gets the flag of its block j // r


def selected_token_indices(block_ids: torch.Tensor, q_pos: torch.Tensor, r: int, budget: int) -> torch.Tensor:
    """The same selection as explicit token ids [Tq, budget + r - 1] (blocks in score order, then tail; -1 pad)."""
    Tq, k = block_ids.shape
    off = torch.arange(r, device=q_pos.device)
    toks = (block_ids.unsqueeze(-1) * r + off).masked_fill(block_ids.unsqueeze(-1) < 0, -1).view(Tq, k * r)
    tail_start = num_complete_blocks(q_pos, r) * r
    tail = tail_start.unsqueeze(1) + torch.arange(r - 1, device=q_pos.device)
    tail = tail.masked_fill(tail > q_pos.unsqueeze(1), -1)
    out = torch.full((Tq, budget + r - 1), -1, dtype=torch.long, device=q_pos.device)
    out[:, : k * r] = toks
    out[:, budget: budget + r - 1] = tail
    return out


def sparse_attention(q, k, v, mask, scale):
    """q [Tq, Hq, d], k/v [L, Hkv, d], mask [Tq, L] bool -> [Tq, Hq, d] (softmax in fp32 inside SDPA).

    Query head h reads KV head h // g (g = Hq / Hkv). The g query heads of a group are stacked as g * Tq query rows
    of their KV head, so K and V are read in place rather than copied per query head, and the 4-D [1, Hkv, rows, d]
    layout lets SDPA use its fused CPU kernel."""
    Tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qh = q.view(Tq, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * Tq, d)  # rows: (head in group, query)
    kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask.repeat(g, 1), scale=scale)
    return o.view(hkv, g, Tq, -1).permute(2, 0, 1, 3).reshape(Tq, hq, -1)


def qsa_attention(
    q: torch.Tensor,  # [Tq, Hq, d] normed + rotated queries of one sequence
    k: torch.Tensor,  # [L, Hkv, d] all keys of the sequence so far (incl. these queries)
    v: torch.Tensor,  # [L, Hkv, d]
    q_pos: torch.Tensor,  # [Tq] positions of the queries (in [0, L))
    index_q: torch.Tensor | None,  # [Tq, h, d_i] normed + rotated indexer queries
    block_keys: torch.Tensor | None,  # [Nb, d_i] normed + rotated block keys, Nb >= max n_complete
    r: int,
    budget: int,
    scale: float,
    index_scale: float,
    q_chunk: int = 512,
) -> torch.Tensor:
    """Full QSA for the queries of one sequence, in query chunks so memory stays O(q_chunk * L)."""
    m = budget // r
    L = k.shape[0]
    outs = []
    for s in range(0, q.shape[0], q_chunk):
        qp = q_pos[s: s + q_chunk]
        kv_len = int(qp.max()) + 1
        j = torch.arange(kv_len, device=q.device)
        mask = j.unsqueeze(0) <= qp.unsqueeze(1)
        ncomp = num_complete_blocks(qp, r)
        if int(ncomp.max()) > m:  # some query is past the dense regime: run the indexer
            nb = int(ncomp.max())
            sc = indexer_scores(index_q[s: s + q_chunk], block_keys[:nb], index_scale)
            ids = select_blocks(sc, ncomp, m)
            mask = mask & selection_mask(ids, qp, kv_len, r)
        outs.append(sparse_attention(q[s: s + q_chunk], k[:kv_len], v[:kv_len], mask, scale))
    assert L >= kv_len
    return torch.cat(outs, 0)


def qsa_attention_gathered(
    q: torch.Tensor,  # [Tq, Hq, d] normed + rotated queries of one sequence (all past the dense regime or not)
    q_pos: torch.Tensor,  # [Tq]
    index_q: torch.Tensor,  # [Tq, h, d_i]
    block_keys: torch.Tensor,  # [Nb, d_i], Nb >= max n_complete
    fetch_kv,  # token positions [U] (sorted, >= 0) -> (k, v) [U, Hkv, d]
    r: int,
    budget: int,
    scale: float,
    index_scale: float,
) -> torch.Tensor:
    """``qsa_attention`` for a few queries (decode, MTP verification) that reads only the selected tokens' K/V:
    select, take the union U of the queries' token sets (<= Tq * (budget + r - 1) tokens instead of the whole
    context), fetch those rows, attend under each query's own membership mask. Same selection and softmax as
    ``qsa_attention``; only the set of masked-out keys handed to the kernel differs."""
    m = budget // r
    ncomp = num_complete_blocks(q_pos, r)
    ids = select_blocks(indexer_scores(index_q, block_keys[: int(ncomp.max())], index_scale), ncomp, m)
    toks = selected_token_indices(ids, q_pos, r, budget)  # [Tq, W], -1 = none
    uniq, inv = torch.unique(toks, sorted=True, return_inverse=True)
    mask = torch.zeros(toks.shape[0], uniq.shape[0], dtype=torch.bool, device=q.device)
    mask.scatter_(1, inv, True)
    keep = uniq >= 0
    uniq, mask = uniq[keep], mask[:, keep]
    k, v = fetch_kv(uniq)
    return sparse_attention(q, k, v, mask, scale)


def decode_select(
    q_pos: torch.Tensor,  # [B]
    index_q: torch.Tensor,  # [B, h, d_i]
    read_block_keys,  # block end positions [n_blocks] -> block keys [B, n_blocks, d_i] (rows past a sequence's
    #                   complete blocks may hold anything: they are masked)
    n_blocks: int,  # >= every sequence's number of complete blocks
    r: int,
    budget: int,
    index_scale: float,
) -> torch.Tensor:
    """The selection half of ``qsa_decode_batched``: every sequence's blocks scored at once ([B, n_blocks]), top
    ``m = budget // r`` block ids per sequence (rows below the budget keep all their blocks: dense), -1 padded to
    [B, m] int64 whatever ``n_blocks`` is. Fixed shapes, no host sync."""
    m = budget // r
    ends = r * torch.arange(n_blocks, device=q_pos.device) + r - 1
    ids = select_blocks(indexer_scores(index_q, read_block_keys(ends), index_scale), num_complete_blocks(q_pos, r), m)
    if ids.shape[1] < m:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], m - ids.shape[1]), -1)], 1)
    return ids


def decode_attend(
    q: torch.Tensor,  # [B, Hq, d]: one query per sequence, normed + rotated
    q_pos: torch.Tensor,  # [B]
    block_ids: torch.Tensor,  # [B, k] selected block ids (-1 = none), k <= budget // r
    fetch_kv,  # token positions [B, W] (>= 0) -> (k, v) [B, W, Hkv, d]
    r: int,
    budget: int,
    scale: float,
) -> torch.Tensor:
    """The attention half of ``qsa_decode_batched``: each query over its selected blocks' tokens plus its own tail
    (<= budget + r - 1 tokens, fetched), one batched masked attention. -> [B, Hq, d]."""
    B, Hq, d = q.shape
    toks = selected_token_indices(block_ids, q_pos, r, budget)  # [B, budget + r - 1], -1 = none
    k, v = fetch_kv(toks.clamp(min=0))
    hkv = k.shape[2]
    qh = q.view(B, hkv, Hq // hkv, d)
    mask = (toks >= 0)[:, None, None, :]
    o = F.scaled_dot_product_attention(qh, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                                       attn_mask=mask, scale=scale)
    return o.reshape(B, Hq, -1)


def qsa_decode_batched(q, q_pos, index_q, read_block_keys, fetch_kv, n_blocks: int, r: int, budget: int,
                       scale: float, index_scale: float) -> torch.Tensor:
    """``qsa_attention`` for a batch of single-query sequences with no per-sequence loop and fixed shapes: select
    (``decode_select``), then attend (``decode_attend``). -> [B, Hq, d]."""
    ids = decode_select(q_pos, index_q, read_block_keys, n_blocks, r, budget, index_scale)
    return decode_attend(q, q_pos, ids, fetch_kv, r, budget, scale)


# ------------------------------------------------------------------------------------------------ paged caches
# The layout our runtimes page K/V in: [num_blocks, heads, block_size, 2 * head_dim], each token row holding its K
# in the first half and its V in the second; sequence b's token p sits in block block_table[b, p // block_size].
# The index cache has the same layout with one head: K half = the token's raw indexer key, V half = the key of the
# block that token completes ((p + 1) % r == 0; zeros otherwise).


def paged_rows(cache: torch.Tensor, block_table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rows of a paged cache at token positions pos [B, n] (>= 0) of each sequence -> [B, n, heads, 2 * d].
    Positions past a sequence's table read its last entry (callers mask them)."""
    bs = cache.shape[2]
    col = (pos // bs).clamp(max=block_table.shape[1] - 1)
    return cache[block_table.gather(1, col).long(), :, pos % bs]


def write_paged(kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [N, heads, d] as the rows of tokens at flat ``slots`` (block * block_size + offset) of a paged
    K|V cache; negative slots (padding) store nothing: such a row rewrites what slot 0 holds (slot 0 is in vLLM's
    null block, never a request's). FP8 caches saturate (FP8 casts do not). No host sync (CUDA-graph safe)."""
    bs = kv.shape[2]
    keep = slots >= 0
    s = slots.clamp(min=0)
    blk, off = s // bs, s % bs
    new = torch.cat([k, v], -1)
    if kv.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax = torch.finfo(kv.dtype).max
        new = new.clamp(-fmax, fmax)
    new = new.to(kv.dtype)
    kv[blk, :, off] = torch.where(keep.view(-1, 1, 1), new, kv[blk, :, off])


def index_update_decode(
    index_kv: torch.Tensor,  # [pages, 1, bs, 2 * d_i]: block j's key at row j * r + r - 1, columns [d_i, 2 d_i)
    ring: torch.Tensor,  # [pages, 1, rr, d_i]: raw keys of each page's open block, position p at row p % rr
    slots: torch.Tensor,  # [B] flat slots of this step's tokens (page * bs + row; negative: padding)
    pos: torch.Tensor,  # [B] the tokens' positions
    valid: torch.Tensor,  # [B] bool: a real token (padding rows compute no block key)
    raw: torch.Tensor,  # [B, d_i] the tokens' raw indexer keys
    norm_weight: torch.Tensor,  # [d_i] the indexer's key norm (zero-centred)
    eps: float,
    cos: torch.Tensor,  # [B, RD] RoPE at each token's block start (pos - r + 1)
    sin: torch.Tensor,
    r: int,
) -> None:
    """The index cache's update for one new token per row (decode, MTP verification): its raw key into its page's
    ring, and when it completes a block ((pos + 1) % r == 0) that block's key = RoPE(norm(fp32 mean of the block's r
    raw keys)) (the other r - 1 read back from the ring: a block never spans two pages) at the block's key row. What
    ``QSAAttention.block_keys`` computes, with fixed shapes and no host sync. Rows of one request that complete a
    block read raw keys that other rows of the step wrote: write them into the ring first (``write_paged``)."""
    from ..norm import grouped_rms_norm
    from ..rope import apply_rope

    B, di = raw.shape
    bs, rr = index_kv.shape[2], ring.shape[2]
    keep = slots >= 0
    s = slots.clamp(min=0)
    page = s // bs
    back = (pos.unsqueeze(1) - (r - 1) + torch.arange(r - 1, device=pos.device)).clamp(min=0) % rr
    prev = ring[page.unsqueeze(1), 0, back].to(raw.dtype)  # [B, r - 1, d_i]
    mean = block_mean(torch.cat([prev, raw.unsqueeze(1)], 1).reshape(B * r, di), r)
    keys = apply_rope(grouped_rms_norm(mean, norm_weight, di, eps).unsqueeze(1), cos, sin).squeeze(1)
    completes = ((pos + 1) % r == 0) & valid & keep
    write_ring(ring, bs, slots, pos, raw)
    kslots = torch.where(completes, key_slots(s, bs, r), -1)
    key = keys.to(raw.dtype)
    write_paged(key_rows(index_kv, r), kslots, key[:, None, : di // 2], key[:, None, di // 2:])


def decode_cache_writes(kv, index_kv, ring, slots, pos, valid, k, v, raw, norm_weight, eps, cos, sin, r,
                        nq: int = 1) -> None:
    """A decode step's cache writes, one token a row: its K|V rows (``write_paged``), then the index update
    (``index_update_decode``); with ``nq`` > 1 queries a request (an MTP verification: each request's rows are
    consecutive tokens) the raw keys into the rings first, since a row completing a block reads the step's earlier
    rows' keys there. On GPUs one launch."""
    write_paged(kv, slots, k, v)
    if nq > 1:
        write_ring(ring, index_kv.shape[2], slots, pos, raw)
    index_update_decode(index_kv, ring, slots, pos, valid, raw, norm_weight, eps, cos, sin, r)


def write_ring(ring, bs: int, slots, pos, raw, write=None) -> torch.Tensor:
    """Raw index keys ``raw`` [B, d_i] of the tokens at cache ``slots`` and positions ``pos`` into their pages'
    rings (``layout.ring_slots``; pages of ``bs`` tokens); ``write``: the paged writer (default ``write_paged``).
    Returns the ring rows written (-1: padding)."""
    h = raw.shape[1] // 2
    rows = ring_slots(slots, pos, bs, ring.shape[2])
    (write or write_paged)(ring, rows, raw[:, None, :h], raw[:, None, h:])
    return rows


def key_rows(index_kv: torch.Tensor, r: int) -> torch.Tensor:
    """The block keys of an index cache as [pages, 1, bs // r, d_i] rows (block j of a page: its row j), for
    writers: a view of the same memory, for the plugin's packed pages and a dense per-token cache alike."""
    pages, _, bs, w = index_kv.shape
    st = index_kv.stride()
    di = w // 2
    return index_kv.as_strided((pages, 1, bs // r, di), (st[0], st[1], st[2] * r, st[3]),
                               index_kv.storage_offset() + (r - 1) * st[2] + di * st[3])


def _paged_block_keys(index_kv, index_block_table, B: int):
    """block end positions [n] -> the B sequences' block keys [B, n, d_i], read through their block-table rows."""
    di = index_kv.shape[-1] // 2
    return lambda ends: paged_rows(index_kv, index_block_table, ends.unsqueeze(0).expand(B, -1))[:, :, 0, di:]


def _paged_kv(kv, block_table):
    """token positions [B, W] -> (k, v) [B, W, Hkv, d] of the B sequences, read through their block-table rows."""
    def fetch(tok):
        rows = paged_rows(kv, block_table, tok)
        hd = rows.shape[-1] // 2
        return rows[..., :hd], rows[..., hd:]

    return fetch


def qsa_select_paged(
    q_pos: torch.Tensor,  # [B]
    index_q: torch.Tensor,  # [B, h, d_i]
    index_kv: torch.Tensor,  # [num_blocks_i, 1, block_size_i, 2 * d_i] paged raw key | block key
    index_block_table: torch.Tensor,  # [B, nbt_i]
    n_blocks: int,  # >= every sequence's number of complete blocks
    r: int,
    budget: int,
    index_scale: float,
) -> torch.Tensor:
    """The selection of ``qsa_decode_paged`` alone: top ``budget // r`` block ids [B, budget // r] int64 (-1 pad)
    of single queries against their paged block keys."""
    return decode_select(q_pos, index_q, _paged_block_keys(index_kv, index_block_table, q_pos.shape[0]), n_blocks, r,
                         budget, index_scale)


def output_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention output's gate, o * sigmoid(gate) (o [T, Hq, d] in the activation dtype, gate [T, Hq, d]):
    sigmoid rounded to the dtype, then the product, as two torch ops round them."""
    return o * torch.sigmoid(gate)


def qsa_attend_paged(
    q: torch.Tensor,  # [B, Hq, d]: one query per sequence, normed + rotated
    q_pos: torch.Tensor,  # [B]
    kv: torch.Tensor,  # [num_blocks, Hkv, block_size, 2 * d] paged K | V
    block_table: torch.Tensor,  # [B, nbt]
    block_ids: torch.Tensor,  # [B, budget // r] selected block ids (-1 = none), e.g. from ``qsa_select_paged``
    r: int,
    budget: int,
    scale: float,
    gate: torch.Tensor | None = None,  # [B, Hq, d]: the output gate applied (``output_gate``)
) -> torch.Tensor:
    """The attention of ``qsa_decode_paged`` over a given selection (plus each query's tail). -> [B, Hq, d] in
    q's dtype."""
    o = decode_attend(q, q_pos, block_ids, _paged_kv(kv, block_table), r, budget, scale).to(q.dtype)
    return o if gate is None else output_gate(o, gate)


def reused_block_ids(kept: torch.Tensor, q_pos: torch.Tensor, r: int) -> torch.Tensor:
    """A selection ``kept`` [B, m] made at an earlier position of each sequence, reused for queries at ``q_pos``
    (MTP draft steps 1+ under ``index_share_for_mtp_iteration``): where a query is still within the budget
    (n_complete <= m) it gets every complete block, as a fresh selection would (exact, blocks completed since
    included); past the budget the kept ids stand (the tail is the query's own either way)."""
    m = kept.shape[1]
    ncomp = num_complete_blocks(q_pos.long(), r)
    dense = torch.arange(m, device=q_pos.device).unsqueeze(0)
    dense = torch.where(dense < ncomp.unsqueeze(1), dense, -1)
    return torch.where((ncomp <= m).unsqueeze(1), dense, kept.long())


def qsa_decode_paged(
    q: torch.Tensor,  # [B, Hq, d]: one query per sequence, normed + rotated
    q_pos: torch.Tensor,  # [B]
    index_q: torch.Tensor,  # [B, h, d_i]
    kv: torch.Tensor,  # [num_blocks, Hkv, block_size, 2 * d] paged K | V
    block_table: torch.Tensor,  # [B, nbt]
    index_kv: torch.Tensor,  # [num_blocks_i, 1, block_size_i, 2 * d_i] paged raw key | block key
    index_block_table: torch.Tensor,  # [B, nbt_i]
    n_blocks: int,  # >= every sequence's number of complete blocks
    r: int,
    budget: int,
    scale: float,
    index_scale: float,
    gate: torch.Tensor | None = None,  # [B, Hq, d]: the output gate applied (``output_gate``)
) -> torch.Tensor:
    """``qsa_decode_batched`` over paged caches: block keys and the selected tokens' K/V read through each
    sequence's block table (``qsa_select_paged`` then ``qsa_attend_paged``). Fixed shapes given ``n_blocks``, no
    host sync. -> [B, Hq, d] in q's dtype."""
    ids = qsa_select_paged(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget, index_scale)
    return qsa_attend_paged(q, q_pos, kv, block_table, ids, r, budget, scale, gate)


# Up to this many queries of one sequence past the budget (decode, MTP verification) read only the selected
# tokens' K/V rows (<= queries * (budget + r - 1)) instead of the whole context.
GATHER_SELECTED_MAX_QUERIES = 8


def qsa_prefill_paged(
    q: torch.Tensor,  # [Tq, Hq, d]: queries of ONE sequence (a prefill chunk, MTP verification, ...)
    q_pos: torch.Tensor,  # [Tq] their positions (< seq_len)
    index_q: torch.Tensor,  # [Tq, h, d_i]
    kv: torch.Tensor,  # [num_blocks, Hkv, block_size, 2 * d] paged K | V, every token < seq_len written
    block_row: torch.Tensor,  # [nbt] the sequence's block-table row (main and index rows share it)
    index_kv: torch.Tensor,  # [num_blocks, 1, block_size, 2 * d_i] paged raw key | block key, same table
    seq_len: int,  # tokens of the sequence in the caches, this step's included
    r: int,
    budget: int,
    scale: float,
    index_scale: float,
) -> torch.Tensor:
    """``qsa_attention`` for queries of one sequence whose K/V, raw index keys and block keys are already in the
    paged caches: the block keys of the ``seq_len // r`` complete blocks are read back (only past the dense regime),
    then up to ``GATHER_SELECTED_MAX_QUERIES`` queries read just their selected tokens' rows, more queries the
    whole context. FP8 caches widen to q's dtype. -> [Tq, Hq, d] in q's dtype."""
    hd, di = kv.shape[-1] // 2, index_kv.shape[-1] // 2
    row = block_row.unsqueeze(0)
    nblk = seq_len // r
    bkeys = None
    if nblk > budget // r:  # past the dense regime: the indexer selects blocks
        ends = r * torch.arange(nblk, device=q.device) + r - 1
        bkeys = paged_rows(index_kv, row, ends.unsqueeze(0))[0, :, 0, di:].to(index_q.dtype)

    def rows_of(tok):
        rows = paged_rows(kv, row, tok.unsqueeze(0))[0].to(q.dtype)
        return rows[..., :hd], rows[..., hd:]

    if bkeys is not None and q.shape[0] <= GATHER_SELECTED_MAX_QUERIES:
        out = qsa_attention_gathered(q, q_pos, index_q, bkeys, rows_of, r, budget, scale, index_scale)
    else:
        k, v = rows_of(torch.arange(seq_len, device=q.device))
        out = qsa_attention(q, k, v, q_pos, index_q, bkeys, r, budget, scale, index_scale)
    return out.to(q.dtype)

