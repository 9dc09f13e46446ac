"""QSA (``qwen4exp.ops.qsa``): the reference against independent per-query loops (the equations of the architecture
digest, section 3), the CUDA path's host-side decisions (``host``: what each kernel covers, which top-k select a
paged decode runs, loading vLLM's select), the kernels against the reference at the real widths (``gpu``), and the
Triton checks without a GPU (``interpreter_qsa_ple.py``), one item each.

The loops below deliberately do not call the code under test: each one is the textbook form of its equation.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from op_helpers import BF, F32, expect_kernel, gen, paged_qsa_case, poison, qsa_inputs, rel, rnd

from qwen4exp.ops import _registry
from qwen4exp.ops import qsa as qsa_ops
from qwen4exp.ops.cuda_graph import capture
from qwen4exp.ops.qsa import host
from qwen4exp.ops.qsa import reference as qsa_ref


# =====================================================================================================================
# the reference against per-query loops (CPU)
# =====================================================================================================================
def loop_block_mean(raw, r):
    out = []
    for j in range(raw.shape[0] // r):
        acc = torch.zeros(raw.shape[1], dtype=torch.float32)
        for i in range(r):
            acc = acc + raw[j * r + i].float()
        out.append((acc / r).to(raw.dtype))
    return torch.stack(out)


def loop_score(index_q, block_keys, t, j, scale):
    """s_j = scale * sum_h relu(q_h . K_j) in fp32."""
    s = 0.0
    for h in range(index_q.shape[1]):
        s += max(float(index_q[t, h].double() @ block_keys[j].double()), 0.0)
    return s * scale


def loop_selected_tokens(index_q, block_keys, t, p, r, budget, scale):
    """The token set of query row t at position p: every visible token while the query has at most m complete
    blocks, else the top-m blocks' tokens plus the tail n*r .. p."""
    m = budget // r
    n = (p + 1) // r
    if n <= m:
        return list(range(p + 1))
    scores = [loop_score(index_q, block_keys, t, j, scale) for j in range(n)]
    top = sorted(range(n), key=lambda j: -scores[j])[:m]
    toks = [j * r + i for j in top for i in range(r)]
    return sorted(toks + list(range(n * r, p + 1)))


def loop_attention(q, k, v, t, tokens, scale):
    """softmax(q_h . K_S * scale) V_S per query head, GQA head h -> kv head h // (Hq / Hkv), fp32."""
    Hq, Hkv = q.shape[1], k.shape[1]
    o = torch.zeros(Hq, v.shape[2])
    for h in range(Hq):
        kv = h // (Hq // Hkv)
        logits = torch.stack([(q[t, h].float() @ k[s, kv].float()) * scale for s in tokens])
        w = torch.softmax(logits, 0)
        for wi, s in zip(w, tokens):
            o[h] += wi * v[s, kv].float()
    return o


@pytest.mark.parametrize("r,n_blocks", [(4, 7), (3, 1), (1, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_mean_matches_loop(r, n_blocks, dtype):
    torch.manual_seed(0)
    raw = torch.randn(n_blocks * r + (r - 1), 5).to(dtype)  # a trailing incomplete block is ignored
    out = qsa_ref.block_mean(raw, r)
    assert out.dtype == dtype and out.shape == (n_blocks, 5)
    torch.testing.assert_close(out, loop_block_mean(raw, r), rtol=1e-6, atol=1e-6)


def test_num_complete_blocks():
    pos = torch.arange(0, 20)
    for r in (1, 3, 4):
        n = qsa_ref.num_complete_blocks(pos, r)
        assert n.tolist() == [(p + 1) // r for p in range(20)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_scores_matches_loop(dtype):
    _, _, _, iq, bk = qsa_inputs(9, seed=1, dtype=dtype)
    scale = 6 ** -0.5
    s = qsa_ref.indexer_scores(iq, bk, scale)
    assert s.dtype == torch.float32 and s.shape == (9, 9)
    ref = torch.tensor([[loop_score(iq, bk, t, j, scale) for j in range(9)] for t in range(9)], dtype=torch.float32)
    torch.testing.assert_close(s, ref, **F32)
    # one key set per query (batched decode): query t against its own keys, here bk rolled by t
    own = torch.stack([bk.roll(t, 0) for t in range(9)])
    s2 = qsa_ref.indexer_scores(iq, own, scale)
    ref2 = torch.tensor([[loop_score(iq, bk.roll(t, 0), t, j, scale) for j in range(9)] for t in range(9)])
    torch.testing.assert_close(s2, ref2, **F32)


@pytest.mark.parametrize("ties", [False, True])
def test_select_blocks_top_m_with_padding(ties):
    """Top-m among the complete blocks, in score order; ties (ReLU makes many scores exactly 0) go to the lower
    block id; -1 after the last real block when a query has fewer than m."""
    torch.manual_seed(2)
    Tq, Nb, m = 9, 30, 4
    scores = torch.randn(Tq, Nb)
    if ties:
        scores = scores.relu().round()  # mostly 0, some 1 and 2
    n_complete = torch.tensor([0, 1, 3, 4, 5, 30, 2, 17, 29])
    ids = qsa_ref.select_blocks(scores, n_complete, m)
    assert ids.shape == (Tq, min(m, Nb)) and ids.dtype == torch.long
    for t in range(Tq):
        n = int(n_complete[t])
        want = sorted(range(n), key=lambda j: -float(scores[t, j]))[: min(m, n)]  # Python's sort is stable
        assert ids[t].tolist() == want + [-1] * (min(m, Nb) - min(m, n))
    # fewer blocks in total than m: width min(m, Nb); no blocks at all: empty
    assert qsa_ref.select_blocks(torch.randn(2, 2), torch.tensor([1, 2]), 4).tolist()[0][1] == -1
    assert qsa_ref.select_blocks(torch.randn(3, 0), torch.zeros(3, dtype=torch.long), 4).shape == (3, 0)


def test_selection_mask_and_token_indices_match_loop():
    torch.manual_seed(3)
    r, budget = 4, 12
    m = budget // r
    L = 37
    q_pos = torch.tensor([0, 3, 4, 11, 12, 15, 16, 23, 30, 35, 36])
    n = qsa_ref.num_complete_blocks(q_pos, r)
    scores = torch.randn(q_pos.numel(), L // r)
    ids = qsa_ref.select_blocks(scores, n, m)
    mask = qsa_ref.selection_mask(ids, q_pos, L, r)
    toks = qsa_ref.selected_token_indices(ids, q_pos, r, budget)
    assert mask.shape == (q_pos.numel(), L) and toks.shape == (q_pos.numel(), budget + r - 1)
    for t, p in enumerate(q_pos.tolist()):
        blocks = {b for b in ids[t].tolist() if b >= 0}
        nt = (p + 1) // r
        want = [j for j in range(L) if j // r in blocks or nt * r <= j <= p]
        assert mask[t].nonzero().flatten().tolist() == want
        got = sorted(x for x in toks[t].tolist() if x >= 0)
        assert got == want
        assert len(got) <= budget + r - 1
        assert len(got) == min(nt, m) * r + (p + 1 - nt * r)
        assert all(j <= p for j in got)  # never a future token


@pytest.mark.parametrize("L,r,budget", [(80, 4, 16), (61, 3, 9), (43, 4, 8)])
def test_qsa_attention_matches_per_query_loop(L, r, budget):
    """Prompts several times the budget: every query row vs gather-the-selected-ids + softmax attention."""
    q, k, v, iq, bk = qsa_inputs(L, seed=L)
    scale, iscale = 8 ** -0.5, 6 ** -0.5
    pos = torch.arange(L)
    out = qsa_ref.qsa_attention(q, k, v, pos, iq, bk, r, budget, scale, iscale, q_chunk=16)
    assert out.shape == q.shape
    m = budget // r
    for t in range(L):
        toks = loop_selected_tokens(iq, bk, t, t, r, budget, iscale)
        assert len(toks) <= budget + r - 1
        if (t + 1) // r > m:
            assert len(toks) == budget + (t + 1) % r  # the sparse regime always fills the budget
        torch.testing.assert_close(out[t], loop_attention(q, k, v, t, toks, scale), **F32)


def test_qsa_attention_query_subset_decode_and_chunk():
    """Queries that are the last tokens of a longer cache (chunked prefill / decode): q_pos in [0, L)."""
    L, r, budget = 70, 4, 16
    q, k, v, iq, bk = qsa_inputs(L, seed=4)
    scale, iscale = 0.3, 0.4
    for first in (L - 1, L - 6, 40):
        pos = torch.arange(first, L)
        out = qsa_ref.qsa_attention(q[first:], k, v, pos, iq[first:], bk, r, budget, scale, iscale)
        for t, p in enumerate(pos.tolist()):
            toks = loop_selected_tokens(iq[first:], bk, t, p, r, budget, iscale)
            torch.testing.assert_close(out[t], loop_attention(q[first:], k, v, t, toks, scale), **F32)


@pytest.mark.parametrize("L,r,budget,n_q", [(70, 4, 16, 1), (70, 4, 16, 4), (91, 3, 9, 2), (200, 4, 32, 3)])
def test_qsa_attention_gathered_equals_full(L, r, budget, n_q):
    """Decode / MTP-verification queries past the budget: fetching only the union of the selected tokens gives
    the same output as attention over the whole context; only those rows are fetched."""
    q, k, v, iq, bk = qsa_inputs(L, seed=L + n_q)
    scale, iscale = 0.3, 0.4
    pos = torch.arange(L - n_q, L)
    full = qsa_ref.qsa_attention(q[-n_q:], k, v, pos, iq[-n_q:], bk, r, budget, scale, iscale)
    fetched = []

    def fetch(tok):
        fetched.append(tok)
        return k[tok], v[tok]

    got = qsa_ref.qsa_attention_gathered(q[-n_q:], pos, iq[-n_q:], bk, fetch, r, budget, scale, iscale)
    torch.testing.assert_close(got, full, **F32)
    (tok,) = fetched
    assert tok.tolist() == sorted(set(tok.tolist())) and int(tok.min()) >= 0 and int(tok.max()) < L
    assert len(tok) <= n_q * (budget + r - 1)
    union = set()
    for t, p in enumerate(pos.tolist()):
        union |= set(loop_selected_tokens(iq[-n_q:], bk, t, p, r, budget, iscale))
    assert set(tok.tolist()) == union


@pytest.mark.parametrize("r,budget", [(4, 16), (3, 9)])
def test_qsa_decode_batched_equals_per_sequence(r, budget):
    """One decode query per sequence, sequences below, at and far past the budget in one batch (block keys and K/V
    padded with garbage past each sequence's length): equal to qsa_attention run sequence by sequence."""
    lens = [1, 7, budget + r - 1, budget + r, 3 * budget + 1, 90]
    seqs = [qsa_inputs(L, seed=100 + i) for i, L in enumerate(lens)]
    B, Lmax = len(lens), max(lens)
    scale, iscale = 0.3, 0.4
    hkv, d, di = seqs[0][1].shape[1], seqs[0][1].shape[2], seqs[0][4].shape[1]
    K = torch.randn(B, Lmax, hkv, d) * 1e3  # garbage everywhere a sequence has no token
    V = torch.randn(B, Lmax, hkv, d) * 1e3
    BK = torch.full((B, Lmax // r + 1, di), float("nan"))
    for b, (L, (q, k, v, iq, bk)) in enumerate(zip(lens, seqs)):
        K[b, :L], V[b, :L] = k, v
        BK[b, : L // r] = bk[: L // r]
    pos = torch.tensor(lens) - 1
    qb = torch.stack([s[0][-1] for s in seqs])
    iqb = torch.stack([s[3][-1] for s in seqs])
    n_blocks = Lmax // r

    def read_bk(ends):
        return BK[:, ends // r]

    def fetch(tok):
        bidx = torch.arange(B).unsqueeze(1).expand_as(tok)
        return K[bidx, tok], V[bidx, tok]

    got = qsa_ref.qsa_decode_batched(qb, pos, iqb, read_bk, fetch, n_blocks, r, budget, scale, iscale)
    for b, (L, (q, k, v, iq, bk)) in enumerate(zip(lens, seqs)):
        want = qsa_ref.qsa_attention(q[-1:], k, v, pos[b:b + 1], iq[-1:], bk, r, budget, scale, iscale)
        torch.testing.assert_close(got[b], want[0], **F32)


@pytest.mark.parametrize("r,budget,bs,ibs", [(4, 16, 16, 64), (2, 6, 4, 4)])
def test_qsa_decode_paged_equals_per_sequence(r, budget, bs, ibs):
    """The paged decode op (block keys and selected K/V through shuffled block tables, garbage elsewhere, padded
    block tables) = qsa_attention sequence by sequence on contiguous K/V; ``n_blocks`` only needs to bound them."""
    lens = [1, 7, budget + r - 1, budget + r, 3 * budget + 1, 90]
    seqs = [qsa_inputs(L, seed=200 + i) for i, L in enumerate(lens)]
    kv, bt, ikv, ibt = paged_qsa_case(seqs, lens, r, bs, ibs)
    pos = torch.tensor(lens) - 1
    qb = torch.stack([s_[0][-1] for s_ in seqs])
    iqb = torch.stack([s_[3][-1] for s_ in seqs])
    for n_blocks in (max(lens) // r, max(lens) // r + 13):
        got = qsa_ref.qsa_decode_paged(qb, pos, iqb, kv, bt, ikv, ibt, n_blocks, r, budget, 0.3, 0.4)
        for b, (L, (q, k, v, iq, bk)) in enumerate(zip(lens, seqs)):
            want = qsa_ref.qsa_attention(q[-1:], k, v, pos[b:b + 1], iq[-1:], bk, r, budget, 0.3, 0.4)
            torch.testing.assert_close(got[b], want[0], **F32)


@pytest.mark.parametrize("r,budget,bs", [(4, 16, 16), (2, 6, 4)])
def test_qsa_select_and_attend_paged(r, budget, bs):
    """The decode op's two halves on their own: ``qsa_select_paged`` gives [B, budget // r] block ids (-1 padded,
    also when ``n_blocks`` < budget // r) = the contiguous reference's selection; ``qsa_attend_paged`` over ANY given
    selection (here a random subset of each query's complete blocks, -1 holes) = masked attention over those
    blocks' tokens plus the query's tail on the contiguous K/V."""
    m = budget // r
    lens = [3, budget + r - 1, budget + r, 3 * budget + 1, 61]
    seqs = [qsa_inputs(L, seed=400 + i) for i, L in enumerate(lens)]
    kv, bt, ikv, ibt = paged_qsa_case(seqs, lens, r, bs, bs, shared_table=True)
    pos = torch.tensor(lens) - 1
    qb, iqb = torch.stack([s_[0][-1] for s_ in seqs]), torch.stack([s_[3][-1] for s_ in seqs])
    for n_blocks, B in ((max(lens) // r, len(lens)), (max(lens) // r + 5, len(lens)), (1, 1)):  # (1: < m)
        ids = qsa_ref.qsa_select_paged(pos[:B], iqb[:B], ikv, ibt[:B], n_blocks, r, budget, 0.4)
        assert ids.shape == (B, m) and ids.dtype == torch.long
        for b in range(ids.shape[0]):
            L, (q, k, v, iq, bk) = lens[b], seqs[b]
            nc = L // r
            want = (qsa_ref.select_blocks(qsa_ref.indexer_scores(iq[-1:], bk[:nc], 0.4), pos[b:b + 1] * 0 + nc, m)
                    if nc > m else torch.arange(nc).unsqueeze(0))
            assert sorted(x for x in ids[b].tolist() if x >= 0) == sorted(want[0].tolist()), (n_blocks, b)
            assert (ids[b] < 0).sum() == m - min(nc, m)
    gen = torch.Generator().manual_seed(7)
    sel = torch.full((len(lens), m), -1, dtype=torch.long)
    for b, L in enumerate(lens):
        nc = L // r
        pick = torch.randperm(nc, generator=gen)[: min(nc, m)]
        pick = pick[torch.rand(pick.shape[0], generator=gen) < 0.7]  # holes
        sel[b, : pick.shape[0]] = pick
    got = qsa_ref.qsa_attend_paged(qb, pos, kv, bt, sel, r, budget, 0.3)
    for b, (L, (q, k, v, iq, bk)) in enumerate(zip(lens, seqs)):
        mask = qsa_ref.selection_mask(sel[b:b + 1], pos[b:b + 1], L, r)
        want = qsa_ref.sparse_attention(q[-1:], k, v, mask, 0.3)
        torch.testing.assert_close(got[b], want[0], **F32)


def test_reused_block_ids():
    """MTP draft steps 1+ reusing a selection made at an earlier position: rows still within the budget get every
    complete block at their new position (what a fresh selection gives, blocks completed since included); rows past
    the budget keep the reused ids."""
    r = 4
    kept = torch.tensor([[0, 1, -1], [0, -1, -1], [5, 2, 7], [4, 0, 1]])  # m = 3 blocks
    pos = torch.tensor([11, 7, 40, 12])  # complete blocks: 3, 2, 10, 3
    got = qsa_ref.reused_block_ids(kept, pos, r)
    assert got.tolist() == [[0, 1, 2], [0, 1, -1], [5, 2, 7], [0, 1, 2]]


@pytest.mark.parametrize("r,budget,bs", [(4, 16, 16), (2, 6, 4)])
@pytest.mark.parametrize("n_q", [1, 5, 40])
def test_qsa_prefill_paged_equals_contiguous(r, budget, bs, n_q):
    """The paged prefill op (the last n_q queries of each sequence; K/V and block keys read back through a shuffled
    block-table row, garbage elsewhere) = qsa_attention on the contiguous K/V: few queries past the budget take the
    gathered path, more queries the whole context; sequences below, at and far past the budget."""
    lens = [7, budget + r - 1, budget + r, 3 * budget + 1, 90]
    seqs = [qsa_inputs(L, seed=300 + i) for i, L in enumerate(lens)]
    kv, bt, ikv, ibt = paged_qsa_case(seqs, lens, r, bs, bs, shared_table=True)  # vLLM's one cache layer
    assert torch.equal(bt, ibt)
    for b, (L, (q, k, v, iq, bk)) in enumerate(zip(lens, seqs)):
        n = min(n_q, L)
        pos = torch.arange(L - n, L)
        got = qsa_ref.qsa_prefill_paged(q[-n:], pos, iq[-n:], kv, bt[b], ikv, L, r, budget, 0.3, 0.4)
        want = qsa_ref.qsa_attention(q[-n:], k, v, pos, iq[-n:], bk, r, budget, 0.3, 0.4)
        torch.testing.assert_close(got, want, **F32)


def test_paged_rows_reads_each_sequence_block_table():
    cache = torch.arange(8 * 1 * 4 * 2).view(8, 1, 4, 2)
    table = torch.tensor([[5, 2, 7], [1, 0, 3]])
    pos = torch.tensor([[0, 3, 4, 11, 40], [2, 5, 9, 8, 1]])
    got = qsa_ref.paged_rows(cache, table, pos)[..., 0, 0] // 2  # row number = block * 4 + offset
    want = [[5 * 4 + 0, 5 * 4 + 3, 2 * 4 + 0, 7 * 4 + 3, 7 * 4 + 0], [1 * 4 + 2, 0 * 4 + 1, 3 * 4 + 1, 3 * 4 + 0,
                                                                       1 * 4 + 1]]
    assert got.tolist() == want  # position 40 is past row 0's table: its last block (callers mask such rows)


@pytest.mark.parametrize("L", [1, 5, 19])
def test_qsa_attention_below_budget_is_dense_causal(L):
    """Up to position budget + r - 2 every query has at most m complete blocks: exactly dense causal attention
    (the indexer inputs are not even needed)."""
    r, budget = 4, 16
    q, k, v, _, _ = qsa_inputs(L, Hq=6, Hkv=2, seed=L)
    out = qsa_ref.qsa_attention(q, k, v, torch.arange(L), None, None, r, budget, 0.25, 1.0)
    for t in range(L):
        torch.testing.assert_close(out[t], loop_attention(q, k, v, t, list(range(t + 1)), 0.25), **F32)
    dense = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
                                           v.repeat_interleave(3, 1).transpose(0, 1), is_causal=True, scale=0.25)
    torch.testing.assert_close(out, dense.transpose(0, 1), **F32)


def test_qsa_attention_just_past_budget_is_sparse():
    """At L = budget + r the last query has m + 1 complete blocks: it must drop exactly one block (r tokens)."""
    r, budget = 4, 16
    L = budget + r
    q, k, v, iq, bk = qsa_inputs(L, seed=21)
    out = qsa_ref.qsa_attention(q, k, v, torch.arange(L), iq, bk, r, budget, 0.35, 0.4)
    toks = loop_selected_tokens(iq, bk, L - 1, L - 1, r, budget, 0.4)
    assert len(toks) == budget
    torch.testing.assert_close(out[-1], loop_attention(q, k, v, L - 1, toks, 0.35), **F32)
    dense_last = loop_attention(q, k, v, L - 1, list(range(L)), 0.35)
    assert not torch.allclose(out[-1], dense_last, rtol=1e-3, atol=1e-3)


def test_qsa_attention_bf16_sanity():
    L, r, budget = 48, 4, 16
    q, k, v, iq, bk = qsa_inputs(L, seed=8, dtype=torch.bfloat16)
    out = qsa_ref.qsa_attention(q, k, v, torch.arange(L), iq, bk, r, budget, 8 ** -0.5, 6 ** -0.5)
    assert out.dtype == torch.bfloat16
    for t in range(0, L, 5):
        toks = loop_selected_tokens(iq, bk, t, t, r, budget, 6 ** -0.5)
        torch.testing.assert_close(out[t].float(), loop_attention(q, k, v, t, toks, 8 ** -0.5), rtol=2e-2, atol=2e-2)


# =====================================================================================================================
# the CUDA path's host-side decisions (CPU: shapes, dtypes, strides; no Triton)
# =====================================================================================================================
def _bf(*shape, dtype=BF):
    return torch.zeros(*shape, dtype=dtype)


def page_padded(t, pad=40):
    """The same cache with every block inside a larger page, as vLLM lays out a hybrid model's caches (each block
    padded to the common page size): not contiguous, block stride > heads * block_size * row."""
    base = torch.zeros(t.shape[0], t[0].numel() + pad, dtype=t.dtype, device=t.device)
    v = base[:, : t[0].numel()].view(t.shape)
    v.copy_(t)
    assert not v.is_contiguous()
    return v


def test_attention_covers_the_real_widths_and_not_more():
    q, k, v = _bf(4, 24, 256), _bf(50, 2, 256), _bf(50, 2, 256)
    iq, bk = _bf(4, 4, 128), _bf(12, 128)
    pos = torch.arange(46, 50)
    assert host.attention_covers(q, k, v, pos, iq, bk, 4, 2048)
    assert host.attention_covers(q, k, v, pos, None, None, 4, 2048)  # no indexer: the dense regime
    assert host.attention_covers(_bf(host.MAX_TQ, 24, 256), k, v, pos, iq, bk, 4, 2048)
    assert not host.attention_covers(_bf(host.MAX_TQ + 1, 24, 256), k, v, pos, iq, bk, 4, 2048)  # prefill sizes
    assert not host.attention_covers(_bf(0, 24, 256), k, v, pos, iq, bk, 4, 2048)
    assert not host.attention_covers(q.float(), k.float(), v.float(), pos, iq, bk, 4, 2048)  # bf16 only
    assert not host.attention_covers(_bf(4, 24, 96), _bf(50, 2, 96), _bf(50, 2, 96), pos, iq, bk, 4, 2048)
    assert not host.attention_covers(_bf(4, 34, 256), _bf(50, 2, 256), v, pos, iq, bk, 4, 2048)  # 17 heads a group
    assert not host.attention_covers(q, _bf(50, 2, 512)[..., ::2], v, pos, iq, bk, 4, 2048)  # strided elements
    assert not host.attention_covers(q, k, v, pos, iq, bk.float(), 4, 2048)
    assert not host.attention_covers(q, k, v, pos, _bf(4, 4, 96), _bf(12, 96), 4, 2048)  # indexer width
    assert not host.attention_covers(q, k, v, pos, _bf(4, 17, 128), bk, 4, 2048)  # indexer heads
    assert not host.attention_covers(q, k, v, pos, iq, bk, 0, 2048)


def test_paged_covers_vllm_layouts():
    """bf16 and FP8 caches, page-padded (not contiguous) as vLLM hands them over: the kernels take them; other
    dtypes, widths and an index cache of several heads go to the reference."""
    q, iq, pos = _bf(3, 24, 256), _bf(3, 4, 128), torch.tensor([5, 9, 70])
    kv, ikv = page_padded(_bf(10, 2, 16, 512)), page_padded(_bf(10, 1, 64, 256))
    bt, ibt = torch.zeros(3, 5, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32)
    assert host.paged_covers(q, pos, iq, kv, bt, ikv, ibt, 4, 2048)
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert host.paged_covers(q, pos, iq, kv.to(dt), bt, ikv.to(dt), ibt, 4, 2048)
    assert not host.paged_covers(q, pos, iq, kv.half(), bt, ikv, ibt, 4, 2048)
    assert not host.paged_covers(q, pos, iq, kv, bt, _bf(10, 2, 64, 256), ibt, 4, 2048)  # two index heads
    assert not host.paged_covers(q[:2], pos, iq, kv, bt, ikv, ibt, 4, 2048)  # one indexer query per query
    assert not host.paged_covers(q, pos, iq, kv, bt[0], ikv, ibt, 4, 2048)  # a block table per query
    assert not host.paged_covers(q, pos, iq, kv, bt, ikv, ibt[0], 4, 2048)
    assert not host.paged_covers(q, pos, iq, _bf(10, 2, 16, 384), bt, ikv, ibt, 4, 2048)  # K|V width != 2 x head
    # the halves alone: the select needs only the index side, the attention only the K|V side
    assert host.select_paged_covers(iq, ikv, ibt, 4) and not host.select_paged_covers(iq.float(), ikv, ibt, 4)
    assert not host.select_paged_covers(_bf(0, 4, 128), ikv, ibt, 4)
    assert host.attend_paged_covers(q, kv, bt, 4) and not host.attend_paged_covers(_bf(0, 24, 256), kv, bt, 4)
    row = torch.zeros(5, dtype=torch.int32)  # prefill: the queries of one sequence, one block-table row
    assert host.prefill_paged_covers(q, pos, iq, kv, row, ikv, 4, 2048)
    assert not host.prefill_paged_covers(q, pos, iq, kv, bt, ikv, 4, 2048)
    assert not host.prefill_paged_covers(q, pos, iq[:, 0], kv, row, ikv, 4, 2048)


def test_cache_write_covers():
    kv, slots = _bf(12, 2, 16, 128), torch.zeros(9, dtype=torch.long)
    k, v = _bf(9, 2, 128)[..., :64], _bf(9, 2, 64)  # strided rows, contiguous elements
    assert host.write_paged_covers(kv, slots, k, v)
    assert host.write_paged_covers(kv.float(), slots, k.float(), v.float())
    assert not host.write_paged_covers(kv.to(torch.float8_e4m3fn), slots, k, v)  # FP8 writes: the reference
    assert not host.write_paged_covers(kv, slots, k.float(), v)
    assert not host.write_paged_covers(kv, slots[:8], k, v)
    assert not host.write_paged_covers(kv, slots, _bf(9, 2, 128)[..., ::2], v)
    B, di, RD = 5, 128, 64
    ikv, ring = _bf(8, 1, 64, 2 * di), _bf(8, 1, 20, di)
    s, pos, valid = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long), torch.ones(B, dtype=torch.bool)
    raw, w, cos, sin = _bf(B, di), _bf(di), _bf(B, RD), _bf(B, RD)
    assert host.index_update_covers(ikv, ring, s, pos, valid, raw, w, cos, sin, 4)
    assert not host.index_update_covers(ikv, ring, s, pos, valid, raw, w, cos, sin, 65)  # blocks of up to 64
    assert not host.index_update_covers(ikv, ring[:, :, :3], s, pos, valid, raw, w, cos, sin, 4)  # ring < r rows
    assert not host.index_update_covers(ikv, ring[..., :64], s, pos, valid, raw, w, cos, sin, 4)  # narrow ring
    assert not host.index_update_covers(ikv, ring, s, pos, valid, raw, w, _bf(B, 63), _bf(B, 63), 4)  # odd RoPE
    assert not host.index_update_covers(ikv, ring, s, pos, valid, raw.float(), w, cos, sin, 4)
    assert not host.index_update_covers(_bf(8, 2, 64, 2 * di), ring, s, pos, valid, raw, w, cos, sin, 4)


def test_decode_select_picks_dense_vllm_or_triton(monkeypatch):
    """The paged decode's select: dense while no query can be past the budget (``n_blocks`` <= m), vLLM's where it
    is switched on, loaded and covers the call (up to 64 rows, m of 512 / 1024 / 2048), else the Triton select."""
    monkeypatch.setattr(host, "vllm_topk_loaded", lambda: True)
    assert host.VLLM_TOPK  # the default
    assert host.decode_select(4, 512, 512) == "dense" and host.decode_select(4, 9, 0) == "dense"
    assert host.decode_select(4, 513, 512) == "vllm" and host.decode_select(64, 10 ** 5, 2048) == "vllm"
    assert host.decode_select(65, 10 ** 5, 512) == "triton"  # past its rows
    assert host.decode_select(4, 10 ** 5, 256) == "triton"  # a k it has no variant for
    monkeypatch.setattr(host, "VLLM_TOPK", False)
    assert host.decode_select(4, 513, 512) == "triton"
    monkeypatch.setattr(host, "VLLM_TOPK", True)
    monkeypatch.setattr(host, "vllm_topk_loaded", lambda: False)  # outside a vLLM engine
    assert host.decode_select(4, 513, 512) == "triton"


@pytest.fixture
def prefill_select_vllm(monkeypatch):
    """``QWEN4EXP_QSA_PREFILL_SELECT=vllm`` for one test (the parsed switches forgotten before and after)."""
    from qwen4exp import envs

    monkeypatch.setenv("QWEN4EXP_QSA_PREFILL_SELECT", "vllm")
    envs.reset()
    yield
    envs.reset()  # (before monkeypatch restores the environment: the next read parses it afresh)


def test_prefill_select_is_vllms_by_default_and_ours_on_request(monkeypatch):
    """The default prefill select is vLLM's where it is loaded (as upstream's prefill; docs/performance.md,
    Decisions); ``QWEN4EXP_QSA_PREFILL_SELECT=triton`` asks for ours."""
    from qwen4exp import envs

    monkeypatch.setattr(host, "vllm_topk_loaded", lambda: True)
    monkeypatch.setattr(host, "vllm_persistent_topk_loaded", lambda: True)
    assert envs.SWITCHES["QWEN4EXP_QSA_PREFILL_SELECT"].default == "vllm"
    monkeypatch.delenv("QWEN4EXP_QSA_PREFILL_SELECT", raising=False)
    envs.reset()
    try:
        assert host.prefill_select(512) == "vllm"
        monkeypatch.setenv("QWEN4EXP_QSA_PREFILL_SELECT", "triton")
        envs.reset()
        assert host.prefill_select(512) == "triton"
    finally:
        envs.reset()


def test_prefill_select_is_vllms_where_both_its_selects_are_loaded(monkeypatch, prefill_select_vllm):
    """A prefill chunk's select with ``QWEN4EXP_QSA_PREFILL_SELECT=vllm``: vLLM's (cooperative up to 64 rows,
    persistent past them) where both are loaded and m is one of its k values, else ours."""
    monkeypatch.setattr(host, "vllm_topk_loaded", lambda: True)
    monkeypatch.setattr(host, "vllm_persistent_topk_loaded", lambda: True)
    assert host.prefill_select(512) == "vllm" and host.prefill_select(2048) == "vllm"
    assert host.prefill_select(16) == "triton"  # the tiny models' budgets
    monkeypatch.setattr(host, "VLLM_TOPK", False)
    assert host.prefill_select(512) == "triton"
    monkeypatch.setattr(host, "VLLM_TOPK", True)
    monkeypatch.setattr(host, "vllm_persistent_topk_loaded", lambda: False)
    assert host.prefill_select(512) == "triton"


def test_load_vllm_kernels_registers_vllms_operators():
    """``load_vllm_kernels`` loads vLLM's extension as its platform does at engine start; afterwards
    ``vllm_topk_loaded`` says whether that build has the top-k select (the CUDA build has, the CPU build not),
    and the decode picks accordingly."""
    pytest.importorskip("vllm", reason="vLLM is not installed (its top-k select comes with it)")
    assert host.load_vllm_kernels()
    try:
        has = hasattr(torch.ops._C, "cooperative_topk")
    except (AttributeError, RuntimeError):
        has = False
    assert host.vllm_topk_loaded() == has
    assert host.vllm_topk_covers(4, 512) == has and not host.vllm_topk_covers(65, 512)
    assert host.decode_select(4, 513, 512) == ("vllm" if has else "triton")


def test_dispatcher_sends_cpu_calls_to_the_reference():
    assert qsa_ops.KERNELS.table("cpu") == {}
    q, k, v, iq, bk = qsa_inputs(30, seed=1)
    with _registry.record() as ran:
        out = qsa_ops.qsa_attention(q, k, v, torch.arange(30), iq, bk, 4, 16, 0.3, 0.4)
    assert ran == {"qsa_attention": "reference"}
    torch.testing.assert_close(out, qsa_ref.qsa_attention(q, k, v, torch.arange(30), iq, bk, 4, 16, 0.3, 0.4))


# =====================================================================================================================
# the CUDA kernels against the reference, real widths (``gpu``); outputs from poisoned (NaN-filled) memory, so an
# unwritten element shows up as NaN
# =====================================================================================================================
R_QSA, BUDGET = 4, 2048


@pytest.fixture(autouse=True)
def _triton_select(request, monkeypatch):
    """The kernel tests hold the paged decode to the reference's selection (lower ids among tied blocks) and to
    bitwise repeatable outputs (ids in id order): the Triton select. The default is vLLM's where its CUDA ops are
    loaded (once a test in the vLLM venv loads them they stay), and is neither: its own test asks for it."""
    if request.node.get_closest_marker("gpu") is not None:
        monkeypatch.setattr(host, "VLLM_TOPK", False)


def _cuda():
    from qwen4exp.ops.qsa import cuda
    return cuda


def _tk():
    from qwen4exp.ops.qsa import triton_kernel
    return triton_kernel


def _launch():
    from qwen4exp.ops.qsa import launch
    return launch


@pytest.mark.gpu
def test_dispatcher_picks_the_qsa_kernels_on_cuda():
    cuda = _cuda()
    table = qsa_ops.KERNELS.table("cuda")
    assert not qsa_ops.KERNELS.errors, qsa_ops.KERNELS.errors
    assert table == cuda.KERNELS and sorted(table) == sorted(
        ["qsa_attention", "qsa_decode_paged", "qsa_select_paged", "qsa_attend_paged", "qsa_prefill_paged",
         "qsa_write_paged", "qsa_index_update_decode", "qsa_decode_writes", "qsa_warm_up_prefill",
         "qsa_warm_up_decode"])
    assert qsa_ops.pick("qsa_decode_paged", torch.device("cuda"), qsa_ref.qsa_decode_paged) is cuda.qsa_decode_paged
    assert table["qsa_write_paged"] is cuda.write_paged and table["qsa_index_update_decode"] is cuda.index_update_decode


def qsa_case(L, Tq, seed, Hq=24, Hkv=2, d=256, hi=4, di=128, tie_heavy=False):
    g = gen(seed, "cuda")
    q = rnd((Tq, Hq, d), g)
    k = rnd((L, Hkv, d), g)
    v = rnd((L, Hkv, d), g)
    iq = rnd((Tq, hi, di), g)
    bk = rnd((L // R_QSA, di), g)
    if tie_heavy:  # most blocks score exactly 0 (every head's dot negative): ties at the top-m boundary
        iq = iq.abs()
        bk = -bk.abs()
        pos = torch.randperm(bk.shape[0], generator=torch.Generator().manual_seed(seed))[:300]
        bk[pos.cuda()] = bk[pos.cuda()].abs()
    q_pos = torch.arange(L - Tq, L, device="cuda")
    return q, k, v, q_pos, iq, bk


def check_selection(q_pos, iq, bk, scale):
    """The unpaged op's selection (``select_block_ids``) = the reference's block sets, but for near-ties."""
    m = BUDGET // R_QSA
    ids = _tk().select_block_ids(q_pos, iq, bk, R_QSA, BUDGET, scale)
    nc = qsa_ref.num_complete_blocks(q_pos, R_QSA)
    if int(nc.max()) <= m:  # dense regime: every visible block (in score order when the indexer ran)
        for t in range(ids.shape[0]):
            assert sorted(x for x in ids[t].tolist() if x >= 0) == list(range(int(nc[t])))
        return
    sc = qsa_ref.indexer_scores(iq, bk[: int(nc.max())], scale)
    want = qsa_ref.select_blocks(sc, nc, m)
    if want.shape[1] < m:
        want = torch.cat([want, want.new_full((want.shape[0], m - want.shape[1]), -1)], 1)
    for t in range(ids.shape[0]):
        a, b = set(ids[t].tolist()), set(want[t].tolist())
        if a != b:  # only a near-tie (fp32 summation order) may flip a block at the boundary
            diff = torch.tensor(sorted((a ^ b) - {-1}), device="cuda")
            kth = sc[t, want[t][want[t] >= 0][-1]]
            gap = (sc[t, diff] - kth).abs().max().item()
            assert gap <= 1e-5 * max(1.0, kth.abs().item()), (t, sorted(a - b), sorted(b - a), gap)


@pytest.mark.gpu
@pytest.mark.parametrize("L,Tq", [(1, 1), (7, 3), (100, 4), (2051, 1), (2052, 1), (2053, 2), (2056, 4),
                                  (4099, 3), (10_240, 2), (30_001, 1), (50_003, 4), (50_000, 1),
                                  (65_536 * 4 + 3, 1)])
def test_qsa_attention_matches_reference(L, Tq):
    q, k, v, q_pos, iq, bk = qsa_case(L, Tq, seed=L + Tq)
    scale, iscale = 256 ** -0.5, 128 ** -0.5
    check_selection(q_pos, iq, bk, iscale)
    poison()
    with expect_kernel("qsa_attention"):
        out = qsa_ops.qsa_attention(q, k, v, q_pos, iq, bk, R_QSA, BUDGET, scale, iscale)
    want = qsa_ref.qsa_attention(q, k, v, q_pos, iq, bk, R_QSA, BUDGET, scale, iscale)
    assert out.shape == want.shape and out.dtype == want.dtype
    assert not torch.isnan(out).any()
    err = rel(out, want)
    assert err < 1e-2, err
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=5e-2)


def select_each_way(monkeypatch, keys, m):
    """``top_ids`` by each select a default path runs: the in-register select in one launch (0 and 2 threshold
    bits a step), the split select (chunks of 4,096 / 1,024 keys, then their candidates) where the rows are few, the
    chunked radix select; and torch.topk of the sort keys (the unpaged op's). -> [(way, ids [Tq, m] int64)]."""
    tk = _tk()
    out = []
    ways = {"small bits=0": dict(TOPK_SPLIT=0, TOPK_SMALL_BITS=0),
            "small bits=2": dict(TOPK_SPLIT=0, TOPK_SMALL_BITS=2),
            "split 4096": dict(TOPK_SPLIT=4096), "split 1024": dict(TOPK_SPLIT=1024),
            "split 4096 bits=0": dict(TOPK_SPLIT=4096, TOPK_SPLIT_BITS=0),
            "radix": dict(TOPK_SPLIT=0, TOPK_SMALL_MAX=0)}
    for way, settings in ways.items():
        with monkeypatch.context() as mp:
            for name, value in settings.items():
                mp.setattr(_launch(), name, value)
            out.append((way, tk.top_ids(keys, m).long()))
    top = tk.top_keys(keys, m)
    out.append(("torch", torch.where(top == tk.INT64_MIN, -1, 4294967295 - (top & 4294967295))))
    return out


@pytest.mark.gpu
def test_qsa_selection_with_heavy_ties_and_no_indexer(monkeypatch):
    """Most blocks score exactly 0: every select keeps the reference's set (ties to the lower block id; torch.topk
    of the sort keys its order too); the op's output matches; and the dense regime without an indexer."""
    tk = _tk()
    L = 8195
    q, k, v, q_pos, iq, bk = qsa_case(L, 2, seed=5, tie_heavy=True)
    nc = qsa_ref.num_complete_blocks(q_pos, R_QSA)
    want = qsa_ref.select_blocks(qsa_ref.indexer_scores(iq, bk[: int(nc.max())], 0.1), nc, BUDGET // R_QSA)
    for way, ids in select_each_way(monkeypatch, tk.score_keys(q_pos, iq, bk, R_QSA, 0.1), BUDGET // R_QSA):
        if way == "torch":  # the sort keys give the reference's order too
            assert torch.equal(ids, want)
        for t in range(ids.shape[0]):  # ties: lower block id first, like the reference's stable sort
            assert sorted(ids[t].tolist()) == sorted(want[t].tolist()), way
    assert torch.equal(tk.select_block_ids(q_pos, iq, bk, R_QSA, BUDGET, 0.1), want)
    with expect_kernel("qsa_attention"):
        out = qsa_ops.qsa_attention(q, k, v, q_pos, iq, bk, R_QSA, BUDGET, 0.0625, 0.1)
    want_o = qsa_ref.qsa_attention(q, k, v, q_pos, iq, bk, R_QSA, BUDGET, 0.0625, 0.1)
    torch.testing.assert_close(out.float(), want_o.float(), atol=2e-2, rtol=5e-2)
    # dense regime without an indexer (block_keys None)
    q, k, v, q_pos, _, _ = qsa_case(1500, 3, seed=6)
    with expect_kernel("qsa_attention"):
        out = qsa_ops.qsa_attention(q, k, v, q_pos, None, None, R_QSA, BUDGET, 0.0625, 0.1)
    want_o = qsa_ref.qsa_attention(q, k, v, q_pos, None, None, R_QSA, BUDGET, 0.0625, 0.1)
    torch.testing.assert_close(out.float(), want_o.float(), atol=2e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("Nb,Tq", [(513, 1), (600, 3), (12_500, 2), (16_385, 1), (65_536, 2)])
def test_qsa_topk_selection_every_path(monkeypatch, Nb, Tq):
    g = gen(Nb, "cuda")
    iq, bk = rnd((Tq, 4, 128), g), rnd((Nb, 128), g)
    q_pos = Nb * R_QSA - 1 - 5 * torch.arange(Tq, device="cuda")  # fewer visible blocks for later rows
    nc = qsa_ref.num_complete_blocks(q_pos, R_QSA)
    sc = qsa_ref.indexer_scores(iq, bk, 0.088)
    want = qsa_ref.select_blocks(sc, nc, BUDGET // R_QSA)
    for way, ids in select_each_way(monkeypatch, _tk().score_keys(q_pos, iq, bk, R_QSA, 0.088), BUDGET // R_QSA):
        for t in range(Tq):
            a, b = set(ids[t].tolist()), set(want[t].tolist())
            if a != b:  # only a near-tie (fp32 summation order) may flip a block at the boundary
                kth = sc[t, want[t][-1]]
                diff = torch.tensor(sorted(a ^ b), device="cuda")
                assert (sc[t, diff] - kth).abs().max().item() <= 1e-5 * max(1.0, kth.abs().item()), (way, t)


@pytest.mark.gpu
def test_qsa_small_heads_and_cuda_graph():
    q, k, v, q_pos, iq, bk = qsa_case(3001, 2, seed=9, Hq=6, Hkv=1, d=128, hi=2, di=64)
    with expect_kernel("qsa_attention"):
        out = qsa_ops.qsa_attention(q, k, v, q_pos, iq, bk, R_QSA, BUDGET, 0.1, 0.2)
    want = qsa_ref.qsa_attention(q, k, v, q_pos, iq, bk, R_QSA, BUDGET, 0.1, 0.2)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=5e-2)
    q, k, v, q_pos, iq, bk = qsa_case(50_001, 1, seed=10)
    with expect_kernel("qsa_attention"):
        eager = qsa_ops.qsa_attention(q, k, v, q_pos, iq, bk, R_QSA, BUDGET, 0.0625, 0.088)
    graph, out = capture(lambda: qsa_ops.qsa_attention(q, k, v, q_pos, iq, bk, R_QSA, BUDGET, 0.0625, 0.088))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


# ------------------------------------------------------------------------------------------- paged decode
def paged_decode_case(lens, bs, ibs, seed, Hq=24, Hkv=2, d=256, hi=4, di=128):
    g = torch.Generator().manual_seed(seed)
    seqs = [[torch.randn(s, generator=g).to(BF) for s in ((L, Hq, d), (L, Hkv, d), (L, Hkv, d), (L, hi, di),
                                                               (L // R_QSA + 1, di))] for L in lens]
    kv, bt, ikv, ibt = (t.cuda() for t in paged_qsa_case(seqs, lens, R_QSA, bs, ibs, seed))
    q = torch.stack([s[0][-1] for s in seqs]).cuda()
    iq = torch.stack([s[3][-1] for s in seqs]).cuda()
    pos = torch.tensor(lens, device="cuda") - 1
    return q, pos, iq, kv, bt, ikv, ibt


def paged_prefill_case(L, n_q, bs, seed, dtype=None, Hq=24, Hkv=2, d=256, hi=4, di=128):
    """The last n_q queries of ONE L-token sequence, its K/V and index rows paged by one block-table row (vLLM's
    layout) into page-padded caches, optionally stored as ``dtype`` (FP8: values clamped into its range).
    -> (q, pos, index_q, kv, row, index_kv) on the GPU."""
    g = torch.Generator().manual_seed(seed)
    seq = [torch.randn(s, generator=g).to(BF) for s in ((n_q, Hq, d), (L, Hkv, d), (L, Hkv, d), (n_q, hi, di),
                                                         (L // R_QSA + 1, di))]  # queries: only the last n_q
    kv, bt, ikv, _ = paged_qsa_case([seq], [L], R_QSA, bs, bs, seed=L, shared_table=True)
    if dtype is not None:
        kv, ikv = (t.float().clamp(-400, 400).to(dtype) for t in (kv, ikv))
    kv, ikv = page_padded(kv.cuda()), page_padded(ikv.cuda())
    pos = torch.arange(L - n_q, L, device="cuda")
    return seq[0].cuda(), pos, seq[3].cuda(), kv, bt[0].cuda(), ikv


@pytest.mark.gpu
@pytest.mark.parametrize("lens,bs,ibs,padded", [([1, 7, 2051, 2052, 2056, 9001, 50_003], 16, 64, False),
                                                ([50_000], 784, 3136, True), ([3, 4099, 20_000, 5], 64, 256, True),
                                                # 9 queries: the many-query attention settings (ATTN_*_MANY)
                                                ([1, 7, 2051, 2052, 2056, 9001, 50_003, 3_000, 12_000], 16, 64,
                                                 True)])
def test_qsa_decode_paged_matches_reference(lens, bs, ibs, padded):
    """The paged decode kernels (score through the index cache's block table, top-k, split attention over paged
    K/V) against the torch reference on the same shuffled, garbage-filled paged caches, real widths; with
    page-padded caches too (the layout vLLM hands over: the Triton path must take it, not fall back)."""
    q, pos, iq, kv, bt, ikv, ibt = paged_decode_case(lens, bs, ibs, seed=len(lens) + bs)
    if padded:
        kv, ikv = page_padded(kv), page_padded(ikv)
    assert _cuda().paged_supported(q, pos, iq, kv, bt, ikv, ibt, R_QSA, BUDGET)
    scale, iscale = 256 ** -0.5, 128 ** -0.5
    n_blocks = max(lens) // R_QSA + 9
    poison()
    with expect_kernel("qsa_decode_paged"):
        out = qsa_ops.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, n_blocks, R_QSA, BUDGET, scale, iscale)
    want = qsa_ref.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, n_blocks, R_QSA, BUDGET, scale, iscale)
    assert out.shape == want.shape and out.dtype == want.dtype
    assert not torch.isnan(out).any()
    for b in range(len(lens)):
        err = rel(out[b], want[b])
        assert err < 1e-2, (lens[b], err)


@pytest.mark.gpu
def test_qsa_select_and_attend_paged_match_reference():
    """The decode op's two halves as their own ops (MTP drafts under index_share_for_mtp_iteration select once and
    attend several times): the Triton select gives the reference's block sets ([B, m], -1 padded, int64), and the
    Triton attention over a given selection (a reference selection with holes punched in) matches the reference's,
    on page-padded caches at the real widths."""
    lens = [1, 7, 2051, 2300, 9001, 50_003]
    q, pos, iq, kv, bt, ikv, ibt = paged_decode_case(lens, 16, 64, seed=33)
    kv, ikv = page_padded(kv), page_padded(ikv)
    scale, iscale = 256 ** -0.5, 128 ** -0.5
    n_blocks = max(lens) // R_QSA + 9
    m = BUDGET // R_QSA
    poison()
    with expect_kernel("qsa_select_paged"):
        ids = qsa_ops.qsa_select_paged(pos, iq, ikv, ibt, n_blocks, R_QSA, BUDGET, iscale)
    want = qsa_ref.qsa_select_paged(pos, iq, ikv, ibt, n_blocks, R_QSA, BUDGET, iscale)
    assert ids.shape == want.shape == (len(lens), m) and ids.dtype == torch.long
    assert torch.equal(ids.sort(dim=1).values, want.sort(dim=1).values)
    sel = want.clone()
    sel[:, ::3] = -1  # holes: any selection, not only a top-k's
    poison()
    with expect_kernel("qsa_attend_paged"):
        out = qsa_ops.qsa_attend_paged(q, pos, kv, bt, sel, R_QSA, BUDGET, scale)
    ref_out = qsa_ref.qsa_attend_paged(q, pos, kv, bt, sel, R_QSA, BUDGET, scale)
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype and not torch.isnan(out).any()
    for b in range(len(lens)):
        assert rel(out[b], ref_out[b]) < 1e-2, lens[b]


@pytest.mark.gpu
def test_qsa_decode_paged_with_vllm_topk(monkeypatch):
    """The default paged select where vLLM is loaded (vLLM's CUDA select on fp32 scores; inside the vLLM venv:
    ``tools/gpu_device.sh tests`` runs the vllm_topk tests there): the same selections as the Triton select on
    untied random scores (set equality per row, short rows included: -1 padded) and the paged decode output against
    the reference, eager and in a CUDA graph. Not eager == graph bit for bit: the order of the ids vLLM's select
    returns varies between calls, and with it the order in which the attention sums the selected tokens."""
    pytest.importorskip("vllm", reason="vLLM is not installed (the base GPU image): run inside the vLLM venv")
    tk = _tk()
    host.load_vllm_kernels()
    assert host.vllm_topk_covers(4, BUDGET // R_QSA), "vLLM is installed but torch.ops._C.cooperative_topk is not"
    # (2,300 tokens: 575 blocks, of which ~36 score exactly 0 (all four ReLUs off): the top 512 stay clear of such
    # ties, where vLLM's select may choose other blocks than the reference's lower ids)
    lens = [7, 2300, 9001, 50_003]
    q, pos, iq, kv, bt, ikv, ibt = paged_decode_case(lens, 16, 64, seed=21)
    scale, iscale = 256 ** -0.5, 128 ** -0.5
    n_blocks = max(lens) // R_QSA + 9
    m = BUDGET // R_QSA
    lg = torch.randn(len(lens), -(-n_blocks // 4) * 4, device="cuda")[:, :n_blocks]
    visible = (pos + 1) // R_QSA
    keys = torch.where(torch.arange(n_blocks, device="cuda")[None] < visible[:, None], lg.float(), float("nan"))
    bits = keys.contiguous().view(torch.int32).long()
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # orderable score bits, as the sort keys
    sort_keys = torch.where(keys.isnan(), tk.INT64_MIN, (order << 32) + (4294967295 - torch.arange(n_blocks,
                                                                                                   device="cuda")))
    want = tk.top_ids(sort_keys, m).sort(dim=1).values
    got = tk.vllm_top_ids(lg, pos, R_QSA, m).sort(dim=1).values
    assert torch.equal(got, want)
    monkeypatch.setattr(host, "VLLM_TOPK", True)
    assert host.decode_select(len(lens), n_blocks, m) == "vllm"
    with expect_kernel("qsa_decode_paged"):
        out = qsa_ops.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, n_blocks, R_QSA, BUDGET, scale, iscale)
    g, graphed = capture(lambda: qsa_ops.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, n_blocks, R_QSA, BUDGET,
                                                          scale, iscale))
    g.replay()
    want = qsa_ref.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, n_blocks, R_QSA, BUDGET, scale, iscale)
    for b in range(len(lens)):
        assert rel(out[b], want[b]) < 1e-2, lens[b]
        assert rel(graphed[b], want[b]) < 1e-2, lens[b]
    assert rel(graphed, out) < 5e-3  # the same selection summed in another order: bf16 rounding apart


@pytest.mark.gpu
def test_qsa_decode_paged_gated_by_its_merge():
    """The output gate inside the merge (what the model's uniform decode batches use): equal, bit for bit, to
    ``output_gate`` applied to the ungated result, the gate a strided view of a [Q | gate] projection; and the same
    through the attend half (MTP drafts reusing a selection); in a CUDA graph too."""
    lens = [7, 2300, 50_003]
    q, pos, iq, kv, bt, ikv, ibt = paged_decode_case(lens, 16, 64, seed=5)
    args = (max(lens) // R_QSA + 9, R_QSA, BUDGET, 256 ** -0.5, 128 ** -0.5)
    qg = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2], device="cuda").mul(3).to(q.dtype)
    gate = qg[..., q.shape[2]:]
    poison()
    with expect_kernel("qsa_decode_paged"):
        plain = qsa_ops.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, *args)
        gated = qsa_ops.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, *args, gate)
    assert torch.equal(gated, qsa_ref.output_gate(plain, gate))
    ids = qsa_ops.qsa_select_paged(pos, iq, ikv, ibt, args[0], R_QSA, BUDGET, args[4])
    with expect_kernel("qsa_attend_paged"):
        attended = qsa_ops.qsa_attend_paged(q, pos, kv, bt, ids, R_QSA, BUDGET, args[3], gate)
    assert torch.equal(attended, qsa_ref.output_gate(qsa_ops.qsa_attend_paged(q, pos, kv, bt, ids, R_QSA, BUDGET,
                                                                              args[3]), gate))
    g, graphed = capture(lambda: qsa_ops.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, *args, gate))
    g.replay()
    torch.testing.assert_close(graphed, gated, rtol=0, atol=0)


@pytest.mark.gpu
def test_qsa_prefill_paged_with_vllm_select(prefill_select_vllm):
    """Where vLLM is loaded a prefill chunk past the budget selects with vLLM's select on fp32 scores (its
    persistent select past 64 rows, as upstream's prefill): the same sets as our radix select on untied random
    scores (200 rows), and a 2,300-token prompt's last 300 queries attend as the reference does."""
    pytest.importorskip("vllm", reason="vLLM is not installed (the base GPU image): run inside the vLLM venv")
    tk = _tk()
    host.load_vllm_kernels()
    m = BUDGET // R_QSA
    assert host.prefill_select(m) == "vllm", "vLLM is installed but its selects are not registered"
    rows, n_blocks = 200, 3000
    lg = torch.randn(rows, n_blocks, device="cuda")
    pos = torch.randint(4 * m, 4 * n_blocks, (rows,), device="cuda")
    visible = (pos + 1) // R_QSA
    keys = torch.where(torch.arange(n_blocks, device="cuda")[None] < visible[:, None], lg, float("nan"))
    bits = keys.contiguous().view(torch.int32).long()
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    sort_keys = torch.where(keys.isnan(), tk.INT64_MIN, (order << 32) + (4294967295 - torch.arange(n_blocks,
                                                                                                   device="cuda")))
    want = tk.top_ids(sort_keys, m).sort(dim=1).values
    got = tk.vllm_top_ids(lg, pos, R_QSA, m).sort(dim=1).values
    assert torch.equal(got, want)
    L, n = 2300, 300
    q, p, iq, kv, row, ikv = paged_prefill_case(L, n, 16, seed=8)
    tk.LAUNCHED.clear()
    with expect_kernel("qsa_prefill_paged"):
        out = qsa_ops.qsa_prefill_paged(q, p, iq, kv, row, ikv, L, R_QSA, BUDGET, 256 ** -0.5, 128 ** -0.5)
    assert "qsa_score_prefill" in tk.LAUNCHED and "qsa_topk" not in tk.LAUNCHED, sorted(tk.LAUNCHED)
    want = qsa_ref.qsa_prefill_paged(q, p, iq, kv, row, ikv, L, R_QSA, BUDGET, 256 ** -0.5, 128 ** -0.5)
    err = (out.float() - want.float()).norm(dim=(1, 2)) / want.float().norm(dim=(1, 2))
    assert err.max() < 1e-2, (err.argmax().item(), err.max().item())


@pytest.mark.gpu
def test_qsa_decode_paged_in_cuda_graph():
    """Captured once, replayed with other positions and block tables (the FULL decode graph case): equal to eager."""
    q, pos, iq, kv, bt, ikv, ibt = paged_decode_case([9001, 2500, 40], 16, 64, seed=3)
    args = (12_000, R_QSA, BUDGET, 256 ** -0.5, 128 ** -0.5)
    run = lambda: qsa_ops.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, *args)  # noqa: E731
    with expect_kernel("qsa_decode_paged"):
        g, out = capture(run)
    pos.copy_(torch.tensor([8000, 2499, 30], device="cuda"))
    bt.copy_(bt.roll(1, 0))
    ibt.copy_(ibt.roll(1, 0))
    g.replay()
    torch.testing.assert_close(out, run(), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_qsa_paged_ops_read_fp8_caches(dtype):
    """FP8 K/V and index caches (``--kv-cache-dtype fp8``, unit scales): the paged decode and prefill kernels read
    them (widened exactly to bf16) instead of falling back to the torch path, and match the reference on the same
    FP8 caches."""
    cuda = _cuda()
    q, pos, iq, kv, bt, ikv, ibt = paged_decode_case([7, 2052, 9001], 16, 64, seed=11)
    kv, ikv = (page_padded(t.float().clamp(-400, 400).to(dtype)) for t in (kv, ikv))
    assert cuda.paged_supported(q, pos, iq, kv, bt, ikv, ibt, R_QSA, BUDGET)
    args = (9001 // R_QSA + 3, R_QSA, BUDGET, 256 ** -0.5, 128 ** -0.5)
    poison()
    with expect_kernel("qsa_decode_paged"):
        out = qsa_ops.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, *args)
    want = qsa_ref.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, *args)
    assert not torch.isnan(out).any()
    err = (out.float() - want.float()).norm(dim=(1, 2)) / want.float().norm(dim=(1, 2))
    assert err.max() < 1e-2, err
    L = 9001
    q, pos, iq, kv, row, ikv = paged_prefill_case(L, 300, 16, seed=12, dtype=dtype)
    assert cuda.prefill_paged_supported(q, pos, iq, kv, row, ikv, R_QSA, BUDGET)
    poison()
    with expect_kernel("qsa_prefill_paged"):
        out = qsa_ops.qsa_prefill_paged(q, pos, iq, kv, row, ikv, L, R_QSA, BUDGET, 256 ** -0.5, 128 ** -0.5)
    want = qsa_ref.qsa_prefill_paged(q, pos, iq, kv, row, ikv, L, R_QSA, BUDGET, 256 ** -0.5, 128 ** -0.5)
    err = (out.float() - want.float()).norm(dim=(1, 2)) / want.float().norm(dim=(1, 2))
    assert not torch.isnan(out).any() and err.max() < 1e-2, err.max()


# ------------------------------------------------------------------------------------------ paged prefill
@pytest.mark.gpu
@pytest.mark.parametrize("L,n_q,bs,keys_mib", [(50_003, 700, 16, 256), (50_000, 4, 784, 256), (2_600, 2_600, 64, 1),
                                               (9_001, 3_000, 16, 40)])
def test_qsa_prefill_paged_matches_reference(monkeypatch, L, n_q, bs, keys_mib):
    """The paged prefill kernels (tiled scores of a query chunk against the sequence's paged block keys, top-k,
    looping or split attention over paged K/V) against the torch reference, the last n_q queries of one sequence
    at the real widths, on a page-padded cache with one block table for K/V and index rows (vLLM's layout): a
    prefill chunk far past the budget, an MTP verification (4 queries: split kernel), a whole prompt crossing the
    dense regime's end, and query chunks forced small (``PREFILL_KEYS_BYTES``)."""
    tk = _tk()
    monkeypatch.setattr(_launch(), "PREFILL_KEYS_BYTES", keys_mib << 20)
    q, pos, iq, kv, row, ikv = paged_prefill_case(L, n_q, bs, seed=L + n_q)
    assert _cuda().prefill_paged_supported(q, pos, iq, kv, row, ikv, R_QSA, BUDGET)
    scale, iscale = 256 ** -0.5, 128 ** -0.5
    poison()
    tk.LAUNCHED.clear()
    with expect_kernel("qsa_prefill_paged"):
        out = qsa_ops.qsa_prefill_paged(q, pos, iq, kv, row, ikv, L, R_QSA, BUDGET, scale, iscale)
    indexed = L // R_QSA > BUDGET // R_QSA
    chunk = min(n_q, (keys_mib << 20) // (8 * (L // R_QSA))) if indexed else n_q  # queries of the first chunk
    assert ("qsa_attn_loop" in tk.LAUNCHED) == (chunk >= _launch().LOOP_MIN_QUERIES)
    assert ("qsa_score_prefill" in tk.LAUNCHED) == indexed
    want = qsa_ref.qsa_prefill_paged(q, pos, iq, kv, row, ikv, L, R_QSA, BUDGET, scale, iscale)
    assert out.shape == want.shape and out.dtype == want.dtype
    assert not torch.isnan(out).any()
    err = (out.float() - want.float()).norm(dim=(1, 2)) / want.float().norm(dim=(1, 2))
    assert err.max() < 1e-2, (err.argmax().item(), err.max().item())


@pytest.mark.gpu
def test_warm_up_prefill_leaves_nothing_to_compile(monkeypatch):
    """After ``warm_up_prefill`` on a cache layout (a block size no other test uses, so its kernels are new to this
    process), prefills of any length up to its ``max_len`` compile no Triton kernel: a 50k prompt in vLLM-sized
    chunks, ragged chunks and their one-query remainders, an MTP-sized verification, a prompt past the dense regime;
    and each still matches the reference."""
    import triton

    tk = _tk()
    bs, max_len = 48, 131_072
    _, _, _, kv, row, ikv = paged_prefill_case(12_100, 16, bs, seed=5)  # real rows for up to 12,100 tokens
    compiled = []

    def hook(**kw):  # Triton calls it after each compile of a kernel variant new to this process
        compiled.append(kw["fn"].name)

    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", hook)
    cases = qsa_ops.warm_up_prefill(kv, ikv, 24, 4, max_len, R_QSA, BUDGET, 256 ** -0.5, 128 ** -0.5, BF)
    assert cases and compiled, "the warm-up ran no new kernel variant"
    assert {("attn_loop",), ("score_prefill", False), ("topk", "radix")} <= set().union(
        *(host.prefill_variants(t, n, BUDGET // R_QSA, R_QSA, 2) for t, n in cases))
    compiled.clear()
    g = torch.Generator().manual_seed(3)
    for L, n_q in ((50_000, 16_384), (50_000, 3_617), (9_001, 2_689), (2_600, 2_600), (70_001, 300), (12_000, 4),
                   (100_000, 129)):
        q = torch.randn(n_q, 24, 256, generator=g).to(BF).cuda()
        iq = torch.randn(n_q, 4, 128, generator=g).to(BF).cuda()
        pos = torch.arange(L - n_q, L, device="cuda")
        brow = torch.zeros(triton.cdiv(L, bs), dtype=torch.int32, device="cuda")  # past 12,100 tokens: block 0
        brow[: row.shape[0]] = row[: brow.shape[0]]
        out = qsa_ops.qsa_prefill_paged(q, pos, iq, kv, brow, ikv, L, R_QSA, BUDGET, 256 ** -0.5, 128 ** -0.5)
        torch.cuda.synchronize()
        assert not compiled, f"L={L} n_q={n_q} compiled {compiled}"
        if L <= 12_100:  # (the reference on the case's real rows)
            want = qsa_ref.qsa_prefill_paged(q, pos, iq, kv, brow, ikv, L, R_QSA, BUDGET, 256 ** -0.5, 128 ** -0.5)
            err = (out.float() - want.float()).norm(dim=(1, 2)) / want.float().norm(dim=(1, 2))
            assert err.max() < 1e-2, (L, n_q, err.max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("vllm_select", [False, True])
def test_warm_up_decode_leaves_nothing_to_compile(monkeypatch, vllm_select):
    """After ``warm_up_decode`` (block size 40 or 56: layouts no other test compiles for), paged decodes of any row
    count up to its ``max_rows`` (mixed-step decode rows, MTP verifications of batch 32, a 256-row batch) over
    contexts up to its ``max_len`` compile no Triton kernel, with our select and with vLLM's where it is loaded;
    and match the reference on the case's real rows."""
    import triton

    if vllm_select and not host.load_vllm_kernels():
        pytest.skip("vLLM's CUDA build is not installed (its select)")
    monkeypatch.setattr(host, "VLLM_TOPK", vllm_select)
    bs, max_len, max_rows = 40 + 16 * vllm_select, 131_072, 256
    lens = [12_100, 9_001]
    _, _, _, kv, bt, ikv, ibt = paged_decode_case(lens, bs, bs, seed=6, Hq=2)  # (its queries unused)
    compiled = []

    def hook(**kw):
        compiled.append(kw["fn"].name)

    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", hook)
    cases = qsa_ops.warm_up_decode(kv, ikv, 24, 4, max_len, max_rows, R_QSA, BUDGET, 256 ** -0.5, 128 ** -0.5, BF)
    assert cases and compiled, "the warm-up ran no new kernel variant"
    compiled.clear()
    g = torch.Generator().manual_seed(4)
    for B, L in ((1, 50_000), (3, 2_000), (4, 9_001), (12, 12_100), (33, 70_001), (65, 12_100), (128, 50_000),
                 (129, 100_000), (256, 3_000), (200, 20_000)):
        q = torch.randn(B, 24, 256, generator=g).to(BF).cuda()
        iq = torch.randn(B, 4, 128, generator=g).to(BF).cuda()
        pos = torch.full((B,), L - 1, device="cuda")
        tables = []
        for t in (bt, ibt):  # rows of the case's two sequences in turn; past their rows block 0
            row = torch.zeros(B, triton.cdiv(L, bs), dtype=torch.int32, device="cuda")
            n = min(row.shape[1], t.shape[1])
            row[:, :n] = t[torch.arange(B) % len(lens), :n]
            tables.append(row)
        args = (L // R_QSA, R_QSA, BUDGET, 256 ** -0.5, 128 ** -0.5)
        out = qsa_ops.qsa_decode_paged(q, pos, iq, kv, tables[0], ikv, tables[1], *args)
        torch.cuda.synchronize()
        assert not compiled, f"B={B} L={L} compiled {compiled}"
        if L <= 9_001 and not vllm_select:  # (the real rows of both sequences; vLLM's select breaks ties its way)
            want = qsa_ref.qsa_decode_paged(q, pos, iq, kv, tables[0], ikv, tables[1], *args)
            err = (out.float() - want.float()).norm(dim=(1, 2)) / want.float().norm(dim=(1, 2))
            assert err.max() < 1e-2, (B, L, err.max().item())


# ------------------------------------------------------------------------------------------- cache writes
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_write_paged_matches_reference(dtype):
    """The paged K|V write (padding slots store nothing) equals the reference, main cache and index cache shapes."""
    g = gen(11, "cuda")
    for blocks, H, bs, d, N in [(40, 2, 16, 256, 32), (10, 1, 64, 128, 5)]:
        kv = rnd((blocks, H, bs, 2 * d), g, 1.0, dtype)
        kv2 = kv.clone()
        # real slots avoid slot 0: a padding row (slot -1) rewrites slot 0 with its old value (vLLM's null block,
        # never a request's), and two writes to one slot in one indexed assignment land in no defined order
        slots = torch.randperm(blocks * bs - 1, device="cuda", generator=g)[:N] + 1
        slots[::3] = -1
        k = rnd((N, H, 2 * d), g, 1.0, dtype)[..., :d]  # strided rows
        v = rnd((N, H, d), g, 1.0, dtype)
        with expect_kernel("qsa_write_paged"):
            qsa_ops.write_paged(kv, slots, k, v)
        qsa_ref.write_paged(kv2, slots, k, v)
        assert torch.equal(kv, kv2)


def _packed_index_case(g, dev, B=33, di=128, RD=64, bs=64, pages=300, r=4, rr=20, hd=32):
    """A packed QSA cache (``ops.qsa.layout``: page tail of block keys + ring) with random contents, B tokens on a
    shuffled block table (positions at block starts, ends and page edges; a padding row), their raw keys, norm
    weight and RoPE."""
    from qwen4exp.ops.qsa import layout
    kv = layout.paged_cache(pages, 1, bs, hd, di, r, rr, device=dev, pad=24)
    kv.as_strided((kv.untyped_storage().nbytes() // 2,), (1,), 0).copy_(
        torch.randn(kv.untyped_storage().nbytes() // 2, generator=g, device=dev).to(BF) * 2)
    bt = (torch.randperm(pages - 1, generator=g, device=dev)[: B * 8] + 1).view(B, 8).int()
    pos = torch.randint(0, 8 * bs, (B,), generator=g, device=dev)
    pos[:8] = torch.tensor([0, 1, 2, 3, 4, 7, 11, 511], device=dev)
    slots = bt.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).long() * bs + pos % bs
    slots[-1] = -1
    raw = rnd((B, di + 16), g, 2.0)[:, :di]
    w = rnd((di,), g, 0.2)
    ang = torch.randn(B, RD // 2, generator=g, device=dev) * 30
    cos, sin = torch.cat([ang, ang], -1).cos().to(BF), torch.cat([ang, ang], -1).sin().to(BF)
    return kv, slots, pos, raw, w, cos, sin


@pytest.mark.gpu
def test_index_update_decode_matches_reference():
    """Decode-time index update (raw key into the page's ring; the completed block's normed, rotated key into its
    key row, nothing else), real widths (d_i 128, RoPE on 64 dims, r 4), on the plugin's packed page layout,
    shuffled block table, a padding row: the whole cache equal to the reference's (bf16 rounding points reproduced;
    the fp32 mean/norm sums may differ in order, so allow a rare one-unit difference)."""
    from op_helpers import bf16_close

    from qwen4exp.ops.qsa import layout
    g = gen(21, "cuda")
    kv, slots, pos, raw, w, cos, sin = _packed_index_case(g, "cuda")
    kv2 = layout.paged_cache(kv.shape[0], 1, kv.shape[2], kv.shape[3] // 2, 128, 4, 20, device="cuda", pad=24)
    kv2.untyped_storage().copy_(kv.untyped_storage())
    a, b = layout.index_views(kv, 128, 4, 20), layout.index_views(kv2, 128, 4, 20)
    valid = slots >= 0
    assert _cuda().index_update_supported(a.index_kv, a.ring, slots, pos, valid, raw, w, cos, sin, 4)
    poison()
    with expect_kernel("qsa_index_update_decode"):
        qsa_ops.index_update_decode(a.index_kv, a.ring, slots, pos, valid, raw, w, 1e-6, cos, sin, 4)
    qsa_ref.index_update_decode(b.index_kv, b.ring, slots, pos, valid, raw, w, 1e-6, cos, sin, 4)
    n = kv.untyped_storage().nbytes() // 2
    flat = lambda t: t.as_strided((n,), (1,), 0)  # noqa: E731
    bf16_close(flat(kv), flat(kv2), min_equal=0.999)


@pytest.mark.gpu
def test_decode_cache_writes_is_one_launch():
    """A decode step's K|V rows and its index update in one launch (``decode_cache_writes``; the step of
    ``ops.qsa.step.decode_writes`` at one query a request): the same cache as ``write_paged`` then the index update
    (the K|V rows bit for bit; the block keys up to the fp32 sums' order), at the real widths (2 KV heads of 256,
    d_i 128), a padding row included."""
    from op_helpers import bf16_close

    from qwen4exp.ops.qsa import layout
    g = gen(23, "cuda")
    kv, slots, pos, raw, w, cos, sin = _packed_index_case(g, "cuda", hd=256)
    kv = layout.paged_cache(kv.shape[0], 2, kv.shape[2], 256, 128, 4, 20, device="cuda", pad=24)
    n = kv.untyped_storage().nbytes() // 2
    flat = lambda t: t.as_strided((n,), (1,), 0)  # noqa: E731
    flat(kv).copy_(torch.randn(n, generator=g, device="cuda").to(BF) * 2)
    kv2 = layout.paged_cache(kv.shape[0], 2, kv.shape[2], 256, 128, 4, 20, device="cuda", pad=24)
    kv2.untyped_storage().copy_(kv.untyped_storage())
    a, b = layout.index_views(kv, 128, 4, 20), layout.index_views(kv2, 128, 4, 20)
    k = rnd((slots.shape[0], 2, 512), g, 1.0)[..., :256]
    v = rnd((slots.shape[0], 2, 256), g, 1.0)
    valid = slots >= 0
    poison()
    with expect_kernel("qsa_decode_writes"):
        qsa_ops.decode_cache_writes(kv, a.index_kv, a.ring, slots, pos, valid, k, v, raw, w, 1e-6, cos, sin, 4)
    qsa_ref.decode_cache_writes(kv2, b.index_kv, b.ring, slots, pos, valid, k, v, raw, w, 1e-6, cos, sin, 4)
    assert torch.equal(kv, kv2)
    bf16_close(flat(kv), flat(kv2), min_equal=0.999)


@pytest.mark.gpu
def test_decode_cache_writes_at_mtp_verification_is_one_launch():
    """An MTP verification's cache writes (4 consecutive tokens a request) in one launch: a token completing a
    block reads this step's earlier tokens' keys from the step's rows (programs run in parallel here, so none can
    rely on another's ring write), the others from the ring. Equal to the reference's ring-first composition, at
    the real widths, over 96 requests whose blocks complete at every query index, a padding request included."""
    from op_helpers import bf16_close

    from qwen4exp.ops.qsa import layout
    g = gen(29, "cuda")
    nreq, nq, bs, r, rr, di, RD = 96, 4, 64, 4, 20, 128, 64
    pages = 8 * nreq + 1
    kv = layout.paged_cache(pages, 2, bs, 256, di, r, rr, device="cuda", pad=24)
    n = kv.untyped_storage().nbytes() // 2
    flat = lambda t: t.as_strided((n,), (1,), 0)  # noqa: E731
    flat(kv).copy_(torch.randn(n, generator=g, device="cuda").to(BF) * 2)
    kv2 = layout.paged_cache(pages, 2, bs, 256, di, r, rr, device="cuda", pad=24)
    kv2.untyped_storage().copy_(kv.untyped_storage())
    a, b = layout.index_views(kv, di, r, rr), layout.index_views(kv2, di, r, rr)
    bt = (torch.randperm(pages - 1, generator=g, device="cuda")[: nreq * 8] + 1).view(nreq, 8).long()
    first = torch.randint(0, 7 * bs, (nreq,), generator=g, device="cuda")
    first[:4] = torch.tensor([0, 1, 2, 3], device="cuda") + 60  # the block completes at query 3, 2, 1, 0
    pos = (first.unsqueeze(1) + torch.arange(nq, device="cuda")).reshape(-1)
    req = torch.arange(nreq * nq, device="cuda") // nq
    slots = bt[req].gather(1, (pos // bs).unsqueeze(1)).squeeze(1) * bs + pos % bs
    slots[-nq:] = -1  # a request padding the batch
    raw = rnd((nreq * nq, di), g, 2.0)
    w = rnd((di,), g, 0.2)
    ang = torch.randn(nreq * nq, RD // 2, generator=g, device="cuda") * 30
    cos, sin = torch.cat([ang, ang], -1).cos().to(BF), torch.cat([ang, ang], -1).sin().to(BF)
    k = rnd((nreq * nq, 2, 512), g, 1.0)[..., :256]
    v = rnd((nreq * nq, 2, 256), g, 1.0)
    valid = slots >= 0
    poison()
    with expect_kernel("qsa_decode_writes"):
        qsa_ops.decode_cache_writes(kv, a.index_kv, a.ring, slots, pos, valid, k, v, raw, w, 1e-6, cos, sin, r, nq)
    qsa_ref.decode_cache_writes(kv2, b.index_kv, b.ring, slots, pos, valid, k, v, raw, w, 1e-6, cos, sin, r, nq)
    assert torch.equal(kv, kv2)
    bf16_close(flat(kv), flat(kv2), min_equal=0.999)


def test_index_update_decode_builds_every_block_key_through_the_ring():
    """The reference index update, stepped over whole sequences as a server steps them, against block keys
    computed from each sequence's raw keys at once (``block_mean`` -> norm -> RoPE at the block start, what the
    HF model computes): one token a step, and MTP-like steps of 4 queries whose rejected drafts write garbage
    that the next step rewrites. Several requests share the cache; blocks wrap the ring many times and cross
    pages (bs 8, r 4)."""
    from qwen4exp.ops.norm import grouped_rms_norm
    from qwen4exp.ops.qsa import layout
    from qwen4exp.ops.rope import apply_rope
    g = torch.Generator().manual_seed(5)
    di, RD, r, bs, L, nreq = 16, 8, 4, 8, 61, 3
    rr = layout.ring_rows(r, 8)
    pages_per = -(-L // bs) + 1
    kv = layout.paged_cache(nreq * pages_per + 1, 1, bs, 8, di, r, rr)
    v = layout.index_views(kv, di, r, rr)
    bt = torch.randperm(nreq * pages_per, generator=g).view(nreq, pages_per) + 1
    raws = (torch.randn(nreq, L, di, generator=g)).to(BF)
    w = (torch.randn(di, generator=g) * 0.2).to(BF)
    inv = 1.0 / (10000 ** (torch.arange(0, RD, 2).float() / RD))

    def rope(p):
        ang = p.float().unsqueeze(-1) * inv
        return torch.cat([ang, ang], -1).cos().to(BF), torch.cat([ang, ang], -1).sin().to(BF)

    def step(req, positions, values):
        positions = torch.tensor(positions)
        slots = bt[req].gather(0, positions // bs) * bs + positions % bs
        cos, sin = rope((positions - (r - 1)).clamp(min=0))
        h = di // 2
        rs = (slots // bs) * rr + positions % rr  # every raw key first (a 4-query step reads its own rows)
        qsa_ref.write_paged(v.ring, rs, values[:, None, :h], values[:, None, h:])
        qsa_ref.index_update_decode(v.index_kv, v.ring, slots, positions, torch.ones(len(positions), dtype=torch.bool),
                                    values, w, 1e-6, cos, sin, r)

    done = [0] * nreq
    rounds = 0
    while min(done) < L:
        rounds += 1
        for req in range(nreq):
            p0 = done[req]
            if p0 >= L:
                continue
            if req == 1 and p0 + 4 <= L:  # MTP: 4 queries, 1-3 accepted; rejected drafts write garbage keys
                acc = 1 + (rounds % 3)
                vals = raws[req, p0:p0 + 4].clone()
                vals[acc:] = (torch.randn(4 - acc, di, generator=g) * 9).to(BF)
                step(req, list(range(p0, p0 + 4)), vals)
                done[req] = p0 + acc
            else:
                step(req, [p0], raws[req, p0:p0 + 1])
                done[req] = p0 + 1
    nb = L // r
    for req in range(nreq):
        ends = torch.arange(nb) * r + r - 1
        got = qsa_ref.paged_rows(v.index_kv, bt[req:req + 1], ends.unsqueeze(0))[0, :, 0, di:]
        mean = qsa_ref.block_mean(raws[req, : nb * r], r)
        cos, sin = rope(torch.arange(nb) * r)
        want = apply_rope(grouped_rms_norm(mean, w, di, 1e-6).unsqueeze(1), cos, sin).squeeze(1).to(BF)
        assert torch.equal(got, want), (req, (got.float() - want.float()).abs().max())


# =====================================================================================================================
# the Triton checks without a GPU (``interpreter_qsa_ple.py``): under the CPU interpreter, then compiled for sm_90
# =====================================================================================================================
QSA_CHECKS = ("qsa_topk", "qsa_decode", "qsa_decode_gated", "qsa_score_logits", "qsa_score_prefill_logits",
              "qsa_select_attend_halves", "qsa_unpaged", "qsa_prefill", "qsa_prefill_warmup", "qsa_decode_warmup",
              "qsa_fp8_caches", "qsa_write_paged", "qsa_index_update", "qsa_real_widths", "qsa_registration")
QSA_KERNELS = ("_qsa_score_kernel", "_qsa_score_paged_kernel", "_qsa_score_prefill_kernel", "_qsa_topk_kernel",
               "_qsa_topk_small_kernel", "_qsa_attn_kernel", "_qsa_attn_loop_kernel", "_qsa_merge_kernel",
               "_write_paged_kernel", "_index_update_kernel")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.triton_check(n)) for n in QSA_CHECKS])
def test_interpreter_check(triton_checks, name):
    triton_checks.passed(name)


@pytest.mark.triton_check(*QSA_CHECKS)  # (the launches these checks record are what the compile step builds)
@pytest.mark.parametrize("kernel", QSA_KERNELS)
def test_compiles_for_hopper(triton_checks, kernel):
    """Every recorded launch of the kernel compiles to an sm_90 cubin within Hopper's shared memory (the decode
    attention at the real widths without register spills)."""
    triton_checks.compiled(kernel)


@pytest.mark.triton_check(*QSA_CHECKS)
def test_row_views_not_specialised_on_alignment(triton_checks):
    """Positions and block-table rows arrive as views whose start may or may not be 16-byte aligned: no QSA kernel
    compiles a variant per alignment of them (a JIT stall mid-serving)."""
    triton_checks.compile_check("qsa_row_views")
