"""Helpers for packed variable-length batches: tokens of N sequences laid end to end, ``cu_seqlens`` [N+1]."""

from __future__ import annotations

import torch


def seq_lens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return cu_seqlens[1:] - cu_seqlens[:-1]


def pad_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int | None = None, value=0.0):
    """[T, ...] packed -> ([N, L, ...] right-padded, valid mask [N, L])."""
    lens = seq_lens(cu_seqlens)
    n = lens.numel()
    L = int(lens.max()) if max_len is None else max_len
    idx = torch.arange(L, device=x.device)
    valid = idx.unsqueeze(0) < lens.unsqueeze(1)
    out = x.new_full((n, L, *x.shape[1:]), value)
    out[valid] = x
    return out, valid
