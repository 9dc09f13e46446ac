"""Mixture of experts: softmax router (fp32) -> top-k, renormalised (fp32) -> cast; routed SwiGLU experts; plus a
shared SwiGLU expert scaled by a per-token sigmoid gate. y = routed + sigmoid(w_sg . x) * shared(x)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.moe_combine import shared_gate_combine
from ..ops.moe_decode.reference import select_experts
from .linear import LinearFactory, default_linear, linear_weight


class Router(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k, self.norm_topk = config.num_experts_per_tok, config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (router logits [T, E], top-k weights [T, k] in x's dtype, top-k ids [T, k])."""
        logits = self.logits(x)
        w, ids = self.select(logits)
        return logits, w, ids

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (top-k weights [T, k] in the logits' dtype, top-k ids [T, k]); the math is the
        MoE decode op's reference (one copy, which its router kernel is tested against)."""
        return select_experts(logits, self.top_k, self.norm_topk)


class Experts(nn.Module):
    """Routed experts stored fused, as in the official checkpoint: gate_up_proj [E, 2I, D] (gate rows first),
    down_proj [E, D, I].

    Precision (low-precision models): both projections accumulate and return fp32, SiLU(gate) * up is computed in
    fp32 and rounded once to the model dtype (the down projection's input), and the top-k combine sums the weighted
    expert outputs in fp32, rounded once at the end. This is what fused MoE kernels do (vLLM's CPU ``cpu_fused_moe``
    matches it to the last bit but for fp32 summation order), instead of rounding every intermediate to bf16 and
    accumulating the combine in bf16. In fp32 nothing changes."""

    def __init__(self, config):
        super().__init__()
        E, D, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        acc = torch.promote_types(x.dtype, torch.float32)
        out = torch.zeros(x.shape, dtype=acc, device=x.device)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tok = order // k
        wsel = weights.reshape(-1)[order].to(acc)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            t = tok[start: start + c]
            gate_up, down = self.expert_weights(e)
            h = F.linear(self.quant_input(x[t], "gate_up").to(acc), gate_up.to(acc))
            gate, up = h.chunk(2, -1)
            a = self.quant_input((F.silu(gate) * up).to(x.dtype), "down").to(acc)
            out.index_add_(0, t, F.linear(a, down.to(acc)) * wsel[start: start + c, None])
            start += c
        return out.to(x.dtype)

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s (gate_up [2I, D], down [D, I]); a quantized subclass dequantizes here."""
        return self.gate_up_proj[e], self.down_proj[e]

    def quant_input(self, x: torch.Tensor, proj: str) -> torch.Tensor:
        """The input of projection ``proj`` ("gate_up" / "down") as the GEMM sees it: unchanged here; a subclass
        fake-quantizes it (W4A4 emulation), and calibration observes it."""
        return x


class SwiGLU(nn.Module):
    def __init__(self, D: int, I: int, linear: LinearFactory = default_linear, prefix: str = ""):
        super().__init__()
        self.gate_proj = linear(D, I, prefix=f"{prefix}.gate_proj")
        self.up_proj = linear(D, I, prefix=f"{prefix}.up_proj")
        self.down_proj = linear(I, D, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """``experts``: a runtime's routed experts taking (x, top-k weights, ids) in place of ``Experts``;
    ``shared_expert``: its shared expert in place of ``SwiGLU`` (same checkpoint names). A runtime whose fused experts
    take the router logits instead overrides ``forward`` (the vLLM plugin's ``FusedMoEBlock``)."""

    def __init__(self, config, linear: LinearFactory = default_linear, prefix: str = "", experts: nn.Module = None,
                 shared_expert: nn.Module = None):
        super().__init__()
        D = config.hidden_size
        self.gate = Router(config)
        self.experts = experts if experts is not None else Experts(config)
        self.shared_expert = (shared_expert if shared_expert is not None
                              else SwiGLU(D, config.shared_expert_intermediate_size, linear, f"{prefix}.shared_expert"))
        self.shared_expert_gate = linear(D, 1, prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x)
        _, w, ids = self.gate(x)
        return self.combine(x, shared, self.experts(x, w, ids))

    def combine(self, x: torch.Tensor, shared: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """routed + sigmoid(x . w_gate) * shared."""
        w = linear_weight(self.shared_expert_gate)
        if w is not None and w.dtype == x.dtype:  # a plain linear: gate, sigmoid, product, sum in one kernel on GPUs
            return shared_gate_combine(x, w, shared, routed)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * shared  # e.g. a quantized gate

    def gated_shared(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(x . w_gate) * shared_expert(x), each op rounded: ``routed + gated_shared(x)`` is ``forward``'s
        sum bit for bit (bf16 addition commutes), for runtimes that compute the two parts apart (e.g. overlapped)."""
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
