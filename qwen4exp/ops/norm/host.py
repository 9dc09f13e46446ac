"""What the norm kernel covers, from shapes, dtypes and strides alone (no Triton, no device checks), so that CPU
tests check it; ``cuda.py`` adds the device check and sends the rest to the torch reference."""

from __future__ import annotations

import torch

MAX_GROUP = 16384  # one group per program, held in registers as one power-of-two block


def covers(x, weight, group: int) -> bool:
    """``rms_norm_triton``: 16/32-bit floats, groups up to MAX_GROUP dividing the last dim, a dense full-width
    weight (any layout of x whose last dim is dense or can be made so; see ``triton_kernel._rows3``)."""
    return (x.dtype in (torch.bfloat16, torch.float16, torch.float32) and 0 < group <= MAX_GROUP
            and x.shape[-1] % group == 0 and weight.numel() == x.shape[-1] and weight.is_contiguous())
