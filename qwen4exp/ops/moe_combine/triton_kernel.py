"""Triton kernel for the MoE output ``routed + sigmoid(x . w_gate) * shared``: one program per token does the gate's
dot product (fp32, rounded to the model dtype as the linear's output is), its sigmoid, the product and the sum, each
rounded where the reference rounds. Replaces a cuBLAS GEMV (two kernels), a sigmoid, a product and a sum per layer
at decode sizes. Imported only on the CUDA path (``cuda.py``; what it covers: ``host``). The dot product sums in
another order than cuBLAS, so a bf16 gate can differ by one unit now and then."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import exp as _exp
from ..triton_utils import round_bf16 as _rbf


@triton.jit
def _shared_gate_combine_kernel(X, W, S, R, Y, D, stride_x, stride_s, stride_r, stride_y, BLOCK: tl.constexpr,
                                BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(X + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(S + t * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.sum(x * w, axis=0)
    if BF16:
        g = _rbf(g)
    g = 1.0 / (1.0 + _exp(-g))
    if BF16:
        g = _rbf(g)
        y = _rbf(r + _rbf(g * s))
    else:
        y = r + g * s
    tl.store(Y + t * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


def shared_gate_combine_triton(x, gate_weight, shared, routed):
    D = x.shape[-1]
    x2, s2, r2 = (t.reshape(-1, D) for t in (x, shared, routed))
    x2, s2, r2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, s2, r2))
    y = torch.empty(r2.shape, dtype=routed.dtype, device=routed.device)
    T = x2.shape[0]
    if T:
        BLOCK = triton.next_power_of_2(D)
        _shared_gate_combine_kernel[(T,)](x2, gate_weight, s2, r2, y, D, x2.stride(0), s2.stride(0), r2.stride(0),
                                          y.stride(0), BLOCK=BLOCK, BF16=x.dtype == torch.bfloat16,
                                          num_warps=min(8, max(1, BLOCK // 512)))  # ~512 elements a warp
    return y.view(routed.shape)
