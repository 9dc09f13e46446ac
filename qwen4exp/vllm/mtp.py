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
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.sequence import IntermediateTensors

from .. import envs
from ..configuration import INDEXED
from ..layers.hyper_connection import HyperConnection
from ..layers.mtp import MTPInput
from ..modeling import colocate_projections
from .layers import rotary_embedding, vllm_linear
from .model import decoder_layer, logger
from .qsa import QSAMixer
from .weights import MTP_DRAFT, load_qwen4exp_weights


def shares_selection(vllm_config: VllmConfig) -> bool:
    """``index_share_for_mtp_iteration`` where vLLM's proposer reads it: the draft model config (the checkpoint's
    value, or ``speculative_config``'s override). Off by default: reusing step 0's selection changes the draft's
    attention past the QSA budget (drafts only: the target verifies every token, so output is unchanged)."""
    sc = vllm_config.speculative_config
    dm = getattr(sc, "draft_model_config", None) if sc is not None else None
    cfg = dm.hf_config if dm is not None else vllm_config.model_config.hf_config
    return bool(getattr(cfg, "index_share_for_mtp_iteration", False))


class Qwen4ExpMTPModel(MTPInput):
    """``mtp.*`` of the checkpoint (same names), plus the (target-shared) token embedding."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "mtp"):
        config = vllm_config.model_config.hf_text_config
        super().__init__(config, linear=vllm_linear, prefix=prefix)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix="model.embed_tokens")
        self.rotary_emb = rotary_embedding(config, vllm_config)
        n = getattr(config, "mtp_num_hidden_layers", 1) or 1
        share = shares_selection(vllm_config)
        layers = []
        for i in range(n):
            lp = f"{prefix}.layers.{i}"
            mixer = QSAMixer(config, vllm_config, f"{lp}.self_attn", self.rotary_emb,  # one cache layer: one group
                             share_selection=share)
            layers.append(decoder_layer(config, i, lp, mixer, INDEXED, with_ple=False))
        self.layers = nn.ModuleList(layers)
        self.hyper_connection_mixer = HyperConnection(config, inject=False, linear=vllm_linear,
                                                      prefix=f"{prefix}.hyper_connection_mixer")

    # index_share_for_mtp_iteration: the hooks vLLM's MTP proposer calls on ``draft.model`` (V1 proposer and V2
    # speculator alike) when the draft config sets it: step 0 selects, ``compact_topk_indices`` keeps each request's
    # last-token row, steps 1+ run with ``set_skip_topk(True)``.
    def set_skip_topk(self, skip: bool) -> None:
        for layer in self.layers:
            layer.self_attn.set_reuse(skip)

    def compact_topk_indices(self, row_indices: torch.Tensor) -> None:
        for layer in self.layers:
            if layer.self_attn.share_selection:
                layer.self_attn.keep_rows(row_indices)

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None, spec_step_idx: int = 0):
        emb = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        H = super().forward(emb, hidden_states.to(emb.dtype))
        cos, sin = self.rotary_emb(positions, emb.dtype)
        layer = self.layers[spec_step_idx % len(self.layers)]
        mixer = layer.self_attn

        def mix(x):
            return mixer(x, positions, cos, sin)

        return layer(H, mix, None)[0]


class DraftHead:
    """The drafts' LM head where it is not the shared bf16 head: a copy of its rows for the drafts' vocabulary
    (``QWEN4EXP_MTP_DRAFT_VOCAB``: the hot tokens, ``draft_vocab``) and/or in FP8 (``QWEN4EXP_MTP_DRAFT_HEAD=fp8``: a
    per-row FP8 copy, ``quant.fp8.quantize_fp8_per_row``, multiplied by per-token FP8 activations in vLLM's CUTLASS
    scaled GEMM), so a draft step reads fewer bytes. It stands in for the head in ``LogitsProcessor`` (its
    ``quant_method.apply`` and ``tp_size``), which keeps the vocabulary gather and trim; with a vocabulary the logits
    come back full width, -inf outside it, so the proposer's arg-max (or its sampling) sees only those tokens. Drafts
    only: the target's logits, hence the output, are the shared head's."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor | None = None, fp8: bool = False, tp_size: int = 1,
                 shard_indices=None):
        self.source = (weight.data_ptr(), tuple(weight.shape))
        self.rows, self.ids, self.fp8, self.tp_size = weight.shape[0], ids, fp8, tp_size
        self.shard_indices = shard_indices  # (the shared head's: LogitsProcessor.get_top_tokens reads them)
        w = weight.detach() if ids is None else weight.detach().index_select(0, ids)
        self.n = w.shape[0]
        if fp8:
            from ..quant.fp8 import quantize_fp8_per_row

            pad = -self.n % 16  # (CUTLASS wants the output width a multiple of 16: zero rows, sliced off)
            if pad:
                w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
            w8, scale = quantize_fp8_per_row(w)
            self.weight = w8.t()  # [hidden, rows], column-major: CUTLASS's B
            self.scale = scale  # [rows, 1] float32
        else:
            self.weight = w.contiguous()
        self.quant_method = self

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self.row_logits(x, bias)
        if self.ids is not None:
            full = out.new_full((out.shape[0], self.rows), float("-inf"))
            out = full.index_copy_(1, self.ids, out)
        return out.view(*x.shape[:-1], out.shape[-1])

    def row_logits(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens, n] logits of the head's own rows (``ids``' tokens, in their order)."""
        x2 = x.reshape(-1, x.shape[-1])
        if bias is not None and self.ids is not None:
            bias = bias.index_select(0, self.ids)
        if self.fp8:
            from vllm import _custom_ops as ops

            a8, a_scale = ops.scaled_fp8_quant(x2.contiguous(), use_per_token_if_dynamic=True)
            if bias is not None and bias.shape[0] != self.scale.shape[0]:
                bias = torch.cat([bias, bias.new_zeros(self.scale.shape[0] - bias.shape[0])])
            out = ops.cutlass_scaled_mm(a8, self.weight, a_scale, self.scale, x.dtype, bias)[:, :self.n]
        else:
            out = torch.nn.functional.linear(x2, self.weight, bias)
        return out


def fp8_head_unsupported(weight: torch.Tensor) -> str | None:
    """Why the FP8 draft head cannot run for this head weight (None: it can)."""
    if weight.device.type != "cuda":
        return f"the head is on {weight.device.type}, not a CUDA GPU"
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return f"the model runs in {str(weight.dtype).removeprefix('torch.')}, not bf16 / fp16"
    if torch.cuda.get_device_capability(weight.device) < (8, 9):
        return "FP8 GEMMs need compute capability 8.9 or newer"
    return None


class Qwen4ExpMTP(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.model = Qwen4ExpMTPModel(vllm_config=vllm_config, prefix="mtp")
        colocate_projections(self.model)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self._head: DraftHead | None = None
        self._fp8 = envs.QWEN4EXP_MTP_DRAFT_HEAD == "fp8"
        self._vocab_n = envs.QWEN4EXP_MTP_DRAFT_VOCAB or 0
        mc = vllm_config.model_config
        self._model_dir = mc.tokenizer if isinstance(mc.tokenizer, str) and mc.tokenizer else mc.model

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def draft_head(self):
        """The head the drafts' logits come from: the shared bf16 head, or a ``DraftHead`` (the hot vocabulary and /
        or FP8). That copy is made from the head in use at the first draft step, which runs eagerly (vLLM's
        profiling run, before any graph capture: the copy is then counted in the memory the KV cache leaves free),
        after vLLM has swapped the target's head in; a later swap makes a new one. Never made while a graph is
        captured: the drafts then keep the shared head for the process (a graph may hold it)."""
        if not (self._fp8 or self._vocab_n):
            return self.lm_head
        w = self.lm_head.weight
        h = self._head
        if h is not None and h.source == (w.data_ptr(), tuple(w.shape)):
            return h
        asked = " and ".join(x for x, on in (("QWEN4EXP_MTP_DRAFT_HEAD=fp8", self._fp8),
                                             (f"QWEN4EXP_MTP_DRAFT_VOCAB={self._vocab_n}", self._vocab_n)) if on)
        head_dtype = getattr(self.logits_processor, "head_dtype", None)
        why = None
        if head_dtype not in (None, w.dtype):
            why = f"the logits are computed in {head_dtype} (head_dtype)"
        elif w.is_cuda and torch.cuda.is_current_stream_capturing():
            why = "its first use came inside a CUDA graph capture"
        if why is not None:
            logger.warning("qwen4exp: %s not applied (%s): the drafts use the bf16 LM head", asked, why)
            self._fp8 = self._vocab_n = 0
            return self.lm_head
        if self._fp8 and (why := fp8_head_unsupported(w)) is not None:
            logger.warning("qwen4exp: QWEN4EXP_MTP_DRAFT_HEAD=fp8 not applied (%s): the drafts use the bf16 LM head",
                           why)
            self._fp8 = False
        ids, where = None, ""
        tp = getattr(self.lm_head, "tp_size", 1)
        if self._vocab_n:
            from .draft_vocab import hot_token_ids, read_ranked_ids, special_token_ids

            vocab = min(self.config.vocab_size, w.shape[0])
            file = envs.QWEN4EXP_MTP_DRAFT_VOCAB_FILE
            why = None
            if tp > 1:
                why = f"tensor parallel ({tp} ranks): each rank holds a slice of the head"
            elif self._vocab_n >= vocab:
                why = f"it is not below the vocabulary's {vocab} tokens"
            if why is None:
                special = special_token_ids(self._model_dir)
                hot = hot_token_ids(self._vocab_n, vocab, read_ranked_ids(file) if file else None, special)
                ids = torch.tensor(hot, dtype=torch.long, device=w.device)
                where = (f"the most frequent of {file}" if file else "the lowest ids") + f", {len(special)} special"
            else:
                logger.warning("qwen4exp: QWEN4EXP_MTP_DRAFT_VOCAB=%d not applied (%s): the drafts score the whole "
                               "vocabulary", self._vocab_n, why)
                self._vocab_n = 0
        if not (self._fp8 or self._vocab_n):
            return self.lm_head
        self._head = h = DraftHead(w, ids, self._fp8, tp, getattr(self.lm_head, "shard_indices", None))
        what = "an FP8 copy of the LM head" if self._fp8 else "a copy of the LM head's rows"
        size = h.n * w.shape[1] * (1 if self._fp8 else w.element_size())
        if ids is not None:
            logger.info("qwen4exp: MTP drafts use %s for %d of %d tokens (%s; %.2f GiB)", what, h.n, w.shape[0],
                        where, size / 2**30)
        else:
            logger.info("qwen4exp: MTP drafts use %s (%d x %d, %.2f GiB)", what, w.shape[0], w.shape[1], size / 2**30)
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None,
                spec_step_idx: int = 0, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, hidden_states, inputs_embeds, spec_step_idx)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        out, _ = self.model.hyper_connection_mixer(hidden_states)
        return self.logits_processor(self.draft_head(), out)

    def get_top_tokens(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        """The draft tokens without full-width logits (vLLM's proposer under ``use_local_argmax_reduction``): the
        arg-max of the drafts' vocabulary rows mapped to their ids, else vLLM's vocab-parallel arg-max of the head.
        (Soft-capping and a positive scale keep the order, so the rows' plain logits pick the same token.)"""
        out, _ = self.model.hyper_connection_mixer(hidden_states)
        h = self.draft_head()
        if isinstance(h, DraftHead) and h.ids is not None:
            return h.ids[h.row_logits(out).argmax(-1)]
        return self.logits_processor.get_top_tokens(h, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``mtp.*`` plus the shared embedding and LM head, through the target's loader (``weights.MTP_DRAFT``)."""
        return load_qwen4exp_weights(self, weights, MTP_DRAFT, mtp_layers=len(self.model.layers))
