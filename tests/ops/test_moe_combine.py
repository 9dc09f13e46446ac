"""``qwen4exp.ops.moe_combine``: the MoE output ``routed + sigmoid(x . w_gate) * shared``. The op against a per-token
loop (CPU: the reference; CUDA: the kernel), what the kernel covers (``host``), the kernel against the reference at
the model's sizes (GPU), and the kernel under Triton's interpreter / compiled for sm_90 (no GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from op_helpers import BF, bf16_close, expect_kernel, gen, poison, rnd
from qwen4exp.ops import moe_combine
from qwen4exp.ops.moe_combine import host, reference as ref


def loop_shared_gate_combine(x, w, shared, routed):
    """Per token: routed + sigmoid(sum_i x_i w_i) * shared, fp32."""
    x, w, shared, routed = (t.float() for t in (x, w, shared, routed))
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty(flat.shape)
    for t, (xt, st, rt) in enumerate(zip(flat, shared.reshape(flat.shape), routed.reshape(flat.shape))):
        gate = 1 / (1 + math.exp(-float((xt * w[0]).sum())))
        out[t] = rt + gate * st
    return out.view(x.shape)


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_shared_gate_combine_matches_loop(device, shape, dtype):
    g = gen(sum(shape))
    x, s, r = (rnd(shape, g, 1.0, dtype) for _ in range(3))
    w = rnd((1, shape[-1]), g, shape[-1] ** -0.5, dtype)
    out = moe_combine.shared_gate_combine(*(t.to(device) for t in (x, w, s, r))).cpu()
    assert out.dtype == dtype and out.shape == x.shape
    # bf16: the gate's linear output, its sigmoid, the product and the sum each rounded, as the HF reference does
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(out.float(), loop_shared_gate_combine(x, w, s, r), **tol)


def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("x,w,s,r,want", [
    (meta(32, 2560), meta(1, 2560), meta(32, 2560), meta(32, 2560), True),
    (meta(2, 3, 100, dtype=torch.float32), meta(1, 100, dtype=torch.float32), meta(2, 3, 100, dtype=torch.float32),
     meta(2, 3, 100, dtype=torch.float32), True),
    (meta(2, 64, dtype=torch.float16), meta(1, 64, dtype=torch.float16), meta(2, 64, dtype=torch.float16),
     meta(2, 64, dtype=torch.float16), False),                                            # no fp16 kernel
    (meta(2, 64), meta(1, 64, dtype=torch.float32), meta(2, 64), meta(2, 64), False),     # mixed dtypes
    (meta(2, 32768), meta(1, 32768), meta(2, 32768), meta(2, 32768), False),              # past MAX_D
    (meta(2, 64), meta(1, 64), meta(1, 64).expand(2, 64), meta(2, 64), True),             # a broadcast row (stride 0)
    (meta(2, 64), meta(1, 64), meta(2, 1, 64), meta(2, 64), False),                       # shapes differ
    (meta(2, 64), meta(1, 128)[:, ::2], meta(2, 64), meta(2, 64), False),                 # strided gate weight
])
def test_kernel_covers(x, w, s, r, want):
    assert host.covers(x, w, s, r) is want


@pytest.mark.gpu
@pytest.mark.parametrize("T,D", [(1, 2560), (32, 2560), (5, 640), (3, 100)])
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_kernel_matches_reference(T, D, dtype):
    """The kernel = the reference's op-by-op rounding, up to a one-unit difference of the gate where the dot
    product sums in another order."""
    g = gen(T * D, "cuda")
    x, s, r = rnd((T, D), g, 1.0, dtype), rnd((T, D), g, 1.0, dtype), rnd((T, D), g, 1.0, dtype)
    w = rnd((1, D), g, D ** -0.5, dtype)
    poison()
    with expect_kernel("shared_gate_combine"):
        out = moe_combine.shared_gate_combine(x, w, s, r)
    want = ref.shared_gate_combine(x, w, s, r)
    if dtype == BF:
        bf16_close(out, want, min_equal=0.98)
    else:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.triton_check("moe_combine")
def test_interpreter_shared_gate_combine(triton_checks):
    triton_checks.passed("moe_combine")


@pytest.mark.triton_check("moe_combine_registration")
def test_custom_op_schema_and_fake(triton_checks):
    triton_checks.passed("moe_combine_registration")


@pytest.mark.triton_check("moe_combine", "moe_combine_registration")
def test_kernel_compiles_for_hopper(triton_checks):
    triton_checks.compiled("_shared_gate_combine_kernel")
