"""Zero-centred RMSNorm (the text model's norms): y = x / rms(x) * (1 + w), fp32 math, one rounding at the end.
With ``group`` the mean square is taken per group of that many elements (the HC and PLE grouped norms: one
statistic per stream) while the weight spans the full width."""

from __future__ import annotations

import torch


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm with the mean square taken per ``group`` elements; weight spans the full width."""
    xf = x.float().unflatten(-1, (-1, group))
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (y * (1.0 + weight.float())).to(x.dtype)
