"""``qwen4exp.ops.norm``: the zero-centred grouped RMSNorm. The op against a per-group loop (CPU: the reference; CUDA:
the kernel), what the kernel covers (``host``), the kernel against the reference at the model's sizes (GPU), and
the kernel under Triton's interpreter / compiled for sm_90 (no GPU)."""

from __future__ import annotations

import pytest
import torch

from op_helpers import BF, F32, bf16_close, expect_kernel, gen, poison, rnd
from qwen4exp import envs
from qwen4exp.ops import norm
from qwen4exp.ops.norm import host, reference as ref


def loop_grouped_rms_norm(x, w, group, eps):
    """Per row, per group of ``group`` elements: g / sqrt(mean(g^2) + eps) * (1 + w_g), in fp32."""
    x, w = x.float(), w.float()
    out = torch.empty_like(x)
    flat, fo = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    for t in range(flat.shape[0]):
        for s in range(0, x.shape[-1], group):
            seg = flat[t, s:s + group]
            fo[t, s:s + group] = seg / torch.sqrt((seg * seg).mean() + eps) * (1 + w[s:s + group])
    return out


# ------------------------------------------------------------------------------------- reference / op vs loop
@pytest.mark.parametrize("shape,group", [((3, 4 * 8), 8), ((2, 3, 32), 32), ((5, 2, 64), 32)])
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_grouped_rms_norm_matches_loop(device, shape, group, dtype):
    g = gen(sum(shape) + group)
    x, w = rnd(shape, g, 3.0, dtype).to(device), rnd(shape[-1:], g, 0.1, dtype).to(device)
    out = norm.grouped_rms_norm(x, w, group, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    tol = F32 if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)  # one bf16 rounding
    torch.testing.assert_close(out.float().cpu(), loop_grouped_rms_norm(x.cpu(), w.cpu(), group, 1e-6), **tol)


def test_strided_heads_match_loop(device):
    """Per-head norms of views into a wider projection output (the query slice of [q | gate])."""
    g = gen(3)
    qg = rnd((4, 3, 2 * 16), g, 2.0, torch.float32).to(device)
    w = rnd((16,), g, 0.1, torch.float32).to(device)
    out = norm.grouped_rms_norm(qg[..., :16], w, 16, 1e-6)
    torch.testing.assert_close(out.cpu(), loop_grouped_rms_norm(qg[..., :16].cpu(), w.cpu(), 16, 1e-6), **F32)


def test_cpu_runs_the_reference(monkeypatch):
    """The dispatcher: CPU tensors go to the reference; so does everything under QWEN4EXP_OPS=reference."""
    x, w = torch.randn(2, 8), torch.zeros(8)
    with pytest.raises(AssertionError, match="reference ran"):
        with expect_kernel("rms_norm"):
            norm.grouped_rms_norm(x, w, 8, 1e-6)
    assert norm.pick("rms_norm", torch.device("cpu"), ref.grouped_rms_norm) is ref.grouped_rms_norm
    monkeypatch.setenv("QWEN4EXP_OPS", "reference")
    envs.reset()
    try:
        assert norm.pick("rms_norm", torch.device("cuda"), ref.grouped_rms_norm) is ref.grouped_rms_norm
    finally:
        monkeypatch.delenv("QWEN4EXP_OPS")
        envs.reset()


# ------------------------------------------------------------------------------------------- what it covers
def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("x,w,group,want", [
    (meta(32, 24, 256), meta(256), 256, True),                     # QSA query heads
    (meta(5, 10240), meta(10240), 2560, True),                     # HC streams (4 x 2560)
    (meta(3, 640, dtype=torch.float32), meta(640, dtype=torch.float32), 640, True),
    (meta(3, 640, dtype=torch.float16), meta(640, dtype=torch.float16), 640, True),
    (meta(3, 640, dtype=torch.float64), meta(640, dtype=torch.float64), 640, False),  # no fp64 kernel
    (meta(2, 32768), meta(32768), 32768, False),                   # a group past MAX_GROUP
    (meta(2, 100), meta(100), 30, False),                          # groups must divide the width
    (meta(2, 64), meta(32), 32, False),                            # the weight spans the full width
    (meta(2, 64), meta(64, 2)[:, 0], 64, False),                   # a strided weight
    (meta(2, 64), meta(64), 0, False),
])
def test_kernel_covers(x, w, group, want):
    assert host.covers(x, w, group) is want


# ----------------------------------------------------------------------------------------- GPU vs reference
@pytest.mark.gpu
@pytest.mark.parametrize("shape,group", [((1, 24, 256), 256), ((32, 2, 256), 256), ((7, 4, 128), 128),
                                         ((5, 10240), 2560), ((3, 640), 640), ((1, 1, 128), 128)])
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_kernel_matches_reference(shape, group, dtype):
    g = gen(sum(shape) + group, "cuda")
    x = rnd(shape, g, 3.0, dtype)
    w = rnd((shape[-1],), g, 0.1, dtype)
    poison()
    with expect_kernel("rms_norm"):
        out = norm.grouped_rms_norm(x, w, group, 1e-6)
    want = ref.grouped_rms_norm(x, w, group, 1e-6)
    if dtype == BF:
        bf16_close(out, want, min_equal=0.99)
    else:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    qg = rnd((4, 3, 2 * 128), g, 1.0, dtype)  # the query slice of [q | gate] the QSA layer normalises
    with expect_kernel("rms_norm"):
        out = norm.grouped_rms_norm(qg[..., :128], w[:128], 128, 1e-6)
    torch.testing.assert_close(out, ref.grouped_rms_norm(qg[..., :128], w[:128], 128, 1e-6), rtol=1e-2, atol=2e-2)


# ----------------------------------------------------------------------------------- Triton checks (no GPU)
CHECKS = ("rms_norm", "rms_norm_strided", "norm_registration")


@pytest.mark.triton_check("rms_norm")
def test_interpreter_rms_norm(triton_checks):
    triton_checks.passed("rms_norm")


@pytest.mark.triton_check("rms_norm_strided")
def test_interpreter_rms_norm_strided_views(triton_checks):
    triton_checks.passed("rms_norm_strided")


@pytest.mark.triton_check("norm_registration")
def test_custom_op_schema_and_fake(triton_checks):
    triton_checks.passed("norm_registration")


@pytest.mark.triton_check(*CHECKS)
def test_kernel_compiles_for_hopper(triton_checks):
    triton_checks.compiled("_rms_norm_kernel")
