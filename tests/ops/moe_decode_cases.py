"""Cases of the MoE decode op (``qwen4exp.ops.moe_decode``), shared by ``test_moe_decode.py`` and its Triton checks
(``interpreter_moe_decode.py``): random NVFP4 experts from the quant module's quantizer, router inputs whose top-k
is clear of near-ties. Plain torch."""

from __future__ import annotations

import torch

from qwen4exp.quant.nvfp4 import quantize_nvfp4

BF = torch.bfloat16


def nvfp4_experts(E, D, I, seed=0, device="cpu"):
    """Random experts quantized per expert as ModelOpt does (gate and up share one global scale) -> dict of the
    reference's NVFP4 tensors (w13, w13_scale, w13_gs, w2, w2_scale, w2_gs) on ``device``."""
    g = torch.Generator().manual_seed(seed)
    t = {k: [] for k in ("w13", "w13_scale", "w13_gs", "w2", "w2_scale", "w2_gs")}
    for _ in range(E):
        # a few outlier columns per expert, so the per-16 scales vary over a row
        w13 = torch.randn(2 * I, D, generator=g) * D ** -0.5 * (1 + 3 * (torch.rand(D, generator=g) > 0.9))
        w2 = torch.randn(D, I, generator=g) * I ** -0.5 * (1 + 3 * (torch.rand(I, generator=g) > 0.9))
        for name, w in (("w13", w13), ("w2", w2)):
            q, s, gs = quantize_nvfp4(w.to(device))  # (on the GPU for the real-size cases: far faster)
            t[name].append(q)
            t[name + "_scale"].append(s)
            t[name + "_gs"].append(gs.reshape(()))
    return {k: torch.stack(v).to(device) for k, v in t.items()}


def routed_inputs(M, D, k, E, seed=0, dtype=BF, device="cpu"):
    """x [M, D] and random top-k (ids distinct per token, weights renormalised, descending) -> (x, weights, ids)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    w = torch.rand(M, k, generator=g) + 0.05
    w = (w / w.sum(-1, keepdim=True)).sort(-1, descending=True).values.to(dtype)
    return x.to(device), w.to(device), ids.to(device)


def router_case(M, D, E, k, seed=0, dtype=BF, margin=2e-2, device="cpu"):
    """x [M, D], router weight [E, D] whose bf16 logits have their k-th and (k+1)-th largest at least ``margin``
    apart for every token (so another summation order cannot change the selection); seeds tried in turn."""
    from qwen4exp.ops.moe_decode.reference import router_topk
    for s in range(seed, seed + 1000):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(M, D, generator=g).to(dtype)
        w = (torch.randn(E, D, generator=g) * D ** -0.5).to(dtype)
        logits = router_topk(x, w, k, True)[0].float()
        top = logits.topk(min(k + 1, E), -1).values
        if E == k or bool(((top[:, k - 1] - top[:, k]) > margin).all()):
            return x.to(device), w.to(device)
    raise RuntimeError("no router case with a clear top-k")
