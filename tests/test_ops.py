"""Op references (``qwen4exp.ops.*.reference``) against plain per-token Python loops written from the equations of
the architecture digest (sections 3 and 7), on packed variable-length batches, plus upstream transformers' helpers
as extra oracles where their signatures allow.

The loops below deliberately do not call the code under test: each one is the textbook form of its equation.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from qwen4exp.ops.causal_conv1d import reference as conv_ref
from qwen4exp.ops.gated_delta_rule import reference as gdr_ref
from qwen4exp.ops.hyper_connection import reference as hc_ref
from qwen4exp.ops.ple import reference as ple_ref
from qwen4exp.ops.qsa import reference as qsa_ref

UM = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

F32 = dict(rtol=1e-5, atol=1e-6)


def cu_of(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.long)


def split_packed(x, lens):
    """Packed [T, ...] -> list of per-sequence tensors."""
    out, s = [], 0
    for n in lens:
        out.append(x[s: s + n])
        s += n
    return out


# =====================================================================================================================
# causal_conv1d
# =====================================================================================================================
def loop_causal_conv1d(x, weight, lens, state, dilation, activation):
    """y[t, c] = act(sum_j w[c, j] * h[t - dilation * (K - 1 - j), c]) over history h = state ++ inputs.
    Returns (packed outputs, final state [N, C, S] = the last S entries of each history)."""
    C, K = weight.shape
    S = (K - 1) * dilation
    outs, finals = [], []
    for n, xs in enumerate(split_packed(x, lens)):
        hist = [state[n, :, i] if state is not None else torch.zeros(C) for i in range(S)]
        hist += [xs[t] for t in range(xs.shape[0])]
        for t in range(xs.shape[0]):
            now = S + t
            acc = torch.zeros(C)
            for j in range(K):
                acc = acc + weight[:, j] * hist[now - dilation * (K - 1 - j)]
            outs.append(F.silu(acc) if activation == "silu" else acc)
        finals.append(torch.stack(hist[len(hist) - S:], -1) if S else torch.zeros(C, 0))
    return torch.stack(outs), torch.stack(finals)


CONV_LENS = [[7], [1, 9, 4], [12, 1, 1, 5, 2]]


@pytest.mark.parametrize("lens", CONV_LENS)
@pytest.mark.parametrize("dilation", [1, 3])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_matches_loop(lens, dilation, with_state, activation):
    torch.manual_seed(0)
    C, K = 6, 4
    S = conv_ref.state_len(K, dilation)
    x = torch.randn(sum(lens), C)
    w = torch.randn(C, K)
    st = torch.randn(len(lens), C, S) if with_state else None
    y, fin = conv_ref.causal_conv1d(x, w, cu_of(lens), st, dilation, activation)
    y_ref, fin_ref = loop_causal_conv1d(x, w, lens, st, dilation, activation)
    assert y.shape == (sum(lens), C) and fin.shape == (len(lens), C, S)
    torch.testing.assert_close(y, y_ref, **F32)
    torch.testing.assert_close(fin, fin_ref, rtol=0, atol=0)


@pytest.mark.parametrize("dilation", [1, 3])
def test_causal_conv1d_final_state_is_history_tail(dilation):
    """The state is exactly the last (K-1)*dilation inputs of state ++ new tokens, oldest first (also when a
    sequence brings fewer tokens than the state holds)."""
    torch.manual_seed(1)
    C, K = 3, 4
    S = (K - 1) * dilation
    lens = [1, S - 1, S, S + 5]
    x = torch.randn(sum(lens), C)
    st = torch.randn(len(lens), C, S)
    _, fin = conv_ref.causal_conv1d(x, torch.randn(C, K), cu_of(lens), st, dilation)
    for n, xs in enumerate(split_packed(x, lens)):
        hist = torch.cat([st[n], xs.T], 1)  # [C, S + len]
        assert torch.equal(fin[n], hist[:, -S:])


@pytest.mark.parametrize("dilation", [1, 3])
def test_causal_conv1d_chunked_equals_one_shot(dilation):
    torch.manual_seed(2)
    C, K = 5, 4
    lens = [13, 1, 8]
    cut = [6, 0, 1]  # first-call lengths (a sequence may bring no tokens in a call)
    x = torch.randn(sum(lens), C)
    w = torch.randn(C, K)
    st0 = torch.randn(len(lens), C, (K - 1) * dilation)
    y_full, fin_full = conv_ref.causal_conv1d(x, w, cu_of(lens), st0, dilation)
    seqs = split_packed(x, lens)
    a = torch.cat([s[:c] for s, c in zip(seqs, cut)])
    b = torch.cat([s[c:] for s, c in zip(seqs, cut)])
    lens_b = [n - c for n, c in zip(lens, cut)]
    y_a, st1 = conv_ref.causal_conv1d(a, w, cu_of(cut), st0, dilation)
    y_b, fin = conv_ref.causal_conv1d(b, w, cu_of(lens_b), st1, dilation)
    y_two = torch.cat([torch.cat([ya, yb]) for ya, yb in zip(split_packed(y_a, cut), split_packed(y_b, lens_b))])
    torch.testing.assert_close(y_two, y_full, **F32)
    torch.testing.assert_close(fin, fin_full, rtol=0, atol=0)


def test_causal_conv1d_matches_upstream_update():
    """Upstream's ``causal_conv1d_update`` (state of K-1 columns, dilation 1) on one sequence."""
    torch.manual_seed(3)
    C, K, L = 8, 4, 11
    x = torch.randn(L, C)
    w = torch.randn(C, K)
    st = torch.randn(1, C, K - 1)
    up_state = st.clone()
    y_up = UM.causal_conv1d_update(x.T.unsqueeze(0).contiguous(), up_state, w, None, "silu")[0].T
    y, fin = conv_ref.causal_conv1d(x, w, cu_of([L]), st, 1, "silu")
    torch.testing.assert_close(y, y_up, **F32)
    torch.testing.assert_close(fin, up_state, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dilation", [1, 3])
def test_causal_conv1d_update_equals_one_token_sequences(dtype, dilation):
    """The decode form (one token per sequence, no cu_seqlens) = ``causal_conv1d`` on N one-token sequences,
    several steps in a row (state carried)."""
    torch.manual_seed(5)
    N, C, K = 5, 12, 4
    w = torch.randn(C, K).to(dtype)
    st = torch.randn(N, C, conv_ref.state_len(K, dilation)).to(dtype)
    st_ref = st.clone()
    for _ in range(3):
        x = torch.randn(N, C).to(dtype)
        y, st = conv_ref.causal_conv1d_update(x, w, st, dilation, "silu")
        y_ref, st_ref = conv_ref.causal_conv1d(x, w, cu_of([1] * N), st_ref, dilation, "silu")
        assert y.dtype == x.dtype and st.shape == st_ref.shape
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
        torch.testing.assert_close(st, st_ref.to(st.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1, 1, 1], [3, 1, 5]])
def test_causal_conv1d_short_path_equals_conv_path(monkeypatch, dtype, lens):
    """Decode-sized inputs sum the taps directly instead of calling conv1d: same values (fp32 accumulation, one
    rounding), same state; also checked against the loop."""
    torch.manual_seed(5)
    C, K = 12, 4
    x = torch.randn(sum(lens), C).to(dtype)
    w = torch.randn(C, K).to(dtype)
    st = torch.randn(len(lens), C, 9).to(dtype)
    monkeypatch.setattr(conv_ref, "_SHORT", 1 << 30)
    y_short, fin_short = conv_ref.causal_conv1d(x, w, cu_of(lens), st, 3)
    monkeypatch.setattr(conv_ref, "_SHORT", 0)
    y_conv, fin_conv = conv_ref.causal_conv1d(x, w, cu_of(lens), st, 3)
    assert y_short.dtype == dtype and torch.equal(fin_short, fin_conv)
    tol = F32 if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)  # at most one bf16 rounding apart
    torch.testing.assert_close(y_short, y_conv, **tol)
    y_ref, _ = loop_causal_conv1d(x.float(), w.float(), lens, st.float(), 3, "silu")
    torch.testing.assert_close(y_short.float(), y_ref, **(F32 if dtype == torch.float32 else dict(rtol=2e-2,
                                                                                                  atol=2e-2)))


def test_causal_conv1d_bf16_sanity():
    torch.manual_seed(4)
    lens = [9, 1, 4]
    C, K = 16, 4
    x = torch.randn(sum(lens), C).bfloat16()
    w = torch.randn(C, K).bfloat16()
    st = torch.randn(len(lens), C, 9).bfloat16()
    y, fin = conv_ref.causal_conv1d(x, w, cu_of(lens), st, 3)
    y_ref, fin_ref = loop_causal_conv1d(x.float(), w.float(), lens, st.float(), 3, "silu")
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(fin.float(), fin_ref)  # the state is copied, not computed


# =====================================================================================================================
# gated delta rule
# =====================================================================================================================
def loop_gated_delta_rule(q, k, v, g, beta, lens, state, scale=None, l2=True):
    """Per sequence, per value head h (key head h // (Hv/Hk)), per token:
    S <- e^g S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q   (q, k L2-normalised, q * scale)."""
    Hk, dk = q.shape[1], q.shape[2]
    Hv, dv = v.shape[1], v.shape[2]
    scale = dk ** -0.5 if scale is None else scale
    outs, finals = [], []
    for n, (qs, ks, vs, gs, bs) in enumerate(zip(*(split_packed(t.float(), lens) for t in (q, k, v, g, beta)))):
        o_seq = torch.zeros(qs.shape[0], Hv, dv)
        S_all = []
        for h in range(Hv):
            kh = h // (Hv // Hk)
            S = state[n, h].float().clone() if state is not None else torch.zeros(dk, dv)
            for t in range(qs.shape[0]):
                qt, kt = qs[t, kh], ks[t, kh]
                if l2:
                    qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                    kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                qt = qt * scale
                S = math.exp(float(gs[t, h])) * S
                delta = bs[t, h] * (vs[t, h] - S.T @ kt)
                S = S + torch.outer(kt, delta)
                o_seq[t, h] = S.T @ qt
            S_all.append(S)
        outs.append(o_seq)
        finals.append(torch.stack(S_all))
    return torch.cat(outs), torch.stack(finals)


def gdr_inputs(lens, Hk, Hv, dk, dv, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, Hk, dk, generator=gen)
    k = torch.randn(T, Hk, dk, generator=gen)
    v = torch.randn(T, Hv, dv, generator=gen)
    g = -F.softplus(torch.randn(T, Hv, generator=gen)) * 0.5  # log decay <= 0
    beta = torch.sigmoid(torch.randn(T, Hv, generator=gen))
    st = torch.randn(len(lens), Hv, dk, dv, generator=gen) * 0.5
    return [t.to(dtype) for t in (q, k, v, g, beta)] + [st]


GDR_CASES = [  # lens, Hk, Hv
    ([5], 2, 2),
    ([1, 23, 1, 9], 2, 6),  # GQA n_v = 3 n_k, length-1 sequences, several chunks of 8
    ([40, 17], 1, 3),
    ([1, 1, 1], 2, 6),  # decode: one token per sequence
    ([2, 0], 2, 2),  # as many tokens as sequences, but not one each (and an empty sequence)
]


@pytest.mark.parametrize("lens,Hk,Hv", GDR_CASES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_gated_delta_rule_matches_loop(lens, Hk, Hv, with_state, form):
    dk, dv = 8, 6
    q, k, v, g, beta, st = gdr_inputs(lens, Hk, Hv, dk, dv, seed=len(lens) + Hv)
    st = st if with_state else None
    if form == "chunk":
        o, fin = gdr_ref.chunk_gated_delta_rule(q, k, v, g, beta, cu_of(lens), st, chunk_size=8)
    else:
        o, fin = gdr_ref.recurrent_gated_delta_rule(q, k, v, g, beta, cu_of(lens), st)
    o_ref, fin_ref = loop_gated_delta_rule(q, k, v, g, beta, lens, st)
    assert o.shape == v.shape and fin.shape == (len(lens), Hv, dk, dv) and fin.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin, fin_ref, rtol=1e-5, atol=1e-5)


def test_gated_delta_rule_default_chunk_and_options():
    """The default chunk size (64) across a chunk boundary, a custom scale, and no in-kernel L2 norm."""
    lens = [70, 3]
    q, k, v, g, beta, st = gdr_inputs(lens, 2, 4, 8, 8, seed=11)
    q, k = gdr_ref.l2norm(q), gdr_ref.l2norm(k)  # pre-normalised, as a caller that normalises itself would pass
    o, fin = gdr_ref.chunk_gated_delta_rule(q, k, v, g, beta, cu_of(lens), st, scale=0.3, use_qk_l2norm=False)
    o_ref, fin_ref = loop_gated_delta_rule(q, k, v, g, beta, lens, st, scale=0.3, l2=False)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin, fin_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_gated_delta_rule_split_continuity(form):
    """Processing a sequence in two calls, carrying the state, equals one call."""
    fn = (lambda *a: gdr_ref.chunk_gated_delta_rule(*a, chunk_size=8)) if form == "chunk" \
        else gdr_ref.recurrent_gated_delta_rule
    lens, cut = [21, 5, 1], [13, 1, 0]
    q, k, v, g, beta, st = gdr_inputs(lens, 2, 6, 8, 4, seed=5)
    o_full, fin_full = fn(q, k, v, g, beta, cu_of(lens), st)
    lens_b = [n - c for n, c in zip(lens, cut)]
    parts = [split_packed(t, lens) for t in (q, k, v, g, beta)]
    first = [torch.cat([s[:c] for s, c in zip(p, cut)]) for p in parts]
    second = [torch.cat([s[c:] for s, c in zip(p, cut)]) for p in parts]
    o_a, st1 = fn(*first, cu_of(cut), st)
    o_b, fin = fn(*second, cu_of(lens_b), st1)
    o_two = torch.cat([torch.cat([a, b]) for a, b in zip(split_packed(o_a, cut), split_packed(o_b, lens_b))])
    torch.testing.assert_close(o_two, o_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin, fin_full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_state", [False, True])
def test_gated_delta_rule_matches_upstream(with_state):
    """Upstream's torch chunk / recurrent forms on an equal-length batch (they take one key head per value head, so
    the keys are expanded with consecutive grouping first, as upstream's layer does)."""
    B, L, Hk, Hv, dk, dv = 2, 19, 2, 6, 8, 8
    q, k, v, g, beta, st = gdr_inputs([L] * B, Hk, Hv, dk, dv, seed=7)
    st = st if with_state else None
    o, fin = gdr_ref.chunk_gated_delta_rule(q, k, v, g, beta, cu_of([L] * B), st, chunk_size=8)

    def batch(t):
        return t.view(B, L, *t.shape[1:])

    qe, ke = (batch(t).repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    for up in (lambda *a, **kw: UM.torch_chunk_gated_delta_rule(*a, chunk_size=8, **kw),
               UM.torch_recurrent_gated_delta_rule):
        o_up, fin_up = up(qe, ke, batch(v), batch(g), batch(beta), initial_state=st, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o, o_up.reshape(B * L, Hv, dv), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fin, fin_up, rtol=1e-5, atol=1e-5)


def test_gated_delta_rule_bf16_sanity():
    lens = [12, 1, 30]
    q, k, v, g, beta, st = gdr_inputs(lens, 2, 6, 16, 16, seed=9, dtype=torch.bfloat16)
    o_ref, fin_ref = loop_gated_delta_rule(q, k, v, g, beta, lens, st)  # fp32 math on the same bf16 inputs
    for fn in (gdr_ref.chunk_gated_delta_rule, gdr_ref.recurrent_gated_delta_rule):
        o, fin = fn(q, k, v, g, beta, cu_of(lens), st)
        assert o.dtype == torch.bfloat16 and fin.dtype == torch.float32
        torch.testing.assert_close(o.float(), o_ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(fin, fin_ref, rtol=1e-4, atol=1e-4)  # the state stays fp32


# =====================================================================================================================
# QSA
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


def qsa_inputs(L, Hq=4, Hkv=2, d=8, hi=3, di=6, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(L, Hq, d, generator=gen)
    k = torch.randn(L, Hkv, d, generator=gen)
    v = torch.randn(L, Hkv, d, generator=gen)
    iq = torch.randn(L, hi, di, generator=gen)
    bk = torch.randn(L, di, generator=gen)  # block keys: one per possible block (only the first n(p) are read)
    return [t.to(dtype) for t in (q, k, v, iq, bk)]


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


def paged_qsa_case(seqs, lens, r, bs, ibs, seed=0, shared_table=False):
    """Page per-sequence (k, v, block keys) into the runtime layout (``qsa_ref.paged_rows``): [blocks, Hkv, bs,
    2d] K|V and a one-head index cache whose row j*r + r - 1 holds block j's key in its V half; physical blocks
    shuffled, every unused row garbage (1e3-scale noise; NaN in the index cache's K half, never read here).
    -> (kv, block_table, index_kv, index_block_table), block tables padded to the longest sequence (+1 column).
    ``shared_table``: both caches paged by one table (vLLM's one cache layer; needs ibs == bs)."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d, di = seqs[0][1].shape[1], seqs[0][1].shape[2], seqs[0][4].shape[1]
    dt = seqs[0][1].dtype
    nbt, nbti = max(lens) // bs + 2, max(lens) // ibs + 2
    B = len(lens)
    kv = (torch.randn(B * nbt + 1, hkv, bs, 2 * d, generator=gen) * 1e3).to(dt)
    ikv = (torch.randn(B * nbti + 1, 1, ibs, 2 * di, generator=gen) * 1e3).to(dt)
    ikv[..., :di] = float("nan")
    perm, iperm = torch.randperm(B * nbt, generator=gen) + 1, torch.randperm(B * nbti, generator=gen) + 1
    if shared_table:
        assert ibs == bs
        iperm = perm
    bt, ibt = perm.view(B, nbt).int(), iperm.view(B, nbti).int()
    for b, (L, (q, k, v, iq, bk)) in enumerate(zip(lens, seqs)):
        p = torch.arange(L)
        kv[bt[b, p // bs].long(), :, p % bs] = torch.cat([k, v], -1)
        ends = r * torch.arange(L // r) + r - 1
        ikv[ibt[b, ends // ibs].long(), 0, ends % ibs, di:] = bk[: L // r]
    return kv, bt, ikv, ibt


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
# hyper-connection
# =====================================================================================================================
def loop_hc_mix(H, w_norm, W_down, W_up, W_inj, n, eps):
    """Per token: Hn_s = H_s / rms(H_s) * (1 + w_s); a = silu(W_down Hn / n); gamma = sigmoid(W_up a);
    x = mean_s gamma_s * Hn_s; c = 2 sigmoid(W_inj Hn / n)."""
    D = H.shape[-1] // n
    flat = H.reshape(-1, n * D)
    xs, cs = [], []
    for tok in flat:
        parts = []
        for s in range(n):
            h = tok[s * D:(s + 1) * D]
            parts.append(h / torch.sqrt((h * h).mean() + eps) * (1 + w_norm[s * D:(s + 1) * D]))
        Hn = torch.cat(parts)
        a = F.silu((W_down @ Hn) / n)
        gamma = torch.sigmoid(W_up @ a)
        x = sum(gamma[s * D:(s + 1) * D] * Hn[s * D:(s + 1) * D] for s in range(n)) / n
        xs.append(x)
        if W_inj is not None:
            cs.append(2 * torch.sigmoid((W_inj @ Hn) / n))
    x = torch.stack(xs).view(*H.shape[:-1], D)
    c = torch.stack(cs).view(*H.shape[:-1], n) if W_inj is not None else None
    return x, c


def hc_weights(n, D, r_hc, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n * D, generator=gen) * 0.2
    down = torch.randn(r_hc, n * D, generator=gen) / math.sqrt(n * D)
    up = torch.randn(n * D, r_hc, generator=gen) / math.sqrt(r_hc)
    inj = torch.randn(n, n * D, generator=gen) / math.sqrt(n * D)
    return [t.to(dtype) for t in (w, down, up, inj)]


@pytest.mark.parametrize("shape", [(7,), (2, 5), (1,)])
@pytest.mark.parametrize("n,D", [(4, 16), (2, 8)])
@pytest.mark.parametrize("final", [False, True])
def test_hc_mix_matches_loop(shape, n, D, final):
    w, down, up, inj = hc_weights(n, D, 6, seed=n * D)
    H = torch.randn(*shape, n * D) * 3
    x, c = hc_ref.hc_mix(H, w, down, up, None if final else inj, n, 1e-6)
    x_ref, c_ref = loop_hc_mix(H, w, down, up, None if final else inj, n, 1e-6)
    assert x.shape == (*shape, D)
    torch.testing.assert_close(x, x_ref, **F32)
    if final:
        assert c is None
    else:
        assert c.shape == (*shape, n)
        assert bool(((c > 0) & (c < 2)).all())
        torch.testing.assert_close(c, c_ref, **F32)


def test_hc_mix_with_linear_modules_equals_weights():
    n, D, r_hc = 4, 16, 8
    w, down, up, inj = hc_weights(n, D, r_hc, seed=3)
    mods = []
    for W in (down, up, inj):
        lin = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(W)
        mods.append(lin)
    H = torch.randn(9, n * D)
    with torch.no_grad():
        x_m, c_m = hc_ref.hc_mix(H, w, *mods, n, 1e-6)
    x_w, c_w = hc_ref.hc_mix(H, w, down, up, inj, n, 1e-6)
    assert torch.equal(x_m, x_w) and torch.equal(c_m, c_w)


def test_hc_inject_matches_loop():
    n, D = 4, 8
    H, c, y = torch.randn(2, 3, n * D), torch.rand(2, 3, n) * 2, torch.randn(2, 3, D)
    out = hc_ref.hc_inject(H, c, y)
    ref = H.clone()
    for b in range(2):
        for t in range(3):
            for s in range(n):
                ref[b, t, s * D:(s + 1) * D] += c[b, t, s] * y[b, t]
    torch.testing.assert_close(out, ref, **F32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_inject_norm_and_handed_in_norm_equal_the_separate_steps(dtype):
    """``hc_inject_norm`` = write-back then the next mixer's norm; ``hc_mix(..., Hn)`` with that norm = ``hc_mix``
    normalising itself (bit-equal: the same ops)."""
    n, D, R = 4, 16, 6
    g = torch.Generator().manual_seed(11)
    H, c, y = (torch.randn(5, n * D, generator=g).to(dtype), (torch.rand(5, n, generator=g) * 2).to(dtype),
               torch.randn(5, D, generator=g).to(dtype))
    w, down, up, inj = ((torch.randn(*s, generator=g) * 0.3).to(dtype) for s in ((n * D,), (R, n * D), (n * D, R),
                                                                                 (n, n * D)))
    Ho, Hn = hc_ref.hc_inject_norm(H, c, y, w, n, 1e-6)
    assert torch.equal(Ho, hc_ref.hc_inject(H, c, y))
    assert torch.equal(Hn, hc_ref.grouped_rms_norm(Ho, w, D, 1e-6))
    for a, b in zip(hc_ref.hc_mix(Ho, w, down, up, inj, n, 1e-6, Hn), hc_ref.hc_mix(Ho, w, down, up, inj, n, 1e-6)):
        assert torch.equal(a, b)


def test_decoder_layer_hands_the_next_norm_on():
    """``DecoderLayer.forward(..., then=)``: the same streams as without, plus their norm for ``then``; the next
    mixer is the following layer's first one unless that layer adds PLE first, and the final mixer at the end."""
    from qwen4exp.layers.hyper_connection import HyperConnection
    from qwen4exp.modeling import DecoderLayer, next_mixer
    from qwen4exp.presets import tiny_text
    cfg = tiny_text(num_hidden_layers=3, hidden_size=32, ple_layer_ids=(2,), full_attention_every=99)
    torch.manual_seed(0)
    layers = [DecoderLayer(cfg, i, with_ple=True) for i in range(3)]
    final = HyperConnection(cfg, inject=False)
    for m in [*layers, final]:
        for p in m.parameters():
            p.data.normal_(0, 0.1)
    assert next_mixer(layers, 0, final) is None  # layer 1 (one-indexed 2) adds PLE first
    assert next_mixer(layers, 1, final) is layers[2].attn_hyper_connection
    assert next_mixer(layers, 2, final) is final and next_mixer(layers, 2, None) is None
    H = torch.randn(3, 4 * 32)
    mix = torch.tanh
    plain, none = layers[2](H, mix)
    assert none is None
    H2, Hn = layers[2](H, mix, None, None, final)
    assert torch.equal(H2, plain) and torch.equal(Hn, hc_ref.grouped_rms_norm(plain, final.hc_norm.weight, 32, 1e-6))
    with pytest.raises(RuntimeError, match="layer 1: its mixer reads H \\+ PLE"):
        layers[1](H, mix, lambda h: h, Hn)


def test_norm_rope_is_rope_of_the_head_norm():
    """``ops.rope.norm_rope`` (the QSA query / key preparation) = ``apply_rope`` of the per-head zero-centred norm:
    bit for bit (the same ops), strided heads included."""
    from qwen4exp.ops.rope import norm_rope, reference as rope_ref
    g = torch.Generator().manual_seed(5)
    for dt in (torch.float32, torch.bfloat16):
        x = (torch.randn(4, 3, 2 * 16, generator=g) * 3).to(dt)[..., :16]
        w = (torch.randn(16, generator=g) * 0.1).to(dt)
        ang = torch.randn(4, 4, generator=g)
        cos, sin = torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)
        want = rope_ref.apply_rope(hc_ref.grouped_rms_norm(x, w, 16, 1e-6), cos, sin)
        assert torch.equal(norm_rope(x, w, 1e-6, cos, sin), want)
        assert torch.equal(want[..., 8:], hc_ref.grouped_rms_norm(x, w, 16, 1e-6)[..., 8:])  # past R: the norm


def test_grouped_rms_norm_matches_loop():
    x, w = torch.randn(3, 4 * 8), torch.randn(4 * 8) * 0.1
    out = hc_ref.grouped_rms_norm(x, w, 8, 1e-6)
    for t in range(3):
        for s in range(4):
            seg = x[t, s * 8:(s + 1) * 8]
            torch.testing.assert_close(out[t, s * 8:(s + 1) * 8],
                                       seg / torch.sqrt((seg * seg).mean() + 1e-6) * (1 + w[s * 8:(s + 1) * 8]),
                                       **F32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_mix_matches_upstream_module(dtype):
    """Upstream's ``Qwen4ExpTextGatedResidual`` with the same weights (bf16: same rounding points)."""
    n, D, r_hc = 4, 32, 12
    cfg = SimpleNamespace(hc_count=n, hidden_size=D, hc_lowrank=r_hc, rms_norm_eps=1e-6)
    mod = UM.Qwen4ExpTextGatedResidual(cfg, use_combine=True)
    w, down, up, inj = hc_weights(n, D, r_hc, seed=5)
    with torch.no_grad():
        mod.hc_norm.weight.copy_(w)
        mod.input_mix_weight_down.weight.copy_(down)
        mod.input_mix_weight_up.weight.copy_(up)
        mod.block_inject_weight.weight.copy_(inj)
    mod = mod.to(dtype)
    H = (torch.randn(2, 6, n * D) * 2).to(dtype)
    with torch.no_grad():
        x_up, _, c_up = mod(H)
    x, c = hc_ref.hc_mix(H, mod.hc_norm.weight.detach(), mod.input_mix_weight_down.weight.detach(),
                         mod.input_mix_weight_up.weight.detach(), mod.block_inject_weight.weight.detach(), n, 1e-6)
    tol = F32 if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x, x_up, **tol)
    torch.testing.assert_close(c, c_up, **tol)


# =====================================================================================================================
# PLE
# =====================================================================================================================
def test_splitmix64_matches_upstream():
    for z in (0, 1, 1234, 2 ** 63, 2 ** 64 - 1, 0x9E3779B97F4A7C15, 987654321987654321):
        assert ple_ref.splitmix64(z) == UM._splitmix64(z)
    # splitmix64 of 0 (first output of the standard SplitMix64 generator seeded with 0)
    assert ple_ref.splitmix64(0) == 0xE220A8397B1DCDAF


def test_hash_multipliers_known_values():
    assert ple_ref.hash_multipliers(248320, 3, 0, 1234) == [23703573157769, 20109073645365, 8052911324071]


@pytest.mark.parametrize("vocab,n,q,seed", [(248320, 3, 0, 1234), (248320, 4, 1, 1234), (512, 3, 2, 7),
                                            (1, 2, 0, 0), (2 ** 40, 3, 3, 99)])
def test_hash_multipliers_match_upstream_and_bounds(vocab, n, q, seed):
    mu = ple_ref.hash_multipliers(vocab, n, q, seed)
    assert mu == UM._build_layer_multipliers(vocab, n, q, seed).tolist()
    bound = (2 ** 63 - 1) // vocab
    assert all(m % 2 == 1 and 1 <= m <= bound for m in mu)
    assert all((vocab - 1) * m <= 2 ** 63 - 1 for m in mu)  # wrap-free int64 products


def test_head_table_sizes_real_model():
    sizes = ple_ref.head_table_sizes(20_000_000, 16, 0)
    assert sizes[:4] == [20000003, 20000023, 20000033, 20000047]
    assert sizes == [20000003, 20000023, 20000033, 20000047, 20000059, 20000063, 20000069, 20000077,
                     20000081, 20000093, 20000107, 20000147, 20000153, 20000159, 20000161, 20000171]
    assert ple_ref.table_rows(sizes, 128) == 320001536
    assert sum(sizes) == 320001446


def test_head_table_sizes_continue_across_ple_layers():
    base, G = 1000, 6
    primes = [p for p in range(base, 2000) if all(p % d for d in range(2, int(p ** 0.5) + 1))]
    for q in range(3):
        sizes = ple_ref.head_table_sizes(base, G, q)
        assert sizes == primes[q * G:(q + 1) * G]
        assert sizes == [UM._find_nth_prime_after(base - 1, q * G + g + 1) for g in range(G)]
    assert ple_ref.head_table_sizes(1009, 1, 0) == [1009]  # a prime base is itself the first size
    assert ple_ref.table_rows([5, 7, 11], 16) == 32 and ple_ref.table_rows([16], 16) == 16


def loop_ngram_context(ids, lens, prev, eos):
    """For each token: walk back from t-1; the first EOS met is kept, everything older is EOS; positions before
    the sequence start come from the carried context (oldest first), and before that EOS."""
    c = prev.shape[1]
    rows = []
    for n, seq in enumerate(split_packed(ids.tolist(), lens)):
        hist = list(prev[n].tolist()) + list(seq)
        for i in range(c, len(hist)):
            row, seen_eos = [hist[i]], False
            for k in range(1, c + 1):
                j = i - k
                if j < 0 or seen_eos:
                    row.append(eos)
                else:
                    row.append(hist[j])
                    seen_eos = hist[j] == eos
            rows.append(row)
    return torch.tensor(rows, dtype=torch.long).view(-1, c + 1)


EOS = 1
CTX_CASES = [  # packed sequences (lists of ids), carried context per sequence
    ([[5, 6, 7, 8, 9]], [[EOS, EOS]]),
    ([[5, EOS, 7, 8], [9], [EOS, EOS, 4, EOS, 6, 7, 8]], [[EOS, EOS], [EOS, EOS], [EOS, EOS]]),
    ([[4, 5, 6], [7, 8], [9]], [[10, 11], [12, EOS], [EOS, 13]]),  # carried context, with EOS inside it
    ([[EOS], [3], [EOS, 3, EOS, EOS, 3]], [[20, 21], [EOS, EOS], [22, 23]]),
]


@pytest.mark.parametrize("seqs,prev", CTX_CASES)
def test_ngram_context_matches_loop_and_upstream(seqs, prev):
    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s])
    prev = torch.tensor(prev)
    ctx = ple_ref.ngram_context(ids, cu_of(lens), prev, EOS)
    assert ctx.dtype == torch.long and ctx.shape == (len(ids), 3)
    assert torch.equal(ctx, loop_ngram_context(ids, lens, prev, EOS))
    # upstream shifts the history (carried context ++ new ids) of each row independently
    me = SimpleNamespace(eos_token_id=EOS)
    for n, seq in enumerate(split_packed(ctx, lens)):
        hist = torch.cat([prev[n], torch.tensor(seqs[n])]).unsqueeze(0)
        for k in range(3):
            up = UM.Qwen4ExpTextNGramEmbedding._shift_right_ignore_eos(me, hist, k)[0, 2:]
            assert torch.equal(seq[:, k], up)


def test_ngram_context_random_and_longer_context():
    gen = torch.Generator().manual_seed(0)
    lens = [1, 17, 3, 1, 30]
    for c in (1, 2, 3):
        ids = torch.randint(0, 4, (sum(lens),), generator=gen)  # EOS (= 1) is frequent, incl. consecutive runs
        prev = torch.randint(0, 4, (len(lens), c), generator=gen)
        ctx = ple_ref.ngram_context(ids, cu_of(lens), prev, EOS)
        assert torch.equal(ctx, loop_ngram_context(ids, lens, prev, EOS))


@pytest.mark.parametrize("c", [1, 2, 3])
def test_ngram_context_decode_equals_one_token_sequences(c):
    """The decode form = ``ngram_context`` on N one-token sequences (random ids, EOS frequent incl. in the carried
    context), and it agrees with the loop."""
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        N = 40
        ids = torch.randint(0, 4, (N,), generator=gen)
        prev = torch.randint(0, 4, (N, c), generator=gen)
        ctx = ple_ref.ngram_context_decode(ids, prev, EOS)
        assert torch.equal(ctx, ple_ref.ngram_context(ids, cu_of([1] * N), prev, EOS))
        assert torch.equal(ctx, loop_ngram_context(ids, [1] * N, prev, EOS))


def test_ngram_context_carried_across_a_split():
    """Splitting every sequence in two calls, carrying its last n-1 history ids, equals one call."""
    gen = torch.Generator().manual_seed(1)
    lens, cut = [12, 5, 2], [5, 1, 2]
    ids = torch.randint(0, 5, (sum(lens),), generator=gen)
    prev = torch.full((3, 2), EOS)
    full = ple_ref.ngram_context(ids, cu_of(lens), prev, EOS)
    seqs = split_packed(ids, lens)
    a = torch.cat([s[:c] for s, c in zip(seqs, cut)])
    b = torch.cat([s[c:] for s, c in zip(seqs, cut)])
    prev_b = torch.stack([torch.cat([p, s[:c]])[-2:] for p, s, c in zip(prev, seqs, cut)])
    lens_b = [n - c for n, c in zip(lens, cut)]
    ctx_a = ple_ref.ngram_context(a, cu_of(cut), prev, EOS)
    ctx_b = ple_ref.ngram_context(b, cu_of(lens_b), prev_b, EOS)
    two = torch.cat([torch.cat([x, y]) for x, y in zip(split_packed(ctx_a, cut), split_packed(ctx_b, lens_b))])
    assert torch.equal(two, full)


def loop_ngram_ids(ctx, mu, sizes, offsets, h):
    """Per token, with Python integers: m_o = XOR_{j<o} T_j mu_j; head g of order o: (m_o mod size_g) + offset_g."""
    n = len(mu)
    out = []
    for row in ctx.tolist():
        ids = []
        for o in range(2, n + 1):
            m = 0
            for j in range(o):
                m ^= row[j] * mu[j]
            for g in range((o - 2) * h, (o - 1) * h):
                ids.append(m % sizes[g] + offsets[g])
        out.append(ids)
    return torch.tensor(out, dtype=torch.long)


@pytest.mark.parametrize("n,h", [(3, 8), (4, 2), (2, 3)])
def test_ngram_ids_matches_loop(n, h):
    V = 248320
    G = (n - 1) * h
    gen = torch.Generator().manual_seed(n * h)
    ctx = torch.randint(0, V, (25, n), generator=gen)
    ctx[0] = V - 1  # the largest ids: the products reach ~2^62
    ctx[1] = 0
    mu = ple_ref.hash_multipliers(V, n, 0, 1234)
    sizes = ple_ref.head_table_sizes(20_000_000 if G <= 16 else 1000, G, 0)
    offsets = [sum(sizes[:g]) for g in range(G)]
    rows = ple_ref.ngram_ids(ctx, torch.tensor(mu), torch.tensor(sizes), torch.tensor(offsets), h)
    ref = loop_ngram_ids(ctx, mu, sizes, offsets, h)
    assert rows.shape == (25, G) and torch.equal(rows, ref)
    assert bool((rows >= 0).all()) and int(rows.max()) < sum(sizes)


def test_ngram_pipeline_matches_upstream_embedding():
    """context -> ids -> lookup against upstream's ``Qwen4ExpTextNGramEmbedding`` (fresh sequences, same table)."""
    cfg = SimpleNamespace(ngram_size=3, heads_per_ngram=2, vocab_size=300, ngram_vocab_size_base=1000, seed=1234,
                          eos_token_id=[EOS, 2], make_ngram_vocab_size_divisible_by=16)
    torch.manual_seed(0)
    up = UM.Qwen4ExpTextNGramEmbedding(cfg, embedding_dim=4 * 5, layer_idx=1, ple_layer_index=1)
    B, L = 3, 11
    ids = torch.randint(0, 300, (B, L))
    ids[0, 3] = ids[1, 0] = ids[2, 5] = ids[2, 6] = EOS
    with torch.no_grad():
        want = up(ids, None)  # [B, L, G * d_g]
    mu = ple_ref.hash_multipliers(300, 3, 1, 1234)
    sizes = ple_ref.head_table_sizes(1000, 4, 1)
    offsets = [sum(sizes[:g]) for g in range(4)]
    assert mu == up.layer_multipliers.tolist() and sizes == up.ngram_heads_vocab_sizes.tolist()
    assert offsets == up.ngram_heads_offsets.tolist()
    assert ple_ref.table_rows(sizes, 16) == up.ngram_embedding.weight.shape[0]
    ctx = ple_ref.ngram_context(ids.flatten(), cu_of([L] * B), torch.full((B, 2), EOS), EOS)
    rows = ple_ref.ngram_ids(ctx, torch.tensor(mu), torch.tensor(sizes), torch.tensor(offsets), 2)
    got = ple_ref.ple_lookup(up.ngram_embedding.weight.detach(), rows)
    assert torch.equal(got, want.reshape(B * L, -1))


def test_ple_lookup_plain_tables():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(50, 3, generator=gen)
    rows = torch.randint(0, 50, (7, 4), generator=gen)
    out = ple_ref.ple_lookup(table, rows)
    ref = torch.stack([torch.cat([table[int(rows[t, g])] for g in range(4)]) for t in range(7)])
    assert out.shape == (7, 12) and out.dtype == torch.float32 and torch.equal(out, ref)
    out_bf = ple_ref.ple_lookup(table.bfloat16(), rows)
    assert out_bf.dtype == torch.bfloat16 and torch.equal(out_bf, ref.bfloat16())
    assert ple_ref.ple_lookup(table.bfloat16(), rows, out_dtype=torch.float32).dtype == torch.float32


def test_ple_lookup_fp8_table_with_scale():
    gen = torch.Generator().manual_seed(1)
    table = (torch.randn(64, 5, generator=gen) * 100).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.0123)
    rows = torch.randint(0, 64, (6, 4), generator=gen)
    out = ple_ref.ple_lookup(table, rows, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (6, 20)
    for t in range(6):
        for g in range(4):
            want = (table[int(rows[t, g])].float() * 0.0123).bfloat16()
            assert torch.equal(out[t, g * 5:(g + 1) * 5], want)
    out32 = ple_ref.ple_lookup(table, rows, scale, out_dtype=torch.float32)
    torch.testing.assert_close(out32, table.float()[rows].reshape(6, 20) * 0.0123, **F32)


def test_ple_layer_decode_form_equals_packed_form():
    """``PLE`` with ``cu_seqlens=None`` (one token per sequence: the graph-capturable decode form the vLLM plugin
    uses) = the packed form on one-token sequences, over several steps with its states carried (EOS included)."""
    from qwen4exp import presets
    from qwen4exp.layers.ple import PLE

    torch.manual_seed(6)
    cfg = presets.tiny_text()
    ple = PLE(cfg, 0).eval()
    for p in ple.parameters():
        p.data.normal_(0, 0.5)
    N, nD = 6, cfg.hc_count * cfg.hidden_size
    eos = ple.ple_embedding.eos
    ctx = torch.full((N, ple.context_len), eos, dtype=torch.long)
    conv = torch.randn(N, nD, ple.conv_state_len)
    ctx_ref, conv_ref_ = ctx.clone(), conv.clone()
    with torch.no_grad():
        for step in range(4):
            H = torch.randn(N, nD)
            ids = torch.randint(0, cfg.vocab_size, (N,))
            ids[step] = eos
            out, ctx, conv = ple(H, ids, None, ctx, conv)
            out_ref, ctx_ref, conv_ref_ = ple(H, ids, cu_of([1] * N), ctx_ref, conv_ref_)
            torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
            assert torch.equal(ctx, ctx_ref)
            torch.testing.assert_close(conv, conv_ref_, rtol=0, atol=0)
