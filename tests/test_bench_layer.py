"""The layer harness (``benchmarks/bench_layer.py``, issue 50 item 2) computes what the model computes: its QSA
decode step over the paged caches it fills (``ops.qsa.step``, the plugin's own decode path) against the contiguous
reference of the HF runtime, its GDN steps against the packed form, and a CPU smoke run of the whole CLI. Its
timing runs on a GPU only (the device queue)."""

from __future__ import annotations

import os

import pytest
import torch

from qwen4exp.layers.gdn import GatedDeltaNet
from qwen4exp.ops.qsa import block_mean, qsa_attention
from script_loader import load_script

bench_layer = load_script("bench_layer")


@pytest.fixture(autouse=True)
def _switches_restored(monkeypatch):
    """The CLI sets QWEN4EXP_MOE_DECODE in the process environment (its ``--moe``): restored after each test."""
    from qwen4exp import envs

    monkeypatch.setenv("QWEN4EXP_MOE_DECODE", os.environ.get("QWEN4EXP_MOE_DECODE", "0"))
    yield
    envs.reset()


def tiny_case(kind, B, nq, ctx, copies=1):
    return bench_layer.Case(bench_layer.text_config(tiny=True), kind, B, nq, ctx, copies, 16, torch.float32, "cpu",
                            seed=3, keep_history=True)


@pytest.mark.parametrize("B,nq,ctx", [(1, 1, 37), (2, 1, 39), (2, 3, 37), (3, 4, 64)])
def test_qsa_step_matches_contiguous_reference(B, nq, ctx):
    """Token rows of the step written into the harness's paged cache, blocks completed, selected and attended
    (``decode_inputs`` + ``decode_writes`` + ``qsa_decode_paged``) == ``qsa_attention`` over each request's whole
    history laid out contiguously, block keys pooled from its raw keys (the HF runtime's formulation). The cases
    complete a block within the step (39 + 1, 37 + 3) and not (37 + 1), and select (budget 16 < context)."""
    case = tiny_case("qsa", B, nq, ctx)
    layer, cache = case.layers[0], case.states[0]
    attn, rot = layer.self_attn, case.rotary
    assert attn.budget < ctx
    x = torch.randn(B * nq, case.config.hidden_size, generator=torch.Generator().manual_seed(5))
    got = case.qsa_mix(layer, cache, case.qsa_step_inputs())(x)

    cos, sin = rot(case.positions, x.dtype)
    p = attn.project(x, cos, sin)
    h, r = cache.history, attn.r
    out = torch.empty_like(p.q)
    for b in range(B):
        rows = slice(b * nq, (b + 1) * nq)
        k = torch.cat([h["k"][b], p.k[rows]])
        v = torch.cat([h["v"][b], p.v[rows]])
        raw = torch.cat([h["raw"][b], p.index_k_raw[rows]])
        nfull = (ctx + nq) // r
        cb, sb = rot(torch.arange(0, nfull * r, r), x.dtype)
        keys = attn.block_keys(block_mean(raw[: nfull * r], r), cb, sb)
        out[rows] = qsa_attention(p.q[rows], k, v, torch.arange(ctx, ctx + nq), p.index_q[rows], keys, r,
                                  attn.budget, attn.scale, attn.index_scale)
    want = attn.output(out, p.gate)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nq", [1, 3])
def test_gdn_steps_match_packed_form(nq):
    """The harness's GDN mixer (states stored in place; nq > 1: each request's tokens packed as one sequence) ==
    ``GatedDeltaNet``'s decode form one position at a time, outputs and final states."""
    B = 2
    case = tiny_case("gdn", B, nq, 8)
    layer, st = case.layers[0], case.states[0]
    conv0, ssm0 = st.conv.clone(), st.ssm.clone()
    x = torch.randn(B * nq, case.config.hidden_size, generator=torch.Generator().manual_seed(7))
    got = case.gdn_mix(layer, st)(x)
    conv, ssm, ys = conv0, ssm0, []
    for j in range(nq):
        y, conv, ssm = layer.linear_attn(x.view(B, nq, -1)[:, j], None, conv, ssm)
        ys.append(y)
    want = torch.stack(ys, 1).reshape(B * nq, -1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.conv, conv.to(st.conv.dtype), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.ssm, ssm, rtol=1e-5, atol=1e-5)


def test_gdn_decode_form_is_the_packed_form():
    """``GatedDeltaNet.forward(x, None, ...)`` (one token a sequence, sizes from the shapes) == the same tokens
    packed with ``cu_seqlens`` 0..N, with and without initial states."""
    cfg = bench_layer.text_config(tiny=True)
    torch.manual_seed(0)
    gdn = GatedDeltaNet(cfg)
    bench_layer.init_weights(gdn)
    N = 3
    x = torch.randn(N, cfg.hidden_size)
    (cd, km1), ssm_shape = GatedDeltaNet.state_shapes(cfg)
    for states in ((None, None), (torch.randn(N, cd, km1), torch.randn(N, *ssm_shape))):
        y1, c1, s1 = gdn(x, None, *states)
        y2, c2, s2 = gdn(x, torch.arange(N + 1), *states)
        torch.testing.assert_close(y1, y2)
        torch.testing.assert_close(c1, c2)
        torch.testing.assert_close(s1, s2)


def test_cli_smoke_on_cpu(capsys):
    """``--device cpu``: every kind and batch runs two chained steps through the references, finite streams."""
    rows = bench_layer.main(["--device", "cpu", "--batch", "1,2", "--queries", "2", "--copies", "2"])
    assert [(r["kind"], r["batch"]) for r in rows] == [("gdn", 1), ("gdn", 2), ("qsa", 1), ("qsa", 2)]
    assert all(r["finite"] and r["bytes_per_layer"] > 0 for r in rows)
    with pytest.raises(SystemExit, match="--kinds 'mla'"):
        bench_layer.main(["--device", "cpu", "--kinds", "mla"])


@pytest.mark.gpu
@pytest.mark.parametrize("kind,nq", [("gdn", 1), ("qsa", 1), ("qsa", 4), ("gdn", 4)])
def test_graph_replay_is_the_eager_step_on_cuda(kind, nq, monkeypatch):
    """On a GPU, at the real widths (short history): a CUDA graph of the harness's step replays what the eager step
    computes (the states and caches it writes are rewritten the same each time; up to the MoE decode's atomic
    summation order), through the kernels (QSA decode, HC, the MoE decode kernels; fla's recurrence where fla is
    installed), and the census counts kernels."""
    from qwen4exp import envs
    from qwen4exp.ops import _registry
    from qwen4exp.ops.cuda_graph import capture

    monkeypatch.setenv("QWEN4EXP_MOE_DECODE", "1")
    envs.reset()  # (the autouse fixture forgets it again after the test)
    case = bench_layer.Case(bench_layer.text_config(tiny=False), kind, 1, nq, 3000, 2, 784, torch.bfloat16, "cuda")
    with _registry.record() as ran:
        case.step()
    expect = {"router_topk", "experts_nvfp4", "norm_rope_many"} if kind == "qsa" else {"router_topk", "experts_nvfp4"}
    if kind == "qsa":  # (the K|V rows, ring rows and block keys in one launch, at any queries a request)
        expect |= {"qsa_decode_paged", "qsa_decode_writes"}
    assert all(ran.get(op) == "kernel" for op in expect), ran
    if kind == "gdn":  # the states advance each eager step: compare replays with each other from one start
        snap = [(s.conv.clone(), s.ssm.clone()) for s in case.states]
    graph, out = capture(case.step)
    if kind == "gdn":
        for s, (c, h) in zip(case.states, snap):
            s.conv.copy_(c)
            s.ssm.copy_(h)
    eager = case.step().clone()
    if kind == "gdn":
        for s, (c, h) in zip(case.states, snap):
            s.conv.copy_(c)
            s.ssm.copy_(h)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    # (not bit for bit: the MoE decode's down projection sums its expert groups with fp32 atomics)
    rel = ((out.float() - eager.float()).norm() / eager.float().norm()).item()
    assert rel < 1e-2, rel
    kernels, ranked = bench_layer.census(case, graph, 2)
    assert kernels > 5 and ranked


def test_moe_slices_are_the_whole_batch(monkeypatch):
    """Past the MoE decode kernels' token limit the harness routes the batch in slices: the same output as one
    call over all tokens (the tokens are independent)."""
    from qwen4exp import envs
    from qwen4exp.ops.moe_decode import host as moe_host

    case = tiny_case("gdn", 3, 3, 8)  # 9 tokens: slices of MAX_TOKENS
    moe = case.layers[0].mlp
    x = torch.randn(9, case.config.hidden_size, generator=torch.Generator().manual_seed(1))
    assert x.shape[0] > moe_host.MAX_TOKENS
    monkeypatch.setenv("QWEN4EXP_MOE_DECODE", "0")
    envs.reset()
    whole = moe(x)
    monkeypatch.setenv("QWEN4EXP_MOE_DECODE", "1")
    envs.reset()
    torch.testing.assert_close(moe(x), whole, rtol=1e-6, atol=1e-6)
