"""What the RoPE kernels cover, from shapes, dtypes and strides alone (no Triton, no device checks), and the norm +
RoPE fallback as a function of its two pieces, so that CPU tests check both with the references plugged in;
``cuda.py`` adds the device checks and plugs in its wrappers."""

from __future__ import annotations

import torch


def covers(x, cos, sin) -> bool:
    """``apply_rope_triton``: x [T, H, d] (last dim dense, any token / head strides) in bf16 or fp32, cos / sin
    [T, R] of x's dtype with an even R <= d (their rows may be strided, alike)."""
    if not (x.dim() == 3 and x.dtype == cos.dtype == sin.dtype and x.dtype in (torch.bfloat16, torch.float32)):
        return False
    R = cos.shape[-1]
    return (cos.dim() == sin.dim() == 2 and cos.shape == sin.shape and cos.shape[0] == x.shape[0] and R % 2 == 0
            and 0 < R <= x.shape[-1] and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride())


def norm_rope_covers(x, weight, cos, sin) -> bool:
    """``norm_rope_triton``: what ``apply_rope_triton`` covers, with a dense per-head weight [d]."""
    return covers(x, cos, sin) and weight.dim() == 1 and weight.numel() == x.shape[-1] and weight.is_contiguous()


def norm_rope3_covers(groups, cos, sin) -> bool:
    """``norm_rope3_triton``: three groups, each what ``norm_rope_triton`` covers (so all of cos' dtype)."""
    return len(groups) == 3 and all(norm_rope_covers(x, w, cos, sin) for x, w, _ in groups)


def norm_then_rope(x, weight, eps, cos, sin, *, rms_norm, apply_rope):
    """``norm_rope`` where its one kernel does not cover the call: the per-head norm, then RoPE (on CUDA each its
    own kernel where that one covers the call, else its reference)."""
    return apply_rope(rms_norm(x, weight, x.shape[-1], eps), cos, sin)
