"""Triton helpers shared by the kernels (imported only on the CUDA path, or under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET", "0") == "1":  # the CPU interpreter (debugging only): no libdevice, no bf16 dot
    @triton.jit
    def exp(x):
        return tl.exp(x)

    @triton.jit
    def rsqrt(x):
        return 1.0 / tl.sqrt(x)

    @triton.jit
    def dot(a, b):
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
else:  # CUDA's expf / rsqrtf, which PyTorch's kernels call: the same bf16 rounding as the references
    from triton.language.extra import libdevice
    exp, rsqrt = libdevice.exp, libdevice.rsqrt

    @triton.jit
    def dot(a, b):
        return tl.dot(a, b)


@triton.jit
def sigmoid(x):
    """torch.sigmoid's fp32 formula, 1 / (1 + exp(-x)) with CUDA's expf and an IEEE division (unrounded)."""
    return tl.div_rn(1.0, 1.0 + exp(-x))


@triton.jit
def silu(x):
    """F.silu's fp32 formula, x / (1 + exp(-x)) with CUDA's expf and an IEEE division (unrounded)."""
    return tl.div_rn(x, 1.0 + exp(-x))


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 (ties to even), kept in fp32: the rounding point of a bf16 op in the torch references.
    Integer arithmetic, so the compiler cannot fold an fp32 -> bf16 -> fp32 round trip away (it did: a plain
    ``x.to(bf16).to(fp32)`` came out as x) and the CPU interpreter (which truncates casts) rounds the same way."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)
