"""The gated delta rule on CUDA through flash-linear-attention (``fla-core``, the ``gpu`` extra): its chunked kernels
for prefill chunks and its fused recurrent kernel for decode, called on our packed [T, H, d] layout as one batch row
with ``cu_seqlens``. Same conventions as ``reference``: q / k L2-normalised in the kernel, value head h reads key head
h // (H_v / H_k), fp32 states [N, H_v, d_k, d_v]; nothing new is written here, only the call is adapted. Plain torch
(fla itself is imported by ``cuda.py``), so CPU tests check ``covers``."""

from __future__ import annotations

import torch


def covers(q, k, v, g, beta) -> bool:
    """What fla's kernels take, from shapes and dtypes alone (no device checks): [T, H, d] q / k / v of one 16/32-bit
    float dtype, value heads a multiple of the key heads, head sizes up to 256."""
    hk, hv = k.shape[-2], v.shape[-2]
    return (q.dtype in (torch.bfloat16, torch.float16, torch.float32) and q.dtype == k.dtype == v.dtype
            and q.dim() == 3 and hk > 0 and hv % hk == 0 and q.shape[-1] <= 256 and v.shape[-1] <= 256)


def run(fn, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    """One fla call over all sequences: ([T, H_v, d_v] in v's dtype, final states [N, H_v, d_k, d_v] fp32)."""
    N, hv, dk, dv = cu_seqlens.numel() - 1, v.shape[-2], q.shape[-1], v.shape[-1]
    h0 = (initial_state.float().contiguous() if initial_state is not None
          else q.new_zeros((N, hv, dk, dv), dtype=torch.float32))
    o, ht = fn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g=g.float().unsqueeze(0),
               beta=beta.to(q.dtype).unsqueeze(0), scale=scale if scale is not None else dk ** -0.5,
               initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
               cu_seqlens=cu_seqlens.long())
    return o[0].to(v.dtype), ht.float()
