"""``qwen4exp.ops.rope``: partial rotate-half RoPE and the per-head norm + RoPE (the QSA query / key preparation).
The ops against per-(token, head) loops (CPU: the references; CUDA: the kernels), what the kernels cover and the
norm + RoPE fallback (``host``), the kernels against the references at the model's sizes (GPU), the kernels under
Triton's interpreter / compiled for sm_90 (no GPU); and the cos / sin rows they read (``layers.rope``)."""

from __future__ import annotations

import pytest
import torch

from op_helpers import BF, bf16_close, expect_kernel, gen, poison, rnd
from qwen4exp import presets
from qwen4exp.layers.rope import RotaryEmbedding
from qwen4exp.ops import rope
from qwen4exp.ops.norm import reference as norm_ref
from qwen4exp.ops.rope import host, reference as ref


def loop_rope(x, cos, sin):
    """Per token t and head h: the first R dims as pairs (i, i + R/2) rotated by the token's angles,
    (x_i cos_i - x_{i+R/2} sin_i, x_{i+R/2} cos_{i+R/2} + x_i sin_{i+R/2}); the dims past R copied. fp32."""
    x, cos, sin = x.float(), cos.float(), sin.float()
    T, H, d = x.shape
    R = cos.shape[-1]
    out = x.clone()
    for t in range(T):
        for h in range(H):
            for i in range(R // 2):
                a, b = x[t, h, i], x[t, h, i + R // 2]
                out[t, h, i] = a * cos[t, i] - b * sin[t, i]
                out[t, h, i + R // 2] = b * cos[t, i + R // 2] + a * sin[t, i + R // 2]
    return out


def loop_head_norm(x, w, eps):
    """Per token and head: x / sqrt(mean(x^2) + eps) * (1 + w), fp32."""
    x, w = x.float(), w.float()
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            out[t, h] = x[t, h] / torch.sqrt((x[t, h] ** 2).mean() + eps) * (1 + w)
    return out


def angles(g, T, R, dtype, scale=1.0):
    ang = torch.randn(T, R // 2, generator=g, device=g.device) * scale
    return torch.cat([ang, ang], -1).cos().to(dtype), torch.cat([ang, ang], -1).sin().to(dtype)


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), BF: dict(rtol=2e-2, atol=3e-2)}  # bf16: each op rounded


# ------------------------------------------------------------------------------------- references / ops vs loops
@pytest.mark.parametrize("d,R", [(16, 8), (16, 16), (12, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_apply_rope_matches_loop(device, d, R, dtype):
    g = gen(d + R)
    x = rnd((4, 3, 2 * d), g, 1.0, dtype)[..., :d]  # strided, as q out of [q | gate]
    cos, sin = angles(g, 4, R, dtype, 3.0)
    out = rope.apply_rope(x.to(device), cos.to(device), sin.to(device))
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float().cpu(), loop_rope(x, cos, sin), **TOL[dtype])
    assert torch.equal(out[..., R:].cpu(), x[..., R:])  # past R: copied


@pytest.mark.parametrize("d,R", [(16, 8), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_norm_rope_matches_loop(device, d, R, dtype):
    """``norm_rope`` = RoPE of the per-head zero-centred norm, against the two loops (strided heads); past R the
    normed values."""
    g = gen(5 + d + R)
    x = rnd((4, 3, 2 * d), g, 3.0, dtype)[..., :d]
    w = rnd((d,), g, 0.1, dtype)
    cos, sin = angles(g, 4, R, dtype)
    out = rope.norm_rope(x.to(device), w.to(device), 1e-6, cos.to(device), sin.to(device)).cpu()
    normed = loop_head_norm(x, w, 1e-6)
    torch.testing.assert_close(out.float(), loop_rope(normed, cos, sin), **TOL[dtype])
    torch.testing.assert_close(out[..., R:].float(), normed[..., R:], **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_norm_then_rope_fallback_matches_loop(dtype):
    """``host.norm_then_rope`` (``cuda.norm_rope`` where its one kernel does not cover the call) with the references
    as its pieces: the norm then RoPE, against the loops."""
    g = gen(9)
    x = rnd((5, 2, 16), g, 3.0, dtype)
    w = rnd((16,), g, 0.1, dtype)
    cos, sin = angles(g, 5, 8, dtype)
    out = host.norm_then_rope(x, w, 1e-6, cos, sin, rms_norm=norm_ref.grouped_rms_norm, apply_rope=ref.apply_rope)
    torch.testing.assert_close(out.float(), loop_rope(loop_head_norm(x, w, 1e-6), cos, sin), **TOL[dtype])


# ------------------------------------------------------------------------------------------- what they cover
def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


QG = meta(32, 24, 2 * 256)[..., :256]  # the query slice of [q | gate]
COS = meta(32, 64)


@pytest.mark.parametrize("x,cos,sin,want", [
    (QG, COS, COS, True),
    (meta(1, 2, 256), meta(1, 256), meta(1, 256), True),                            # R = d
    (meta(3, 4, 128, dtype=torch.float32), meta(3, 64, dtype=torch.float32), meta(3, 64, dtype=torch.float32),
     True),
    (meta(3, 4, 128, dtype=torch.float16), meta(3, 64, dtype=torch.float16), meta(3, 64, dtype=torch.float16),
     False),                                                                         # no fp16 kernel
    (meta(3, 4, 128), meta(3, 64, dtype=torch.float32), meta(3, 64, dtype=torch.float32), False),  # mixed dtypes
    (meta(3, 4, 128), meta(3, 63), meta(3, 63), False),                             # odd R
    (meta(3, 4, 128), meta(3, 130), meta(3, 130), False),                           # R > d
    (meta(3, 4, 128), meta(2, 64), meta(2, 64), False),                             # a row per token
    (meta(3, 512), meta(3, 64), meta(3, 64), False),                                # [T, H, d] only
    (meta(3, 4, 256)[..., ::2], meta(3, 64), meta(3, 64), False),                   # last dim not dense
    (meta(3, 4, 128), meta(3, 128)[:, :64], meta(3, 64), False),                    # cos / sin rows alike
])
def test_kernels_cover(x, cos, sin, want):
    assert host.covers(x, cos, sin) is want
    assert host.norm_rope_covers(x, meta(x.shape[-1], dtype=x.dtype), cos, sin) is want


def test_norm_rope_covers_needs_a_dense_head_weight():
    assert not host.norm_rope_covers(QG, meta(128), COS, COS)
    assert not host.norm_rope_covers(QG, meta(256, 2)[:, 0], COS, COS)
    assert not host.norm_rope_covers(QG, meta(1, 256), COS, COS)


# ----------------------------------------------------------------------------------------- GPU vs reference
@pytest.mark.gpu
@pytest.mark.parametrize("T,H,D,R", [(1, 24, 256, 64), (32, 2, 256, 64), (5, 4, 128, 32), (3, 1, 128, 128)])
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_apply_rope_kernel_matches_reference(T, H, D, R, dtype):
    g = gen(T * H + D + R, "cuda")
    x = rnd((T, H, 2 * D), g, 1.0, dtype)[..., :D]  # strided, as q out of [q | gate]
    cos, sin = angles(g, T, R, dtype, 50.0)
    poison()
    with expect_kernel("apply_rope"):
        out = rope.apply_rope(x, cos, sin)
    want = ref.apply_rope(x, cos, sin)
    if dtype == BF:  # every rounding point of the reference reproduced
        assert torch.equal(out, want)
    else:  # fp32: the compiler may contract x*cos + rot*sin into an FMA
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,D,R", [(1, 24, 256, 64), (32, 2, 256, 64), (32, 4, 128, 64), (3, 1, 128, 128)])
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_norm_rope_kernel_matches_reference(T, H, D, R, dtype):
    """The QSA query / key preparation in one kernel (norm + RoPE of strided heads) = the norm kernel then the RoPE
    kernel (same rounding points), and the reference up to the norm's summation order."""
    from qwen4exp.ops.norm import cuda as norm_cuda
    from qwen4exp.ops.rope import cuda as rope_cuda
    g = gen(T * H + D + R + 7, "cuda")
    x = rnd((T, H, 2 * D), g, 3.0, dtype)[..., :D]
    w = rnd((D,), g, 0.1, dtype)
    cos, sin = angles(g, T, R, dtype, 50.0)
    poison()
    with expect_kernel("norm_rope"):
        out = rope.norm_rope(x, w, 1e-6, cos, sin)
    with expect_kernel("rms_norm", "apply_rope"):
        two = rope_cuda.apply_rope(norm_cuda.rms_norm(x, w, D, 1e-6), cos, sin)
    want = ref.norm_rope(x, w, 1e-6, cos, sin)
    if dtype == BF:
        assert torch.equal(out, two)  # the same reduction shape as the norm kernel: the same rstd
        bf16_close(out, want, 0.98)
    else:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 32])
def test_norm_rope_many_is_one_launch_of_the_three(T):
    """The QSA layer's shapes at the real widths (queries a strided view of [q | gate], 24 x 256; keys 2 x 256;
    indexer queries 4 x 128): ``norm_rope_many`` runs the three in one kernel, each output bit-equal to its own
    ``norm_rope`` kernel; a group the kernel does not take sends all three to ``norm_rope``."""
    g = gen(T + 13, "cuda")
    q = rnd((T, 24, 512), g, 3.0)[..., :256]
    k, iq = rnd((T, 2, 256), g, 2.0), rnd((T, 4, 128), g, 1.0)
    ws = [rnd((d,), g, 0.1) for d in (256, 256, 128)]
    cos, sin = angles(g, T, 64, BF, 50.0)
    groups = list(zip((q, k, iq), ws, (1e-6, 1e-6, 1e-6)))
    poison()
    with expect_kernel("norm_rope_many"):
        got = rope.norm_rope_many(groups, cos, sin)
    for y, (x, w, e) in zip(got, groups):
        assert torch.equal(y, rope.norm_rope(x, w, e, cos, sin))
    strided_w = rnd((128, 2), g, 0.1)[:, 0]
    with expect_kernel("apply_rope") as ran:
        rope.norm_rope_many(groups[:2] + [(iq, strided_w, 1e-6)], cos, sin)
    assert "norm_rope_many" not in ran


@pytest.mark.gpu
def test_norm_rope_fallback_runs_the_two_kernels():
    """A weight the fused kernel does not take (strided): ``norm_rope`` runs the norm kernel, then the RoPE kernel."""
    g = gen(11, "cuda")
    x = rnd((3, 4, 128), g, 3.0)
    w = rnd((128, 2), g, 0.1)[:, 0]
    cos, sin = angles(g, 3, 64, BF, 50.0)
    with expect_kernel("apply_rope") as ran:
        out = rope.norm_rope(x, w, 1e-6, cos, sin)
    assert "norm_rope" not in ran
    bf16_close(out, ref.norm_rope(x, w, 1e-6, cos, sin), 0.98)


# ----------------------------------------------------------------------------------- Triton checks (no GPU)
CHECKS = ("apply_rope", "norm_rope", "norm_rope3", "rope_registration")


@pytest.mark.triton_check("apply_rope")
def test_interpreter_apply_rope(triton_checks):
    triton_checks.passed("apply_rope")


@pytest.mark.triton_check("norm_rope")
def test_interpreter_norm_rope(triton_checks):
    triton_checks.passed("norm_rope")


@pytest.mark.triton_check("norm_rope3")
def test_interpreter_norm_rope3(triton_checks):
    triton_checks.passed("norm_rope3")


@pytest.mark.triton_check("rope_registration")
def test_custom_ops_schemas_and_fakes(triton_checks):
    triton_checks.passed("rope_registration")


@pytest.mark.triton_check(*CHECKS)
@pytest.mark.parametrize("kernel", ["_rope_kernel", "_norm_rope_kernel", "_norm_rope3_kernel"])
def test_kernels_compile_for_hopper(triton_checks, kernel):
    triton_checks.compiled(kernel)


# ----------------------------------------------------------------------------- cos / sin rows (layers.rope)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_equal_the_formula(dtype):
    """``layers.rope.RotaryEmbedding``: the precomputed cos / sin rows (``use_table``, the vLLM runtime's) give the
    values of the on-the-fly formula bit for bit, for text positions and for three-axis (t, h, w) positions."""
    cfg = presets.tiny_text()
    plain, tabled = RotaryEmbedding(cfg), RotaryEmbedding(cfg)
    tabled.use_table(5000)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 5000, (37,), generator=g)  # unordered, repeats
    for want, got in zip(plain(pos, dtype), tabled(pos, dtype)):
        assert got.dtype == dtype and got.shape == (37, plain.rotary_dim)
        assert torch.equal(got, want)
    pos3 = torch.stack([pos, torch.randint(0, 5000, (37,), generator=g), torch.randint(0, 50, (37,), generator=g)])
    for want, got in zip(plain(pos3, dtype), tabled(pos3, dtype)):  # each column from its frequency's axis
        assert torch.equal(got, want)
    assert not torch.equal(plain(pos3, dtype)[0], plain(pos, dtype)[0])  # (the axes really differ here)


def test_positions_past_the_table_are_an_error_not_a_wrong_row():
    rot = RotaryEmbedding(presets.tiny_text())
    rot.use_table(100)
    with pytest.raises(IndexError):
        rot(torch.tensor([3, 100]), torch.float32)
