"""MoE decode (issue 50 item 3) as readable torch: the router's top-k selection and the NVFP4 W4A16 routed experts.

* ``select_experts``: the router's math (softmax in fp32, top-k, renormalised in fp32, cast to the logits' dtype),
  the one copy of it: ``qwen4exp.layers.moe.Router.select`` calls it.
* ``router_topk``: the router GEMV (``F.linear``, output in the activation dtype) then ``select_experts``.
* ``experts_nvfp4``: the routed experts from NVFP4 weights, each weight dequantized by ``qwen4exp.quant.nvfp4`` (the
  one source of the format; pure torch, no package imports) to fp32, with the precision contract of
  ``qwen4exp.layers.moe.Experts``: both projections accumulate in fp32, SiLU(gate) * up in fp32 rounded once to the
  model dtype (the down projection's input), the top-k combine summed in fp32 and rounded once at the end.

NVFP4 tensors, as vLLM's ModelOpt NVFP4 MoE method creates them before its ``process_weights_after_loading`` (each
backend then repacks or swizzles them; the kernels read this plain layout)::

    w13        uint8 [E, 2I, D/2]   gate rows 0..I-1, up rows I..2I-1; two E2M1 codes a byte (low nibble first)
    w13_scale  e4m3  [E, 2I, D/16]  one scale per 16 inputs
    w13_gs     fp32  [E]            per-expert global scale (weight_scale_2; gate and up share one, vLLM keeps
                                    shard 0 of its [E, 2])
    w2         uint8 [E, D, I/2],  w2_scale e4m3 [E, D, I/16],  w2_gs fp32 [E]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...quant.nvfp4 import dequantize_nvfp4


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (top-k weights [T, k] in the logits' dtype, top-k ids [T, k] int64), the weights in
    descending order."""
    p = torch.softmax(logits, dim=-1, dtype=torch.float)
    w, ids = p.topk(top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w.to(logits.dtype), ids


def router_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int,
                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D], router weight [E, D] -> (logits [T, E] in x's dtype, top-k weights [T, k], top-k ids [T, k])."""
    logits = F.linear(x, weight)
    w, ids = select_experts(logits, top_k, renormalize)
    return logits, w, ids


def experts_nvfp4(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w13_gs: torch.Tensor,
                  w2: torch.Tensor, w2_scale: torch.Tensor, w2_gs: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, D]; NVFP4 experts (module docstring); top-k weights / ids [T, k] -> the weighted sum of the selected
    experts' SwiGLU outputs [T, D] in x's dtype. Only the selected experts are dequantized (all T * k at once)."""
    T, k = topk_ids.shape
    acc = torch.promote_types(x.dtype, torch.float32)
    flat = topk_ids.reshape(-1).long()
    gs13, gs2 = w13_gs.reshape(-1)[flat], w2_gs.reshape(-1)[flat]
    W13 = dequantize_nvfp4(w13[flat], w13_scale[flat], gs13, acc)  # [T*k, 2I, D]
    W2 = dequantize_nvfp4(w2[flat], w2_scale[flat], gs2, acc)  # [T*k, D, I]
    xs = x.to(acc).repeat_interleave(k, dim=0)  # row t*k + j: token t
    h = torch.bmm(W13, xs[:, :, None])[..., 0]
    gate, up = h.chunk(2, -1)
    a = (F.silu(gate) * up).to(x.dtype).to(acc)
    y = torch.bmm(W2, a[:, :, None])[..., 0] * topk_weights.reshape(-1, 1).to(acc)
    return y.view(T, k, -1).sum(1).to(x.dtype)
