"""vLLM building blocks bound to ``qwen4exp.layers``' math: the linear factory, the fused-MoE experts and the PLE
per-request state (a MambaBase SHORT_CONV layer).

Tensor parallelism: vLLM's GDN mixer, FusedMoE, the vocab-parallel embedding and the LM head shard themselves; the
QSA, PLE, HC and shared-expert linears are replicated (``ReplicatedLinear``), so every rank computes them in full.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum


class Linear(ReplicatedLinear):
    """A replicated vLLM linear whose forward returns a plain tensor (the contract of ``qwen4exp.layers.linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0]


def vllm_linear(in_features: int, out_features: int, *, prefix: str = "") -> nn.Module:
    return Linear(in_features, out_features, bias=False, prefix=prefix)


def fused_experts(config, prefix: str) -> nn.Module:
    """vLLM FusedMoE (CPU: bf16 experts) fed with our router's logits (softmax -> top-k -> renormalise)."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    experts = FusedMoEFactory(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        scoring_func="softmax",
        reduce_results=True,
        prefix=prefix,
    )
    experts.takes_router_logits = True  # qwen4exp.layers.moe.MoE calls experts(x, router_logits)
    return experts


class PLEState(nn.Module, MambaBase):
    """Per-request PLE state: the dilated conv's last (K_p-1)*n inputs [nD, (K_p-1)*n] (model dtype) and the last
    n-1 token ids [n-1] (int32). A SHORT_CONV-typed Mamba state, so vLLM allocates, copies (prefix caching "align")
    and frees it with the request, and it survives chunked prefill and preemption (recompute starts it afresh)."""

    def __init__(self, nD: int, conv_len: int, ctx_len: int, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.prefix = prefix
        self.shapes = ((nD, conv_len), (ctx_len,))
        self.dtypes = (dtype, torch.int32)
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        cc = get_current_vllm_config().compilation_config
        if prefix in cc.static_forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        cc.static_forward_context[prefix] = self

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV

    @property
    def is_kv_cache_tp_replicated(self) -> bool:
        return True

    def get_state_shape(self):
        return self.shapes

    def get_state_dtype(self):
        return self.dtypes


def ple_state_shapes(config) -> tuple[tuple[int, int], tuple[int]]:
    nD = config.hc_count * config.hidden_size
    return (nD, (config.ple_conv_kernel_size - 1) * config.ngram_size), (config.ngram_size - 1,)


def model_dtype(vllm_config: VllmConfig) -> torch.dtype:
    return vllm_config.model_config.dtype
