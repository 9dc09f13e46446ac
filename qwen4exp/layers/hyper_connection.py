"""The gated 4-stream residual (hyper-connection) around every block, and the final mixer."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.hyper_connection import hc_inject, hc_inject_norm, hc_mix
from .linear import LinearFactory, default_linear, linear_weight
from .norms import RMSNorm


class HyperConnection(nn.Module):
    """``forward(H) -> (x, c)``: the block input and the n injection weights (``c`` is None for the final mixer).
    ``inject(H, c, y)`` writes the block output back into every stream; ``inject_norm`` does that and normalises
    the new streams for this mixer (``forward(H, Hn)`` then skips its norm)."""

    def __init__(self, config, inject: bool = True, linear: LinearFactory = default_linear, prefix: str = ""):
        super().__init__()
        n, D = config.hc_count, config.hidden_size
        self.n, self.eps = n, config.rms_norm_eps
        self.hc_norm = RMSNorm(n * D, eps=config.rms_norm_eps, group=D)
        self.input_mix_weight_down = linear(n * D, config.hc_lowrank, prefix=f"{prefix}.input_mix_weight_down")
        self.input_mix_weight_up = linear(config.hc_lowrank, n * D, prefix=f"{prefix}.input_mix_weight_up")
        self.block_inject_weight = (linear(n * D, n, prefix=f"{prefix}.block_inject_weight") if inject else None)

    def forward(self, H: torch.Tensor, Hn: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        mods = (self.input_mix_weight_down, self.input_mix_weight_up, self.block_inject_weight)
        down, up, inj = (None if m is None else (linear_weight(m) if linear_weight(m) is not None else m)
                         for m in mods)
        return hc_mix(H, self.hc_norm.weight, down, up, inj, self.n, self.eps, Hn)

    def inject_norm(self, H: torch.Tensor, c: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous block's write-back, then this mixer's norm of the new streams: (H', Hn') for forward."""
        return hc_inject_norm(H, c, y, self.hc_norm.weight, self.n, self.eps)

    @staticmethod
    def inject(H: torch.Tensor, c: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return hc_inject(H, c, y)
