"""Triton kernel for the zero-centred (grouped) RMSNorm: one program per group row, the reference's math (fp32,
rsqrt of the mean square + eps, times (1 + w), one rounding). Imported only on the CUDA path (``cuda.py``); what
it covers: ``host.covers``.

The torch reference is ~7 kernels per norm (upcast, square, mean, add, rsqrt, two products, cast); at decode sizes
each is a launch-bound ~1-2 us, and the QSA layers run four norms per token. Sums are taken in another order than
torch's mean, so a bf16 output can differ by one unit now and then.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import round_bf16 as _rbf
from ..triton_utils import rsqrt as _rsqrt


@triton.jit
def _rms_norm_kernel(X, W, Y, G, groups_per_w, eps, inv_g, n_inner, stride_outer, stride_inner, stride_y,
                     BLOCK: tl.constexpr, BF16: tl.constexpr):
    """Row r of the [rows, G] problem is X[r // n_inner, r % n_inner, :] of a [rows / n_inner, n_inner, G] strided
    view (e.g. the heads of a slice of a wider projection output); Y is dense."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < G
    x = tl.load(X + (row // n_inner) * stride_outer + (row % n_inner) * stride_inner + offs, mask=mask,
                other=0.0).to(tl.float32)
    rstd = _rsqrt(tl.sum(x * x, axis=0) * inv_g + eps)
    w = tl.load(W + (row % groups_per_w) * G + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd) * (1.0 + w)
    if BF16:
        y = _rbf(y)
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _rows3(x, group: int):
    """x [..., k * group] as a [outer, inner, group] view (last dim dense): the groups of the last dim and the
    dimension before it as the inner rows, everything further out merged (a copy only if those do not merge)."""
    v = x.unflatten(-1, (-1, group))  # [..., k, group]
    if v.shape[-2] == 1 and v.dim() > 2:
        v = v.squeeze(-2)  # [..., H, group]: a per-head norm
    if v.dim() == 2:
        v = v.unsqueeze(0)
    if v.dim() > 3:
        v = v.reshape(-1, *v.shape[-2:])
    return v if v.stride(-1) == 1 else v.contiguous()


def _row_strides(x3) -> tuple[int, int, int]:
    """(n_inner, stride_outer, stride_inner) of the launch over ``x3`` [outer, inner, group]: rows evenly spaced
    (a dense [tokens, heads, group] view, the [1, rows, group] of a plain norm, one inner row) go as ONE run of rows,
    n_inner = 1 and both strides the row stride, so that no argument depends on how many rows there are. (n_inner
    was the row count of a plain norm: the block keys a step completes, 1 or a count not a multiple of 16, each a
    variant of its own, compiled mid-serving.) Else (a strided [tokens, heads] slice of a wider output) the inner
    count and both strides: fixed by the layout."""
    outer, inner = x3.shape[0], x3.shape[1]
    so, si = x3.stride(0), x3.stride(1)
    if inner == 1:
        return 1, so, so
    if so == inner * si:
        return 1, si, si
    return inner, so, si


def rms_norm_triton(x, weight, group: int, eps: float):
    dim = x.shape[-1]
    x3 = _rows3(x, group)  # the layouts the layers pass are views: a slice of a wider projection output included
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x3.shape[0] * x3.shape[1]
    if rows:
        BLOCK = triton.next_power_of_2(group)
        n_inner, stride_outer, stride_inner = _row_strides(x3)
        _rms_norm_kernel[(rows,)](x3, weight, y, group, dim // group, float(eps), 1.0 / group, n_inner,
                                  stride_outer, stride_inner, group, BLOCK=BLOCK, BF16=x.dtype == torch.bfloat16,
                                  num_warps=min(16, max(1, BLOCK // 256)))  # ~256 elements a warp
    return y
