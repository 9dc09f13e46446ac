"""``qwen4exp.ops.moe_decode``: the MoE decode op (router GEMV + top-k; NVFP4 W4A16 routed experts) at M <= 4 tokens.
The reference against independent formulations (CPU), what the kernels cover and their launch plan (``host``), the
kernels against the reference at the model's sizes (GPU), and the kernels under Triton's interpreter / compiled for
sm_90 (no GPU; the checks: ``interpreter_moe_decode.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_decode_cases import BF, nvfp4_experts, routed_inputs, router_case
from op_helpers import expect_kernel, poison, rel
from qwen4exp import envs
from qwen4exp.ops import _registry
from qwen4exp.layers.moe import Experts, Router
from qwen4exp.ops import moe_decode
from qwen4exp.ops.moe_decode import host, reference as ref

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def dense_fp32(packed, scale, gs):
    """NVFP4 [E, out, in/2] -> fp32 [E, out, in], written out independently of qwen4exp.quant: each byte's low
    nibble is the even input, the high one the odd; a code's bit 3 is its sign, bits 0-2 index E2M1."""
    codes = torch.stack((packed.long() % 16, packed.long() // 16), -1).flatten(-2)
    mag = torch.tensor(E2M1)[codes % 8]
    val = torch.where(codes >= 8, -mag, mag)
    return val * scale.float().repeat_interleave(16, -1) * gs.float().reshape(-1, 1, 1)


def loop_experts(x, t, w, ids):
    """Per token, per selected expert: fp32 GEMVs on dense weights, SiLU(gate) * up rounded to x's dtype, the
    weighted sum in fp32, rounded once."""
    W13, W2 = dense_fp32(t["w13"], t["w13_scale"], t["w13_gs"]), dense_fp32(t["w2"], t["w2_scale"], t["w2_gs"])
    I = W2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for m in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[m, j])
            h = W13[e] @ x[m].float()
            a = (h[:I] / (1 + torch.exp(-h[:I])) * h[I:]).to(x.dtype).float()
            out[m] += float(w[m, j]) * (W2[e] @ a)
    return out.to(x.dtype)


def loop_router(x, weight, k):
    """Per token: logits rounded to x's dtype, softmax in float64, the k largest, renormalised."""
    out_w, out_ids = [], []
    for m in range(x.shape[0]):
        logits = [float((x[m].double() * weight[e].double()).sum().to(x.dtype)) for e in range(weight.shape[0])]
        mx = max(logits)
        p = [math.exp(v - mx) for v in logits]
        s = sum(p)
        order = sorted(range(len(p)), key=lambda e: -p[e])[:k]
        tot = sum(p[e] / s for e in order)
        out_w.append([p[e] / s / tot for e in order])
        out_ids.append(order)
    return torch.tensor(out_w), torch.tensor(out_ids)


def by_id(w, ids):
    """(weights, ids) of each token sorted by expert id: a comparison that ignores the order of equal weights."""
    order = ids.argsort(-1)
    return w.gather(-1, order), ids.gather(-1, order)


# -------------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("M,D,E,k", [(1, 256, 16, 4), (3, 128, 64, 10), (4, 256, 512, 10)])
def test_router_reference_matches_loop(M, D, E, k):
    x, w = router_case(M, D, E, k, seed=M)
    logits, tw, ids = ref.router_topk(x, w, k, True)
    assert logits.dtype == tw.dtype == BF and ids.shape == (M, k)
    lw, lids = loop_router(x, w, k)
    torch.testing.assert_close(by_id(tw.float(), ids)[1], by_id(lw.float(), lids)[1], rtol=0, atol=0)
    torch.testing.assert_close(by_id(tw.float(), ids)[0], by_id(lw.float(), lids)[0], rtol=2 ** -8, atol=1e-6)


def test_router_layer_uses_the_reference():
    """``layers.moe.Router`` selects through ``select_experts`` (one copy of the math): same outputs, both
    renormalised and not."""
    for norm in (True, False):
        cfg = type("C", (), dict(num_experts=32, hidden_size=64, num_experts_per_tok=6, norm_topk_prob=norm))
        r = Router(cfg)
        x, w = router_case(3, 64, 32, 6, seed=5)
        r.weight.data = w.float()
        logits, tw, ids = r(x.float())
        want = ref.router_topk(x.float(), w.float(), 6, norm)
        for a, b in zip((logits, tw, ids), want):
            assert torch.equal(a, b)
        assert torch.allclose(tw.sum(-1), torch.ones(3)) == norm


@pytest.mark.parametrize("M", [1, 2, 4])
def test_experts_reference_matches_loop(M):
    D, I, E, k = 256, 64, 16, 4
    t = nvfp4_experts(E, D, I, seed=M)
    x, w, ids = routed_inputs(M, D, k, E, seed=M)
    out = ref.experts_nvfp4(x, *t.values(), w, ids)
    assert out.dtype == BF and out.shape == (M, D)
    want = loop_experts(x, t, w, ids)
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=1e-3)


def test_experts_reference_matches_the_model_layer():
    """The HF layer (``layers.moe.Experts``) on the dequantized weights computes the same sum."""
    D, I, E, k, M = 128, 32, 8, 3, 4
    t = nvfp4_experts(E, D, I, seed=11)
    x, w, ids = routed_inputs(M, D, k, E, seed=11)
    cfg = type("C", (), dict(num_experts=E, hidden_size=D, moe_intermediate_size=I))
    layer = Experts(cfg)
    layer.gate_up_proj.data = dense_fp32(t["w13"], t["w13_scale"], t["w13_gs"])
    layer.down_proj.data = dense_fp32(t["w2"], t["w2_scale"], t["w2_gs"])
    torch.testing.assert_close(ref.experts_nvfp4(x, *t.values(), w, ids).float(), layer(x, w, ids).float(),
                               rtol=2 ** -7, atol=1e-3)


def test_experts_reference_fp32():
    D, I, E, k = 64, 32, 8, 2
    t = nvfp4_experts(E, D, I, seed=3)
    x, w, ids = routed_inputs(2, D, k, E, seed=3, dtype=torch.float32)
    torch.testing.assert_close(ref.experts_nvfp4(x, *t.values(), w, ids), loop_experts(x, t, w, ids),
                               rtol=1e-5, atol=1e-5)


def test_dispatch_on_cpu_is_the_reference():
    x, w = router_case(2, 64, 16, 4)
    assert all(torch.equal(a, b) for a, b in zip(moe_decode.router_topk(x, w, 4, True), ref.router_topk(x, w, 4, True)))
    t = nvfp4_experts(4, 64, 32)
    xx, tw, ids = routed_inputs(2, 64, 2, 4)
    assert torch.equal(moe_decode.experts_nvfp4(xx, *t.values(), tw, ids), ref.experts_nvfp4(xx, *t.values(), tw, ids))


# ------------------------------------------------------------------------------------------------------- host
def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("x,w,k,want", [
    (meta(1, 2560), meta(512, 2560), 10, True),
    (meta(4, 2560, dtype=torch.float32), meta(512, 2560, dtype=torch.float32), 10, True),
    (meta(5, 2560), meta(512, 2560), 10, False),                       # past MAX_TOKENS
    (meta(1, 2560), meta(2048, 2560), 10, False),                      # past MAX_EXPERTS
    (meta(1, 2560), meta(512, 2560), 0, False),
    (meta(1, 64), meta(16, 64), 17, False),                            # k > E
    (meta(1, 64, dtype=torch.float16), meta(16, 64, dtype=torch.float16), 4, False),
    (meta(1, 64), meta(16, 64, dtype=torch.float32), 4, False),        # mixed dtypes
    (meta(1, 64), meta(16, 128)[:, ::2], 4, False),                    # strided weight
])
def test_router_covers(x, w, k, want):
    assert host.router_covers(x, w, k) is want


def nvfp4_meta(E, D, I, gs_shape=None):
    u8, f8 = torch.uint8, torch.float8_e4m3fn
    return [meta(E, 2 * I, D // 2, dtype=u8), meta(E, 2 * I, D // 16, dtype=f8), meta(*(gs_shape or (E,)),
            dtype=torch.float32), meta(E, D, I // 2, dtype=u8), meta(E, D, I // 16, dtype=f8),
            meta(E, dtype=torch.float32)]


@pytest.mark.parametrize("M,dtype,E,D,I,k,ids_dtype,want", [
    (1, BF, 512, 2560, 640, 10, torch.int64, True),
    (4, BF, 512, 2560, 640, 10, torch.int32, True),
    (4, torch.float32, 16, 256, 64, 4, torch.int64, True),
    (5, BF, 512, 2560, 640, 10, torch.int64, False),                   # past MAX_TOKENS
    (1, torch.float16, 16, 256, 64, 4, torch.int64, False),
    (1, BF, 16, 256, 40, 4, torch.int64, False),                       # I not a multiple of 16
    (1, BF, 16, 256, 64, 4, torch.int16, False),
])
def test_experts_covers(M, dtype, E, D, I, k, ids_dtype, want):
    args = [meta(M, D, dtype=dtype), *nvfp4_meta(E, D, I), meta(M, k, dtype=dtype), meta(M, k, dtype=ids_dtype)]
    assert host.experts_covers(*args) is want


def test_experts_covers_layouts():
    M, E, D, I, k = 1, 16, 256, 64, 4
    good = [meta(M, D), *nvfp4_meta(E, D, I), meta(M, k), meta(M, k, dtype=torch.int64)]
    assert host.experts_covers(*good)
    bad = list(good)
    bad[3] = meta(E, 2, dtype=torch.float32)                           # vLLM's [E, 2] w13 global scales: take [:, 0]
    assert not host.experts_covers(*bad)
    bad = list(good)
    bad[1] = meta(E, D // 2, 2 * I, dtype=torch.uint8).transpose(1, 2)  # a transposed (non-contiguous) w13
    assert not host.experts_covers(*bad)
    bad = list(good)
    bad[2] = meta(E, 2 * I, D // 16, dtype=torch.float32)              # scales not e4m3
    assert not host.experts_covers(*bad)


def test_launch_plan():
    assert host.w2_groups(10, 5) == (5, 2) and host.w2_groups(10, 3) == (3, 4) and host.w2_groups(4, 16) == (4, 1)
    assert host.block_k(2560, 512) == 512 and host.block_k(640, 128) == 128 and host.block_k(64, 512) == 64
    assert host.block_k(48, 512) == 64 and host.block_k(16, 8) == 16


def test_switch_defaults_off():
    assert envs.SWITCHES["QWEN4EXP_MOE_DECODE"].default is False


# -------------------------------------------------------------------------------------------------------- GPU
@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setenv("QWEN4EXP_MOE_DECODE", "1")
    envs.reset()
    yield
    monkeypatch.delenv("QWEN4EXP_MOE_DECODE")
    envs.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 4])
def test_router_kernel_real_size(M, kernels_on):
    x, w = router_case(M, 2560, 512, 10, seed=M, device="cuda")
    poison()
    with expect_kernel("router_topk"):
        logits, tw, ids = moe_decode.router_topk(x, w, 10, True)
    rl, rw, rids = ref.router_topk(x, w, 10, True)
    torch.testing.assert_close(logits.float(), rl.float(), rtol=2 ** -7, atol=1e-2)
    kw, kid = by_id(tw.float(), ids.long())
    ww, wid = by_id(rw.float(), rids)
    assert torch.equal(kid, wid)
    torch.testing.assert_close(kw, ww, rtol=2 ** -7, atol=1e-3)


@pytest.fixture(scope="module")
def real_experts():
    """512 experts at the model's sizes, quantized once for the module (the quantizer runs on the CPU)."""
    return nvfp4_experts(512, 2560, 640, seed=7, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_experts_kernel_real_size(M, dtype, kernels_on, real_experts):
    E, D, I, k = 512, 2560, 640, 10
    t = real_experts
    x, w, ids = routed_inputs(M, D, k, E, seed=M, dtype=dtype, device="cuda")
    poison()
    with expect_kernel("experts_nvfp4"):
        out = moe_decode.experts_nvfp4(x, *t.values(), w, ids)
    want = ref.experts_nvfp4(x, *t.values(), w, ids)
    assert not torch.isnan(out).any()
    assert rel(out, want) < (1e-2 if dtype == BF else 1e-5)
    for _ in range(3):  # the split-K scratch resets itself: repeated calls give the same result
        torch.testing.assert_close(moe_decode.experts_nvfp4(x, *t.values(), w, ids), out, rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4])
def test_experts_kernel_in_a_cuda_graph(M, kernels_on, real_experts):
    """The router and the experts op captured in one CUDA graph after a first (warm-up) call, replayed on new
    inputs: no host -> device copy or allocation of scratch inside the capture, the tickets reset on each replay."""
    E, D, k = 512, 2560, 10
    x, W = router_case(M, D, E, k, seed=20 + M, device="cuda")
    t = real_experts

    def step():
        _, tw, ids = moe_decode.router_topk(x, W, k, True)
        return tw, ids, moe_decode.experts_nvfp4(x, *t.values(), tw, ids)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tw, ids, out = step()
    for seed in range(3):
        x.copy_(torch.randn(M, D, generator=torch.Generator().manual_seed(seed)).to(x.dtype))
        g.replay()
        torch.cuda.synchronize()
        assert rel(out, ref.experts_nvfp4(x, *t.values(), tw, ids)) < 1e-2


@pytest.mark.gpu
def test_kernels_follow_the_switch():
    x, w = router_case(1, 256, 16, 4, device="cuda")
    envs.reset()  # (the switch unset: off)
    with _registry.record() as ran:
        moe_decode.router_topk(x, w, 4, True)
    assert ran["router_topk"] == "reference"


# ------------------------------------------------------------------------------------------ Triton interpreter
@pytest.mark.triton_check("moe_decode_router")
def test_interpreter_router(triton_checks):
    triton_checks.passed("moe_decode_router")


@pytest.mark.triton_check("moe_decode_experts")
def test_interpreter_experts(triton_checks):
    triton_checks.passed("moe_decode_experts")


@pytest.mark.triton_check("moe_decode_capture_safe")
def test_wrappers_are_capture_safe(triton_checks):
    """The wrappers issue no op on a CPU tensor and, after the first call, only allocate outputs (CUDA graphs)."""
    triton_checks.passed("moe_decode_capture_safe")


@pytest.mark.triton_check("moe_decode_registration")
def test_custom_op_schema_and_fake(triton_checks):
    triton_checks.passed("moe_decode_registration")


@pytest.mark.triton_check("moe_decode_router")
def test_router_kernel_compiles_for_hopper(triton_checks):
    triton_checks.compiled("_router_topk_kernel")


@pytest.mark.triton_check("moe_decode_experts")
@pytest.mark.parametrize("kernel", ["_w13_silu_kernel", "_w2_combine_kernel"])
def test_expert_kernels_compile_for_hopper(triton_checks, kernel):
    triton_checks.compiled(kernel)


@pytest.mark.triton_check("moe_decode_router")
def test_kernels_compile_at_real_sizes(triton_checks):
    """The host's launches at 512 experts, top-10, hidden 2560, intermediate 640 (M = 1..4): sm_90, no spills."""
    triton_checks.compile_check("moe_decode_real_sizes")
