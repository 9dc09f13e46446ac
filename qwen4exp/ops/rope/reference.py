"""Rotate-half RoPE applied to the first R dims of every head (partial RoPE), in the activations' dtype."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d]; cos/sin [T, R] with R <= d. Rotates the first R dims (pairs i, i + R/2)."""
    R = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    xr, xp = x[..., :R], x[..., R:]
    x1, x2 = xr[..., : R // 2], xr[..., R // 2:]
    rot = torch.cat([-x2, x1], -1)
    return torch.cat([xr * c + rot * s, xp], -1)



def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of the zero-centred RMS norm of every head of x [T, H, d] (weight [d]): how the QSA layer prepares its
    queries and keys (one pass on GPUs instead of two)."""
    from ..norm.reference import grouped_rms_norm

    return apply_rope(grouped_rms_norm(x, weight, x.shape[-1], eps), cos, sin)


def norm_rope_many(groups, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """``norm_rope`` of each (x, weight, eps) of ``groups`` (tensors of the same tokens) with the same cos / sin: the
    QSA layer's queries, keys and indexer queries (one launch on GPUs)."""
    return [norm_rope(x, w, eps, cos, sin) for x, w, eps in groups]
