"""``qwen4exp.ops.gated_delta_rule``: Gated DeltaNet's recurrence. Both reference forms (recurrent, chunked) against a
per-token loop written from the equation, plus upstream transformers' torch forms as extra oracles; what fla's
kernels take (``fla_kernel.covers``); fla's CUDA kernels against the reference at the model's widths (GPU); fla's
recurrent kernel on our layout under Triton's interpreter, and the custom operators' fakes (no GPU)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from op_helpers import BF, cu_of, expect_kernel, gen, poison, rel, rnd, split_packed
from qwen4exp.ops import gated_delta_rule as gdn
from qwen4exp.ops.cuda_graph import capture
from qwen4exp.ops.gated_delta_rule import fla_kernel, reference as gdr_ref


def upstream():
    """Upstream transformers' Qwen4Exp modeling (an extra oracle), imported, not importorskip'd: a moved or missing
    module fails the tests that use it, loudly."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp
    return modeling_qwen4_exp


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
    um = upstream()
    for up in (lambda *a, **kw: um.torch_chunk_gated_delta_rule(*a, chunk_size=8, **kw),
               um.torch_recurrent_gated_delta_rule):
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


# ----------------------------------------------------------------------------------------- what fla takes
def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("q,k,v,want", [
    (meta(7, 16, 128), meta(7, 16, 128), meta(7, 48, 128), True),     # the model's widths: 16 key / 48 value heads
    (meta(7, 2, 64, dtype=torch.float32), meta(7, 2, 64, dtype=torch.float32), meta(7, 4, 64, dtype=torch.float32),
     True),
    (meta(7, 2, 64), meta(7, 2, 64), meta(7, 3, 64), False),          # value heads not a multiple of key heads
    (meta(7, 2, 512), meta(7, 2, 512), meta(7, 2, 64), False),        # head size past 256
    (meta(7, 2, 64), meta(7, 2, 64, dtype=torch.float32), meta(7, 2, 64), False),  # mixed dtypes
    (meta(1, 7, 2, 64), meta(1, 7, 2, 64), meta(1, 7, 2, 64), False),  # packed [T, H, d] only
])
def test_fla_covers(q, k, v, want):
    assert fla_kernel.covers(q, k, v, meta(7, v.shape[-2], dtype=torch.float32), meta(7, v.shape[-2])) is want


def test_dispatcher_picks_the_form_and_runs_the_reference_on_cpu():
    """``gated_delta_rule``: the recurrent form while the sequences bring at most 4 tokens on average (decode, MTP
    verification), the chunked one otherwise; on the CPU both are the references."""
    for lens, form in (([1, 1, 1], "recurrent_gated_delta_rule"), ([3, 1, 2], "recurrent_gated_delta_rule"),
                       ([4, 4, 4], "recurrent_gated_delta_rule"), ([9, 1, 3], "chunk_gated_delta_rule")):
        q, k, v, g, beta, st = gdr_inputs(lens, 2, 4, 8, 8, seed=1)
        with pytest.raises(AssertionError, match="reference ran"):
            with expect_kernel(form):
                o, fin = gdn.gated_delta_rule(q, k, v, g, beta, cu_of(lens), st)
        o_ref, fin_ref = getattr(gdr_ref, form)(q, k, v, g, beta, cu_of(lens), st)
        assert torch.equal(o, o_ref) and torch.equal(fin, fin_ref)


# -------------------------------------------------------------------------------- GPU (fla) vs reference
def _fla_or_skip():
    if not gdn.KERNELS.table("cuda"):
        pytest.skip(f"fla's kernels are unavailable here: {gdn.KERNELS.errors.get('cuda')} (the gpu extra: "
                    "pip install -e '.[gpu]')")


def gdn_case(lens, hk, hv, dk, dv, seed, with_state):
    g = gen(seed, "cuda")
    T = sum(lens)
    q, k = rnd((T, hk, dk), g), rnd((T, hk, dk), g)
    v = rnd((T, hv, dv), g)
    gate = -F.softplus(torch.randn((T, hv), generator=g, device="cuda"))  # log decay <= 0
    beta = torch.sigmoid(torch.randn((T, hv), generator=g, device="cuda")).to(BF)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    h0 = torch.randn((len(lens), hv, dk, dv), generator=g, device="cuda") * 0.1 if with_state else None
    return q, k, v, gate, beta, cu, h0


@pytest.mark.gpu
@pytest.mark.parametrize("lens, hk, hv, dk, dv, with_state", [
    ([300, 1, 77, 128], 16, 48, 128, 128, True),   # real widths; partial chunks, a 1-token sequence
    ([5000, 3], 16, 48, 128, 128, False),          # a long chunk run (79 chunks) and a short one, zero states
    ([64, 65], 2, 4, 64, 64, True),                # the tiny model's widths; a chunk boundary +- 1
])
def test_chunk_kernel_matches_reference(lens, hk, hv, dk, dv, with_state):
    _fla_or_skip()
    args = gdn_case(lens, hk, hv, dk, dv, 7, with_state)
    want_o, want_s = gdr_ref.chunk_gated_delta_rule(*args)
    poison()
    with expect_kernel("chunk_gated_delta_rule"):
        o, s = gdn.chunk_gated_delta_rule(*args)
    assert o.shape == want_o.shape and o.dtype == want_o.dtype and s.shape == want_s.shape and s.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(s).any()
    assert rel(o, want_o) < 2e-2 and rel(s, want_s) < 2e-2, (rel(o, want_o), rel(s, want_s))


@pytest.mark.gpu
@pytest.mark.parametrize("B, hk, hv, dk, dv", [(1, 16, 48, 128, 128), (32, 16, 48, 128, 128), (5, 2, 4, 64, 64)])
def test_recurrent_kernel_matches_reference(B, hk, hv, dk, dv):
    """Decode: one token per sequence from a carried state (the fused recurrent kernel), also inside a CUDA
    graph (replayed on fresh inputs copied into the captured buffers)."""
    _fla_or_skip()
    args = gdn_case([1] * B, hk, hv, dk, dv, 11, True)
    want_o, want_s = gdr_ref.recurrent_gated_delta_rule(*args)
    poison()
    with expect_kernel("recurrent_gated_delta_rule"):
        o, s = gdn.gated_delta_rule(*args)
    assert not torch.isnan(o).any() and not torch.isnan(s).any()
    assert rel(o, want_o) < 5e-3 and rel(s, want_s) < 5e-3, (rel(o, want_o), rel(s, want_s))
    bufs = [a.clone() for a in args]
    graph, outs = capture(lambda: gdn.recurrent_gated_delta_rule(*bufs))
    fresh = gdn_case([1] * B, hk, hv, dk, dv, 12, True)
    for b, a in zip(bufs, fresh):
        b.copy_(a)
    graph.replay()
    want_o, want_s = gdr_ref.recurrent_gated_delta_rule(*fresh)
    assert rel(outs[0], want_o) < 5e-3 and rel(outs[1], want_s) < 5e-3


# ----------------------------------------------------------------------------------- Triton checks (no GPU)
@pytest.mark.triton_check("gdn_fla_recurrent")
def test_interpreter_fla_recurrent_on_our_layout(triton_checks):
    triton_checks.passed("gdn_fla_recurrent")


@pytest.mark.triton_check("gdn_registration")
def test_custom_ops_schemas_and_fakes(triton_checks):
    triton_checks.passed("gdn_registration")
