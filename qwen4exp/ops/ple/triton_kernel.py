"""Triton kernel for the PLE n-gram row gather with fused FP8 -> bf16 dequantisation. Imported only on the CUDA path.

The table may live in GPU memory or in page-locked (pinned) host memory: pinned host memory is mapped into the GPU's
unified address space, so the kernel reads the rows straight over the bus (UVA) without a staging copy; only the
T * G rows it needs cross it.  One program per (token, group of heads); each head row is d_g contiguous elements.
Rounding as the reference: bf16(float(row) * float(scale)); without a scale the rows are copied (cast to
``out_dtype`` if given).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ple_gather_kernel(TAB, ROWS, SCALE, scale_val, OUT, n_heads, stride_tab, stride_rows_t, stride_out_t,
                       SCALE_MODE: tl.constexpr, DG: tl.constexpr, DG_P: tl.constexpr, HB: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    offs_h = hb * HB + tl.arange(0, HB)
    hmask = offs_h < n_heads
    row = tl.load(ROWS + t * stride_rows_t + offs_h, mask=hmask, other=0).to(tl.int64)
    offs_d = tl.arange(0, DG_P)
    m2 = hmask[:, None] & (offs_d < DG)[None, :]
    x = tl.load(TAB + row[:, None] * stride_tab + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
    if SCALE_MODE == 1:  # scale tensor on the GPU
        x = x * tl.load(SCALE).to(tl.float32)
    elif SCALE_MODE == 2:  # scale held on the host: passed by value
        x = x * scale_val
    tl.store(OUT + t * stride_out_t + offs_h[:, None] * DG + offs_d[None, :], x.to(OUT.dtype.element_ty), mask=m2)


_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def supported(table, rows, scale, out_dtype) -> bool:
    if not rows.is_cuda or table.dim() != 2 or table.dtype not in _DTYPES or table.stride(-1) != 1:
        return False
    if not (table.is_cuda or (table.device.type == "cpu" and table.is_pinned())):
        return False
    if scale is not None and (scale.numel() != 1 or not (scale.is_cuda or scale.device.type == "cpu")):
        return False
    if rows.dtype not in (torch.int32, torch.int64) or rows.dim() < 1:
        return False
    dt = out_dtype or (table.dtype if scale is None else torch.bfloat16)
    return dt in (torch.bfloat16, torch.float16, torch.float32)


def ple_lookup_triton(table, rows, scale=None, out_dtype=None):
    """[..., G] row ids -> [..., G * d_g]; ``table`` on the GPU or pinned on the host (read through UVA)."""
    dt = out_dtype or (table.dtype if scale is None else torch.bfloat16)
    G = rows.shape[-1]
    DG = table.shape[1]
    rows2 = rows.reshape(-1, G)
    if rows2.stride(-1) != 1:
        rows2 = rows2.contiguous()
    T = rows2.shape[0]
    out = torch.empty(T, G * DG, dtype=dt, device=rows.device)
    mode, sc, sval = 0, out, 1.0
    if scale is not None and scale.is_cuda:
        mode, sc = 1, scale.reshape(1)
    elif scale is not None:  # a host scalar: read it here (no device sync), pass it by value
        mode, sval = 2, float(scale.float().reshape(()))
    if T and G:
        HB = min(16, triton.next_power_of_2(G))
        _ple_gather_kernel[(T, triton.cdiv(G, HB))](
            table, rows2, sc, sval, out, G, table.stride(0), rows2.stride(0), out.stride(0),
            SCALE_MODE=mode, DG=DG, DG_P=triton.next_power_of_2(DG), HB=HB, num_warps=4)
    return out.view(*rows.shape[:-1], G * DG)
