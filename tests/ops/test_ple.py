"""PLE (``qwen4exp.ops.ple``): the reference against independent per-token loops and against upstream
transformers' own helpers (the pinned upstream module must be there: these tests fail, not skip, without it), the
CUDA path's host-side decisions (``host``: what each kernel covers), the kernels against the reference at the real
widths (``gpu``), and the Triton checks without a GPU (``interpreter_qsa_ple.py``), one item each.

The loops below deliberately do not call the code under test: each one is the textbook form of its equation.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from op_helpers import BF, F32, bf16_close, cu_of, expect_kernel, gen, poison, rnd, split_packed

from qwen4exp.ops import _registry
from qwen4exp.ops import ple as ple_ops
from qwen4exp.ops.ple import host
from qwen4exp.ops.ple import reference as ple_ref


@pytest.fixture
def UM():
    """The upstream oracle (transformers' Qwen4Exp modeling), imported, not importorskip'd: a moved or missing
    upstream module fails the tests that use it, loudly (and only those: the kernel tests need no transformers)."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp
    return modeling_qwen4_exp


# =====================================================================================================================
# the reference against per-token loops and upstream (CPU)
# =====================================================================================================================
def test_splitmix64_matches_upstream(UM):
    for z in (0, 1, 1234, 2 ** 63, 2 ** 64 - 1, 0x9E3779B97F4A7C15, 987654321987654321):
        assert ple_ref.splitmix64(z) == UM._splitmix64(z)
    # splitmix64 of 0 (first output of the standard SplitMix64 generator seeded with 0)
    assert ple_ref.splitmix64(0) == 0xE220A8397B1DCDAF


def test_hash_multipliers_known_values():
    assert ple_ref.hash_multipliers(248320, 3, 0, 1234) == [23703573157769, 20109073645365, 8052911324071]


@pytest.mark.parametrize("vocab,n,q,seed", [(248320, 3, 0, 1234), (248320, 4, 1, 1234), (512, 3, 2, 7),
                                            (1, 2, 0, 0), (2 ** 40, 3, 3, 99)])
def test_hash_multipliers_match_upstream_and_bounds(UM, vocab, n, q, seed):
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


def test_head_table_sizes_continue_across_ple_layers(UM):
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
def test_ngram_context_matches_loop_and_upstream(UM, seqs, prev):
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


def test_ngram_pipeline_matches_upstream_embedding(UM):
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


def _step_verification(ple, H, k, v, ids, ctx, conv, nq):
    """The MTP verification stepped one position at a time (what ``mix_verify`` / ``verify`` must equal): each
    position's decode-form call from the states the previous one left."""
    N = ctx.shape[0]
    embs, ctxs, outs, convs = [], [], [], []
    for j in range(nq):
        rows = torch.arange(N) * nq + j
        e, ctx = ple.ple_embedding(ids[rows.to(ids.device)], None, ctx, H.dtype)
        o, conv = ple.mix(H[rows], k[rows], v[rows], None, conv)
        conv = conv.to(H.dtype)
        embs.append(e), ctxs.append(ctx), outs.append(o), convs.append(conv)
    inter = lambda xs: torch.stack(xs, 1).flatten(0, 1)  # noqa: E731  (rows b * nq + j)
    return inter(embs), torch.stack(ctxs, 1), inter(outs), torch.stack(convs, 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ple_verification_forms_equal_stepping(device):
    """``NGramEmbedding.verify`` and ``PLE.mix_verify`` (an MTP verification of nq tokens a sequence in one / two
    calls, the vLLM plugin's graph-safe path) equal stepping the decode form one position at a time: the same
    embeddings, outputs and per-position states (CUDA: the bf16 kernels, bit for bit), EOS inside the window."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from qwen4exp import presets
    from qwen4exp.layers.ple import PLE

    torch.manual_seed(7)
    cfg = presets.tiny_text()
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    ple = PLE(cfg, 0).eval()
    for p in ple.parameters():
        p.data.normal_(0, 0.5)
    ple = ple.to(device, dt)
    N, nq, nD, D = 3, 4, cfg.hc_count * cfg.hidden_size, cfg.hidden_size
    eos = ple.ple_embedding.eos
    with torch.no_grad():
        ctx = torch.randint(0, cfg.vocab_size, (N, ple.context_len), device=device)
        ctx[1, -1] = eos
        ids = torch.randint(0, cfg.vocab_size, (N * nq,), device=device)
        ids[2 * nq + 1] = eos
        H = torch.randn(N * nq, nD, device=device, dtype=dt)
        emb, ctx_v = ple.ple_embedding.verify(ids, ctx, nq, dt)
        k, v = ple.project(emb)
        conv = torch.randn(N, nD, ple.conv_state_len, device=device, dtype=dt)
        out, conv_v = ple.mix_verify(H, k, v, conv, nq)
        emb_s, ctx_s, out_s, conv_s = _step_verification(ple, H, k, v, ids, ctx, conv, nq)
    assert torch.equal(emb, emb_s) and torch.equal(ctx_v, ctx_s.to(ctx_v.dtype))
    # (the CUDA kernels compute each row alone: exact; the CPU reference's vectorised reductions may round a row
    # of a 12-row call one fp32 unit apart from the same row in a 3-row call)
    tol = dict(rtol=0, atol=0) if device == "cuda" else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, out_s, **tol)
    torch.testing.assert_close(conv_v.to(dt), conv_s, **tol)
    assert ctx_v.shape == (N, nq, ple.context_len) and conv_v.shape == (N, nq, nD, ple.conv_state_len)


# =====================================================================================================================
# the CUDA path's host-side decisions (CPU: shapes, dtypes, strides; no Triton)
# =====================================================================================================================
def test_lookup_covers():
    fp8 = torch.zeros(100, 160, dtype=torch.float8_e4m3fn)
    rows, scale = torch.zeros(3, 16, dtype=torch.long), torch.tensor(0.5)
    assert host.lookup_covers(fp8, rows, scale, None) and host.out_dtype_of(fp8, scale, None) == BF
    assert host.lookup_covers(fp8, rows.int(), scale, torch.float32)
    assert host.out_dtype_of(fp8.to(BF), None, None) == BF and host.out_dtype_of(fp8, scale, torch.half) == torch.half
    assert host.lookup_covers(torch.zeros(100, 16, dtype=BF), rows[:, 0], None, None)  # [T] rows of one head
    assert not host.lookup_covers(fp8, rows, torch.tensor([0.5, 0.5]), None)  # a scale per row: the reference
    assert not host.lookup_covers(fp8, rows.float(), scale, None)
    assert not host.lookup_covers(fp8, rows[0, 0], scale, None)  # no row dimension
    assert not host.lookup_covers(torch.zeros(100, 320, dtype=BF)[:, ::2], rows, None, None)  # strided rows
    assert not host.lookup_covers(torch.zeros(100, 8, 2, dtype=BF), rows, None, None)
    assert not host.lookup_covers(fp8.to(torch.float8_e5m2), rows, scale, None)
    assert not host.lookup_covers(fp8, rows, None, None)  # fp8 out without a scale
    assert not host.lookup_covers(torch.zeros(100, 16, dtype=torch.float64), rows, None, None)


def test_ngram_lookup_decode_covers():
    ids, prev = torch.zeros(5, dtype=torch.long), torch.zeros(5, 2, dtype=torch.long)
    assert host.ngram_lookup_decode_covers(ids, prev) and host.ngram_lookup_decode_covers(ids.int(), prev.int())
    assert host.ngram_lookup_decode_covers(ids, torch.zeros(5, 8, dtype=torch.long))
    assert not host.ngram_lookup_decode_covers(ids, torch.zeros(5, 9, dtype=torch.long))  # contexts of 1-8 ids
    assert not host.ngram_lookup_decode_covers(ids, prev[:4])
    assert not host.ngram_lookup_decode_covers(ids.view(5, 1), prev)  # one id per sequence (decode)
    assert not host.ngram_lookup_decode_covers(ids, prev.float())
    assert not host.ngram_lookup_decode_covers(ids, torch.zeros(2, 5, dtype=torch.long).t())  # strided context


def test_ple_mix_decode_covers():
    """One token per sequence, bf16, a conv state: the kernel; prefill (cu_seqlens), no state, fp32 streams or
    sizes past its blocks: the reference."""
    T, n, D, K, S = 3, 4, 64, 4, 9
    H, kv = torch.zeros(T, n * D, dtype=BF), torch.zeros(T, n * D + D, dtype=BF)
    k, v = kv[:, : n * D], kv[:, n * D:]  # views into one keys|values buffer, as the vLLM model passes them
    qw, cw, wc = torch.zeros(n * D, dtype=BF), torch.zeros(n * D, dtype=BF), torch.zeros(n * D, K, dtype=BF)
    st = torch.zeros(T, n * D, S, dtype=BF)
    assert host.ple_mix_decode_covers(H, k, v, qw, cw, wc, None, st, n)
    assert host.ple_mix_decode_covers(H, k, v, qw, cw, wc, None, st.float(), n)
    assert not host.ple_mix_decode_covers(H, k, v, qw, cw, wc, cu_of([1, 2]), st, n)
    assert not host.ple_mix_decode_covers(H, k, v, qw, cw, wc, None, None, n)
    assert not host.ple_mix_decode_covers(H.float(), k, v, qw, cw, wc, None, st, n)
    assert not host.ple_mix_decode_covers(H, k, v, qw, cw, wc, None, st, 3)  # n must divide the streams' width
    assert not host.ple_mix_decode_covers(H, k, v, qw, cw, torch.zeros(n * D, 17, dtype=BF), None, st, n)
    assert not host.ple_mix_decode_covers(H, k, v, qw, cw, wc, None, torch.zeros(T, n * D, 65, dtype=BF), n)
    assert not host.ple_mix_decode_covers(H, k, v, qw, cw, wc, None, st.half(), n)


def test_dispatcher_sends_cpu_calls_to_the_reference():
    assert ple_ops.KERNELS.table("cpu") == {}
    table, rows = torch.randn(50, 3), torch.randint(0, 50, (7, 4))
    with _registry.record() as ran:
        out = ple_ops.ple_lookup(table, rows)
    assert ran == {"ple_lookup": "reference"} and torch.equal(out, ple_ref.ple_lookup(table, rows))


# =====================================================================================================================
# the CUDA kernels against the reference, real widths (``gpu``); outputs from poisoned (NaN-filled) memory
# =====================================================================================================================
def _cuda():
    from qwen4exp.ops.ple import cuda
    return cuda


@pytest.mark.gpu
def test_dispatcher_picks_the_ple_kernels_on_cuda():
    cuda = _cuda()
    table = ple_ops.KERNELS.table("cuda")
    assert not ple_ops.KERNELS.errors, ple_ops.KERNELS.errors
    assert table == cuda.KERNELS and sorted(table) == ["ngram_lookup_decode", "ple_lookup", "ple_mix"]
    assert ple_ops.pick("ple_mix", torch.device("cuda"), ple_ref.ple_mix) is cuda.ple_mix


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["gpu", "pinned"])
@pytest.mark.parametrize("kind", ["fp8_gpu_scale", "fp8_host_scale", "bf16"])
@pytest.mark.parametrize("T", [1, 7, 32])
def test_ple_lookup_matches_reference(where, kind, T):
    R, dg, G = 300_007, 160, 16
    g = torch.Generator().manual_seed(T)
    base = torch.randn(R, dg, generator=g) * 120
    if kind.startswith("fp8"):
        table = base.clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.tensor(0.0173)
        if kind == "fp8_gpu_scale":
            scale = scale.cuda()
    else:
        table, scale = base.to(BF), None
    rows = torch.randint(0, R, (T, G), generator=g)
    rows[0, 0], rows[-1, -1] = 0, R - 1  # first and last rows
    want = ple_ref.ple_lookup(table, rows, None if scale is None else scale.cpu())
    table = table.pin_memory() if where == "pinned" else table.cuda()
    poison()
    with expect_kernel("ple_lookup"):
        out = ple_ops.ple_lookup(table, rows.cuda(), scale)
    assert out.is_cuda and out.shape == (T, G * dg) and out.dtype == want.dtype
    assert torch.equal(out.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["pinned", "gpu"])
@pytest.mark.parametrize("N", [1, 32])
def test_ngram_lookup_decode_matches_reference(where, N):
    """Decode's n-gram context + hashing + gather in one launch (the real layout: n = 3, 8 heads per n-gram, an fp8
    table of 160-wide rows with a scale) = the reference op by op (CPU), contexts with EOS; also from a CUDA graph."""
    n, hpn, eos, V = 3, 8, 248044, 248320
    G = (n - 1) * hpn
    sizes = ple_ops.head_table_sizes(20_000, G, 1)
    mult = torch.tensor(ple_ops.hash_multipliers(V, n, 1, 0))
    hsz, hoff = torch.tensor(sizes), torch.tensor([sum(sizes[:i]) for i in range(G)])
    g = torch.Generator().manual_seed(N)
    table = (torch.randn(sum(sizes), 160, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.0173)

    def case():
        prev = torch.randint(0, V, (N, n - 1), generator=g)
        prev[::3, 0] = eos
        prev[1::4, 1] = eos
        return torch.randint(0, V, (N,), generator=g), prev

    ids, prev = case()
    want, want_next = ple_ref.ngram_lookup_decode(ids, prev, eos, mult, hsz, hoff, hpn, table, scale, None)
    tab = table.pin_memory() if where == "pinned" else table.cuda()
    dev = [t.cuda() for t in (ids, prev, mult, hsz, hoff)]
    sc = scale.cuda()
    assert _cuda().ngram_lookup_decode_supported(dev[0], dev[1], tab, sc, None)
    poison()
    with expect_kernel("ngram_lookup_decode"):
        out, nxt = ple_ops.ngram_lookup_decode(dev[0], dev[1], eos, *dev[2:], hpn, tab, sc, None)
    assert torch.equal(out.cpu(), want) and torch.equal(nxt.cpu(), want_next)
    graph = torch.cuda.CUDAGraph()
    with expect_kernel("ngram_lookup_decode"), torch.cuda.graph(graph):
        gout, gnxt = ple_ops.ngram_lookup_decode(dev[0], dev[1], eos, *dev[2:], hpn, tab, sc, None)
    ids, prev = case()
    dev[0].copy_(ids)
    dev[1].copy_(prev)
    graph.replay()
    want, want_next = ple_ref.ngram_lookup_decode(ids, prev, eos, mult, hsz, hoff, hpn, table, scale, None)
    assert torch.equal(gout.cpu(), want) and torch.equal(gnxt.cpu(), want_next)


@pytest.mark.gpu
@pytest.mark.parametrize("T,n,D,K,dil,state_dtype", [(1, 4, 2560, 4, 3, BF), (32, 4, 2560, 4, 3, BF),
                                                     (5, 2, 384, 3, 2, torch.float32)])
def test_ple_mix_decode_matches_reference(T, n, D, K, dil, state_dtype):
    """The decode-time PLE mix in one launch (keys and values as views into one buffer, as the vLLM model passes
    them) against ``reference.ple_mix``; also replayed from a CUDA graph with new inputs."""
    g = gen(T * D + K, "cuda")
    nD, S = n * D, (K - 1) * dil

    def case():
        H, kv = rnd((T, nD), g, 2.0), rnd((T, nD + D), g)
        return H, kv[:, :nD], kv[:, nD:], rnd((T, nD, S), g, 1.0, state_dtype)

    qw, cw, wc = rnd((nD,), g, 0.2), rnd((nD,), g, 0.2), rnd((nD, K), g, 0.5)
    H, k, v, st = case()
    assert _cuda().ple_mix_decode_supported(H, k, v, qw, cw, wc, None, st, n)
    poison()
    with expect_kernel("ple_mix"):
        out, new = ple_ops.ple_mix(H, k, v, qw, cw, wc, None, st, n, 1e-6, dil)
    want, want_new = ple_ref.ple_mix(H, k, v, qw, cw, wc, None, st, n, 1e-6, dil)
    bf16_close(out, want, 0.95)
    bf16_close(new, want_new, 0.95)
    static = case()
    graph = torch.cuda.CUDAGraph()
    with expect_kernel("ple_mix"), torch.cuda.graph(graph):
        gout, gnew = ple_ops.ple_mix(*static[:3], qw, cw, wc, None, static[3], n, 1e-6, dil)
    fresh = case()
    for a, b in zip(static, fresh):
        a.copy_(b)
    graph.replay()
    want, want_new = ple_ref.ple_mix(*fresh[:3], qw, cw, wc, None, fresh[3], n, 1e-6, dil)
    bf16_close(gout, want, 0.95)
    bf16_close(gnew, want_new, 0.95)


# =====================================================================================================================
# the Triton checks without a GPU (``interpreter_qsa_ple.py``): under the CPU interpreter, then compiled for sm_90
# =====================================================================================================================
PLE_CHECKS = ("ple_lookup", "ngram_lookup_decode", "ple_mix", "ple_registration")
PLE_KERNELS = ("_ple_gather_kernel", "_ngram_gather_decode_kernel", "_ple_mix_decode_kernel")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.triton_check(n)) for n in PLE_CHECKS])
def test_interpreter_check(triton_checks, name):
    triton_checks.passed(name)


@pytest.mark.triton_check(*PLE_CHECKS)  # (the launches these checks record are what the compile step builds)
@pytest.mark.parametrize("kernel", PLE_KERNELS)
def test_compiles_for_hopper(triton_checks, kernel):
    """Every recorded launch of the kernel compiles to an sm_90 cubin within Hopper's shared memory, without
    register spills (decode-path kernels)."""
    triton_checks.compiled(kernel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
def test_ngram_context_prefill_never_waits_for_the_gpu():
    """The prefill context and the next carried ids take every size from the shapes: under CUDA's sync debug mode
    (error on any synchronising call) they run, and equal the loop formulation (run 31: the syncs this had let a
    50k prefill's last chunk wait on the host for ~96 ms)."""
    from qwen4exp.layers.ple import _next_context
    gen = torch.Generator().manual_seed(1)
    lens = [1, 700, 3, 144]
    ids = torch.randint(0, 4, (sum(lens),), generator=gen)
    prev = torch.randint(0, 4, (len(lens), 2), generator=gen)
    want = loop_ngram_context(ids, lens, prev, EOS)
    d_ids, d_cu, d_prev = ids.cuda(), cu_of(lens).cuda(), prev.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ctx = ple_ref.ngram_context(d_ids, d_cu, d_prev, EOS)
        nxt = _next_context(d_ids, d_cu, d_prev)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(ctx.cpu(), want)
    assert torch.equal(nxt.cpu(), _next_context(ids, cu_of(lens), prev))
