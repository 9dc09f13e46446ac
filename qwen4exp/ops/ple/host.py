"""The PLE CUDA path's host-side decisions: what each kernel covers, from shapes, dtypes and strides alone (no
Triton, no device checks), so that CPU tests check them. ``cuda.py`` adds the device checks (``*_supported``: rows
on the GPU, the table on the GPU or pinned on the host) and sends everything else to the torch reference."""

from __future__ import annotations

import torch

TABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def out_dtype_of(table, scale, out_dtype):
    """The lookups' output dtype: ``out_dtype`` if given, else the table's (bf16 when a scale dequantises it)."""
    return out_dtype or (table.dtype if scale is None else torch.bfloat16)


def lookup_covers(table, rows, scale, out_dtype) -> bool:
    """``ple_lookup_triton``: a 2-D table of rows with contiguous elements, a scalar scale, integer row ids, a
    bf16 / fp16 / fp32 output."""
    if table.dim() != 2 or table.dtype not in TABLE_DTYPES or table.stride(-1) != 1:
        return False
    if scale is not None and scale.numel() != 1:
        return False
    if rows.dtype not in (torch.int32, torch.int64) or rows.dim() < 1:
        return False
    return out_dtype_of(table, scale, out_dtype) in (torch.bfloat16, torch.float16, torch.float32)


def ngram_lookup_decode_covers(ids, prev) -> bool:
    """``ngram_lookup_decode_triton``'s shapes (the table: ``lookup_covers``): one id per sequence, integer
    contexts of 1-8 ids."""
    return (ids.dim() == 1 and prev.dim() == 2 and prev.shape[0] == ids.shape[0] and 1 <= prev.shape[1] <= 8
            and prev.stride(1) == 1 and not prev.dtype.is_floating_point and not ids.dtype.is_floating_point)


def ple_mix_decode_covers(H, k, v, qw, cw, wc, cu_seqlens, state, n: int) -> bool:
    """``ple_mix_decode_triton``: one token per sequence (no ``cu_seqlens``), bf16, a state, sizes within its
    blocks; prefill and mixed batches go to the reference."""
    if cu_seqlens is not None or state is None or H.dim() != 2 or n <= 0:
        return False
    T, nD = H.shape
    if nD % n or wc.dim() != 2 or state.dim() != 3:
        return False
    D, KS = nD // n, wc.shape[1]
    S = state.shape[2]
    bf = torch.bfloat16
    return (H.dtype == k.dtype == v.dtype == wc.dtype == bf and D <= 8192 and 1 <= KS <= 16 and 1 <= S <= 64
            and k.shape == (T, nD) and v.shape == (T, D) and state.shape[:2] == (T, nD) and wc.shape[0] == nD
            and qw.numel() == cw.numel() == nD and qw.is_contiguous() and cw.is_contiguous() and wc.is_contiguous()
            and H.stride(1) == k.stride(1) == v.stride(1) == state.stride(2) == 1
            and state.dtype in (bf, torch.float32))
