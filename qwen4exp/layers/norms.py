"""Norms. Text norms are zero-centred (y = x_hat * (1 + w)), computed in fp32 and cast back once; the GDN output norm
uses a plain weight and a gate. Grouped norms (HC, PLE) take the mean square per stream of width ``group``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.norm import grouped_rms_norm


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm; with ``group`` the statistic is per group of that many elements."""

    def __init__(self, dim: int, eps: float = 1e-6, group: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.group = group or dim
        if dim % self.group:
            raise ValueError(f"RMSNorm: dim {dim} is not a multiple of group {self.group}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_rms_norm(x, self.weight, self.group, self.eps)


class GatedRMSNorm(nn.Module):
    """out = w * norm(x) (cast to x's dtype) * act(z), act = sigmoid or silu; plain weight (init 1)."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "sigmoid"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        if activation not in ("sigmoid", "silu"):
            raise ValueError(f"GatedRMSNorm: activation must be sigmoid or silu, got {activation!r}")
        self.activation = activation

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x.float()
        h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dt)
        h = self.weight * h
        zf = z.float()
        gate = torch.sigmoid(zf) if self.activation == "sigmoid" else F.silu(zf)
        return (h * gate).to(dt)
