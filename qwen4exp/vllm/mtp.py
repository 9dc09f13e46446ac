"""Qwen4Exp's MTP draft head for vLLM speculative decoding (``speculative_config={"method": "mtp", ...}``).

vLLM resolves method "mtp" on a ``qwen4_exp`` checkpoint to the architecture ``Qwen4ExpMTP`` (the draft reads the
target's checkpoint, ``mtp.*``), which the plugin registers to this class. Math shared with the HF reference:
``qwen4exp.layers.mtp.MTPInput`` (input fusion) + ``qwen4exp.modeling.DecoderLayer`` (a QSA layer, here bound to our
paged-cache ``QSAMixer``) + the head's own final ``HyperConnection`` mixer.

Hidden-state contract with vLLM's V1 proposer (``v1/spec_decode/llm_base_proposer.py``), which for our architecture
expects one tensor from ``forward`` (used both for the logits and as the next draft step's input):
* ``forward`` takes the previous multi-stream state [T, hc_count*H] (the target's pre-final-mixer streams via
  ``get_mtp_target_hidden_states``, then its own output) and returns the layer's multi-stream output [T, hc_count*H];
* ``compute_logits`` applies the head's final mixer and the (shared) LM head.
The proposer's hidden buffer is widened to hc_count*H by the plugin's config hook (``widen_draft_hidden``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.sequence import IntermediateTensors

from ..configuration import INDEXED
from ..layers.hyper_connection import HyperConnection
from ..layers.mtp import MTPInput
from ..layers.qsa import QSAAttention
from ..layers.rope import RotaryEmbedding
from .layers import vllm_linear
from .model import decoder_layer
from .qsa import QSAMixer
from .weights import MTP_DRAFT, load_qwen4exp_weights


class _CacheView:
    """Part of the draft's single QSA cache layer (see ``DraftQSAMixer``): KV heads [h0, h1), each head's
    [K half | V half] narrowed to ``width`` per half. Same layer name, so it reads that layer's attention metadata."""

    def __init__(self, attn: Attention, h0: int, h1: int, width: int):
        self._attn, self._h, self._width = [attn], (h0, h1), width

    @property
    def layer_name(self) -> str:
        return self._attn[0].layer_name

    def _view(self, kv):
        if not isinstance(kv, torch.Tensor) or kv.dim() != 4:
            return kv
        hd = kv.shape[3] // 2
        v = kv[:, self._h[0]:self._h[1]]
        if self._width == hd:
            return v
        # [K | V] at the narrower width, adjacent: K half = [:w], V half = [w:2w]
        return v[..., : 2 * self._width]

    @property
    def kv_cache(self):
        kv = self._attn[0].kv_cache
        if isinstance(kv, (list, tuple)):
            return type(kv)(self._view(k) for k in kv)
        return self._view(kv)


class DraftQSAMixer(QSAMixer):
    """QSA of the draft layer with ONE vLLM attention layer: vLLM's proposer builds one attention metadata for all
    draft layers and asserts that they share a KV-cache group, while the target's QSA declares two cache layers
    (main K/V and the index cache, different shapes: two groups). The draft's single layer has n_kv + 1 KV heads of
    the main head width; the extra head holds the index cache rows (raw key | block key, each indexer-wide).
    No vLLM attention kernel reads this cache (our ``QSAMixer`` reads and writes it), so the layout is ours."""

    def __init__(self, config, vllm_config, prefix: str, rotary):
        QSAAttention.__init__(self, config, vllm_linear, prefix)
        self.eager_name = prefix
        self.rotary = [rotary]
        d_i = self.indexer.head_dim
        if d_i > self.head_dim:
            raise ValueError("qwen4exp MTP: indexer head wider than the attention head is not supported")
        nkv = self.n_kv + 1
        self.cache_layer = Attention(nkv, self.head_dim, self.scale, num_kv_heads=nkv,
                                     cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn")
        self.attn = _CacheView(self.cache_layer, 0, self.n_kv, self.head_dim)
        self.index_cache = _CacheView(self.cache_layer, self.n_kv, nkv, d_i)


class Qwen4ExpMTPModel(MTPInput):
    """``mtp.*`` of the checkpoint (same names), plus the (target-shared) token embedding."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "mtp"):
        config = vllm_config.model_config.hf_text_config
        super().__init__(config, linear=vllm_linear, prefix=prefix)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix="model.embed_tokens")
        self.rotary_emb = RotaryEmbedding(config)
        n = getattr(config, "mtp_num_hidden_layers", 1) or 1
        layers = []
        for i in range(n):
            lp = f"{prefix}.layers.{i}"
            mixer = DraftQSAMixer(config, vllm_config, f"{lp}.self_attn", self.rotary_emb)
            layers.append(decoder_layer(config, i, lp, mixer, INDEXED, with_ple=False))
        self.layers = nn.ModuleList(layers)
        self.hyper_connection_mixer = HyperConnection(config, inject=False, linear=vllm_linear,
                                                      prefix=f"{prefix}.hyper_connection_mixer")

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None, spec_step_idx: int = 0):
        emb = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        H = super().forward(emb, hidden_states.to(emb.dtype))
        cos, sin = self.rotary_emb(positions, emb.dtype)
        layer = self.layers[spec_step_idx % len(self.layers)]
        mixer = layer.self_attn

        def mix(x):
            return mixer(x, positions, cos, sin)

        return layer(H, mix, None)


class Qwen4ExpMTP(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.model = Qwen4ExpMTPModel(vllm_config=vllm_config, prefix="mtp")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None,
                spec_step_idx: int = 0, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, hidden_states, inputs_embeds, spec_step_idx)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        out, _ = self.model.hyper_connection_mixer(hidden_states)
        return self.logits_processor(self.lm_head, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``mtp.*`` plus the shared embedding and LM head, through the target's loader (``weights.MTP_DRAFT``)."""
        return load_qwen4exp_weights(self, weights, MTP_DRAFT, mtp_layers=len(self.model.layers))
