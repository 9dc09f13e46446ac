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
def _norm_rope_row(xrow, W, COS, SIN, yp, t, R, D, eps, inv_d, stride_ct, HALF_P: tl.constexpr, D_P: tl.constexpr,
                   FULL_P: tl.constexpr, ROUND: tl.constexpr):
    """One (token, head) row at ``xrow`` -> ``yp``: the zero-centred RMS norm as ``_rms_norm_kernel`` (fp32, one
    rounding), then RoPE as ``_rope_kernel`` on the normed values; the row is read once from HBM (the partial loads
    hit L1)."""
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
    _rotate_store(n1, n2, COS, SIN, yp, t, stride_ct, o, m, half, ROUND)
    p = R + tl.arange(0, D_P)
    pm = p < D
    npass = (tl.load(xrow + p, mask=pm, other=0.0).to(tl.float32) * rstd) * (1.0 + tl.load(W + p, mask=pm,
                                                                                          other=0.0).to(tl.float32))
    tl.store(yp + p, _round(npass, ROUND).to(yp.dtype.element_ty), mask=pm)


@triton.jit
def _norm_rope_kernel(X, W, COS, SIN, Y, H, R, D, eps, inv_d, stride_xt, stride_xh, stride_ct, stride_yt, stride_yh,
                      HALF_P: tl.constexpr, D_P: tl.constexpr, FULL_P: tl.constexpr, ROUND: tl.constexpr):
    """One program per (token, head) row (``_norm_rope_row``)."""
    pid = tl.program_id(0)
    t = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    _norm_rope_row(X + t * stride_xt + h * stride_xh, W, COS, SIN, Y + t * stride_yt + h * stride_yh, t, R, D, eps,
                   inv_d, stride_ct, HALF_P, D_P, FULL_P, ROUND)


@triton.jit
def _norm_rope3_kernel(X0, W0, Y0, X1, W1, Y1, X2, W2, Y2, COS, SIN, H0, H1, R, D0, D1, D2, eps0, eps1, eps2,
                       inv0, inv1, inv2, sx0t, sx0h, sy0t, sy0h, sx1t, sx1h, sy1t, sy1h, sx2t, sx2h, sy2t, sy2h,
                       stride_ct, HALF_P: tl.constexpr, DP0: tl.constexpr, FP0: tl.constexpr, DP1: tl.constexpr,
                       FP1: tl.constexpr, DP2: tl.constexpr, FP2: tl.constexpr, ROUND: tl.constexpr):
    """Three groups of heads of the same tokens (the QSA layer's queries, keys and indexer queries: three weights,
    head sizes and layouts, one cos / sin) in ONE launch: grid (tokens, H0 + H1 + H2), each program one row of its
    group, computed as ``_norm_rope_kernel`` computes it."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < H0:
        g = h.to(tl.int64)
        _norm_rope_row(X0 + t * sx0t + g * sx0h, W0, COS, SIN, Y0 + t * sy0t + g * sy0h, t, R, D0, eps0, inv0,
                       stride_ct, HALF_P, DP0, FP0, ROUND)
    elif h < H0 + H1:
        g = (h - H0).to(tl.int64)
        _norm_rope_row(X1 + t * sx1t + g * sx1h, W1, COS, SIN, Y1 + t * sy1t + g * sy1h, t, R, D1, eps1, inv1,
                       stride_ct, HALF_P, DP1, FP1, ROUND)
    else:
        g = (h - H0 - H1).to(tl.int64)
        _norm_rope_row(X2 + t * sx2t + g * sx2h, W2, COS, SIN, Y2 + t * sy2t + g * sy2h, t, R, D2, eps2, inv2,
                       stride_ct, HALF_P, DP2, FP2, ROUND)


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


def norm_rope3_triton(x0, w0, eps0: float, x1, w1, eps1: float, x2, w2, eps2: float, cos, sin):
    """``norm_rope_triton`` of three [T, H_i, d_i] tensors of the same tokens and dtype, sharing cos / sin, in one
    launch -> (y0, y1, y2), each equal to its own ``norm_rope_triton`` bit for bit."""
    xs, ws, eps = (x0, x1, x2), (w0, w1, w2), (float(eps0), float(eps1), float(eps2))
    T = x0.shape[0]
    R = cos.shape[-1]
    ys = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    H = [x.shape[1] for x in xs]
    D = [x.shape[2] for x in xs]
    if T and sum(H):
        strides = [s for x, y in zip(xs, ys) for s in (x.stride(0), x.stride(1), y.stride(0), y.stride(1))]
        pads = [p for d in D for p in (triton.next_power_of_2(max(d - R, 1)), triton.next_power_of_2(d))]
        _norm_rope3_kernel[(T, sum(H))](
            x0, w0, ys[0], x1, w1, ys[1], x2, w2, ys[2], cos, sin, H[0], H[1], R, *D, *eps, *(1.0 / d for d in D),
            *strides, cos.stride(0), HALF_P=triton.next_power_of_2(max(R // 2, 1)), DP0=pads[0], FP0=pads[1],
            DP1=pads[2], FP1=pads[3], DP2=pads[4], FP2=pads[5], ROUND=x0.dtype == torch.bfloat16,
            num_warps=1 if max(D) <= 256 else 4)
    return ys[0], ys[1], ys[2]
