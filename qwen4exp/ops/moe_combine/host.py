"""What the MoE output kernel covers, from shapes, dtypes and strides alone (no Triton, no device checks), so that
CPU tests check it; ``cuda.py`` adds the device check and sends the rest to the torch reference."""

from __future__ import annotations

import torch

MAX_D = 16384  # one token's row per program, held in registers as one power-of-two block


def covers(x, gate_weight, shared, routed) -> bool:
    """``shared_gate_combine_triton``: x, shared, routed of one shape and dtype (bf16 or fp32), hidden size up to
    MAX_D, a dense [1, D] gate weight of that dtype."""
    D = x.shape[-1]
    return (x.dtype in (torch.bfloat16, torch.float32) and gate_weight.dtype == x.dtype
            and shared.dtype == routed.dtype == x.dtype and 0 < D <= MAX_D and gate_weight.numel() == D
            and shared.shape == routed.shape == x.shape and gate_weight.is_contiguous())
