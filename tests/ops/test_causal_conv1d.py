"""``qwen4exp.ops.causal_conv1d``: the causal depthwise conv1d over packed variable-length sequences (no kernel of ours:
every device runs the reference). The reference against a per-token loop written from the equation, plus upstream
transformers' ``causal_conv1d_update`` as an extra oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from op_helpers import F32, cu_of, split_packed
from qwen4exp.ops import causal_conv1d
from qwen4exp.ops.causal_conv1d import reference as conv_ref


def upstream():
    """Upstream transformers' Qwen4Exp modeling (an extra oracle), imported, not importorskip'd: a moved or missing
    module fails the tests that use it, loudly."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp
    return modeling_qwen4_exp


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


@pytest.mark.parametrize("lens", CONV_LENS + [[0, 6, 0, 1], [3, 0]])  # (empty rows: padding requests keep their
@pytest.mark.parametrize("dilation", [1, 3])                          # state)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("form", ["causal_conv1d", "causal_conv1d_packed"])  # (packed: what GPUs run, no host read)
def test_causal_conv1d_matches_loop(lens, dilation, with_state, activation, form):
    torch.manual_seed(0)
    C, K = 6, 4
    S = conv_ref.state_len(K, dilation)
    x = torch.randn(sum(lens), C)
    w = torch.randn(C, K)
    st = torch.randn(len(lens), C, S) if with_state else None
    y, fin = getattr(conv_ref, form)(x, w, cu_of(lens), st, dilation, activation)
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
    y_up = upstream().causal_conv1d_update(x.T.unsqueeze(0).contiguous(), up_state, w, None, "silu")[0].T
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


def test_dispatcher_runs_the_reference():
    x, w = torch.randn(5, 3), torch.randn(3, 4)
    assert causal_conv1d.pick("causal_conv1d", torch.device("cuda"), conv_ref.causal_conv1d) is conv_ref.causal_conv1d
    y, st = causal_conv1d.causal_conv1d(x, w, cu_of([5]), None, 2)
    y_ref, st_ref = conv_ref.causal_conv1d(x, w, cu_of([5]), None, 2)
    assert torch.equal(y, y_ref) and torch.equal(st, st_ref)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dispatcher_on_cuda_never_syncs():
    """On a GPU the dispatcher takes the packed form: a prefill-shaped call (a long chunk beside decodes) makes no
    device-to-host read, which would stall an eager step's host behind its GPU, and equals the padded form."""
    torch.manual_seed(2)
    lens, C, K, dil = [3000, 1, 1, 17], 64, 4, 2
    x = torch.randn(sum(lens), C, device="cuda").bfloat16()
    w = torch.randn(C, K, device="cuda").bfloat16()
    st = torch.randn(len(lens), C, conv_ref.state_len(K, dil), device="cuda").bfloat16()
    cu = cu_of(lens, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, fin = causal_conv1d.causal_conv1d(x, w, cu, st, dil)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    y_ref, fin_ref = conv_ref.causal_conv1d(x, w, cu, st, dil)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(fin, fin_ref)
