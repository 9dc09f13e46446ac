"""Triton kernel for partial rotate-half RoPE: one program per (token, head) row. Rounding as the reference in a
16-bit dtype: bf16(bf16(x * cos) + bf16(rot * sin)) on the first R dims, the rest copied. Imported only on the CUDA
path (``cuda.py``); what the kernels cover: ``host``. (The reference is ~6 kernels: slices, negate, two cats,
products and the sum.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import round_bf16
from ..triton_utils import rsqrt as _rsqrt


@triton.jit
def _round(x, ROUND: tl.constexpr):
    if ROUND:  # to bf16 where every op of the reference rounds
        x = round_bf16(x)
    return x


@triton.jit
def _rotate_store(x1, x2, COS, SIN, yp, t, stride_ct, o, m, half, ROUND: tl.constexpr):
    """The rotate-half of one row's rotary halves x1, x2 (fp32) with the token's cos/sin, stored at yp."""
    c1 = tl.load(COS + t * stride_ct + o, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(COS + t * stride_ct + half + o, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + t * stride_ct + o, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + t * stride_ct + half + o, mask=m, other=0.0).to(tl.float32)
    y1 = _round(_round(x1 * c1, ROUND) + _round(-x2 * s1, ROUND), ROUND)
    y2 = _round(_round(x2 * c2, ROUND) + _round(x1 * s2, ROUND), ROUND)
    tl.store(yp + o, y1.to(yp.dtype.element_ty), mask=m)
    tl.store(yp + half + o, y2.to(yp.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(X, COS, SIN, Y, H, R, D, stride_xt, stride_xh, stride_ct, stride_yt, stride_yh,
                 HALF_P: tl.constexpr, D_P: tl.constexpr, ROUND: tl.constexpr):
    pid = tl.program_id(0)
    t = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    half = R // 2
    o = tl.arange(0, HALF_P)
    m = o < half
    x1 = tl.load(X + t * stride_xt + h * stride_xh + o, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(X + t * stride_xt + h * stride_xh + half + o, mask=m, other=0.0).to(tl.float32)
    yp = Y + t * stride_yt + h * stride_yh
    _rotate_store(x1, x2, COS, SIN, yp, t, stride_ct, o, m, half, ROUND)
    p = R + tl.arange(0, D_P)
    pm = p < D
    tl.store(yp + p, tl.load(X + t * stride_xt + h * stride_xh + p, mask=pm, other=0.0), mask=pm)


@triton.jit
def _norm_rope_kernel(X, W, COS, SIN, Y, H, R, D, eps, inv_d, stride_xt, stride_xh, stride_ct, stride_yt, stride_yh,
                      HALF_P: tl.constexpr, D_P: tl.constexpr, FULL_P: tl.constexpr, ROUND: tl.constexpr):
    """One (token, head) row: the zero-centred RMS norm as ``_rms_norm_kernel`` (fp32, one rounding), then RoPE as
    ``_rope_kernel`` on the normed values; the row is read once from HBM (the partial loads hit L1)."""
    pid = tl.program_id(0)
    t = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    xrow = X + t * stride_xt + h * stride_xh
    f = tl.arange(0, FULL_P)
    xf = tl.load(xrow + f, mask=f < D, other=0.0).to(tl.float32)
    rstd = _rsqrt(tl.sum(xf * xf, axis=0) * inv_d + eps)
    half = R // 2
    o = tl.arange(0, HALF_P)
    m = o < half
    n1 = _round((tl.load(xrow + o, mask=m, other=0.0).to(tl.float32) * rstd)
                * (1.0 + tl.load(W + o, mask=m, other=0.0).to(tl.float32)), ROUND)
    n2 = _round((tl.load(xrow + half + o, mask=m, other=0.0).to(tl.float32) * rstd)
                * (1.0 + tl.load(W + half + o, mask=m, other=0.0).to(tl.float32)), ROUND)
    yp = Y + t * stride_yt + h * stride_yh
    _rotate_store(n1, n2, COS, SIN, yp, t, stride_ct, o, m, half, ROUND)
    p = R + tl.arange(0, D_P)
    pm = p < D
    npass = (tl.load(xrow + p, mask=pm, other=0.0).to(tl.float32) * rstd) * (1.0 + tl.load(W + p, mask=pm,
                                                                                          other=0.0).to(tl.float32))
    tl.store(yp + p, _round(npass, ROUND).to(Y.dtype.element_ty), mask=pm)


def apply_rope_triton(x, cos, sin):
    T, H, D = x.shape
    R = cos.shape[-1]
    y = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T * H:
        _rope_kernel[(T * H,)](x, cos, sin, y, H, R, D, x.stride(0), x.stride(1), cos.stride(0), y.stride(0),
                               y.stride(1), HALF_P=triton.next_power_of_2(max(R // 2, 1)),
                               D_P=triton.next_power_of_2(max(D - R, 1)), ROUND=x.dtype == torch.bfloat16,
                               num_warps=1 if D <= 256 else 4)  # one warp for a head of up to 256 elements
    return y


def norm_rope_triton(x, weight, eps: float, cos, sin):
    T, H, D = x.shape
    R = cos.shape[-1]
    y = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T * H:
        _norm_rope_kernel[(T * H,)](x, weight, cos, sin, y, H, R, D, float(eps), 1.0 / D, x.stride(0), x.stride(1),
                                    cos.stride(0), y.stride(0), y.stride(1),
                                    HALF_P=triton.next_power_of_2(max(R // 2, 1)),
                                    D_P=triton.next_power_of_2(max(D - R, 1)), FULL_P=triton.next_power_of_2(D),
                                    ROUND=x.dtype == torch.bfloat16,
                                    num_warps=1 if D <= 256 else 4)  # as _rope_kernel's
    return y
