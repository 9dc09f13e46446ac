"""The MoE output: routed experts plus the gated shared expert, ``routed + sigmoid(x . w_gate) * shared``
(``qwen4exp.layers.moe.MoE``), in the model dtype op by op: the gate's linear output, its sigmoid, the product and
the sum each rounded, as the HF reference computes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def shared_gate_combine(x: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor,
                        routed: torch.Tensor) -> torch.Tensor:
    """x, shared, routed [..., D]; gate_weight [1, D] -> [..., D]."""
    return routed + torch.sigmoid(F.linear(x, gate_weight)) * shared
