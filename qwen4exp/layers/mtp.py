"""MTP (multi-token prediction) input fusion: the draft layer's multi-stream input from the target's pre-mixer
state H [T, nD] and the embedding e [T, D] of the next token.

    e' = W_fce ZCNorm_D(e);  H^ = ZCNorm over all nD elements jointly;  h'_s = W_fch H^_s (one D x D matrix shared
    by the n streams);  H_in,s = h'_s + e'.
The draft layer itself is a full QSA decoder layer followed by its own final mixer (``modeling.DecoderLayer``).
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import LinearFactory, default_linear
from .norms import RMSNorm


class MTPInput(nn.Module):
    def __init__(self, config, linear: LinearFactory = default_linear, prefix: str = "mtp"):
        super().__init__()
        n, D = config.hc_count, config.hidden_size
        self.n, self.D = n, D
        self.pre_fc_norm_embedding = RMSNorm(D, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(n * D, eps=config.rms_norm_eps)  # one statistic over all nD
        self.fc_embedding = linear(D, D, prefix=f"{prefix}.fc_embedding")
        self.fc_hidden = linear(D, D, prefix=f"{prefix}.fc_hidden")

    def forward(self, embeds: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
        e = self.fc_embedding(self.pre_fc_norm_embedding(embeds))
        h = self.fc_hidden(self.pre_fc_norm_hidden(H).view(*H.shape[:-1], self.n, self.D))
        return (h + e.unsqueeze(-2)).flatten(-2)
