"""HF transformers runtime: ``Qwen4ExpForCausalLM`` and ``Qwen4ExpForConditionalGeneration`` (PreTrainedModel +
GenerationMixin) over the shared model assembly (``qwen4exp.modeling``). Read bottom-up: the text backbone, the
composite backbone, the shared base class (weight init, loading, cache and generation plumbing, input packing and the
LM output), then the two concrete models, each with its own ``forward``.

Batches are packed internally: padding tokens are dropped (each row's real tokens form one sequence), the model runs
on the packed tokens (``hf.packed``), and logits are scattered back to [B, S, V] (zeros at padding positions).
Positions count real tokens, so a left-padded row behaves exactly like the same row unpadded.

``generate`` supports greedy, sampling and beam search (``num_beams`` > 1, ``num_return_sequences``): the hybrid cache
(``Qwen4ExpHybridCache.reorder_cache``) moves every per-row state (GDN, PLE, QSA, lengths) along with its beam.
``generate(use_mtp=True)``: greedy speculative decoding with the MTP head (``hf.mtp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..configuration import Qwen4ExpConfig, Qwen4ExpTextConfig
from ..layers.gdn import GatedDeltaNet
from ..layers.hyper_connection import HyperConnection
from ..layers.moe import Experts, Router
from ..layers.norms import GatedRMSNorm, RMSNorm
from ..layers.ple import NGramTable, PLE
from ..layers.rope import IMAGE, VIDEO, RotaryEmbedding, mrope_positions
from ..layers.vision import VisionTower
from ..modeling import DecoderLayer, embed_streams
from . import mtp as hf_mtp
from .cache import Qwen4ExpHybridCache
from .mtp import Qwen4ExpMTP
from .packed import run_layers


@dataclass
class _PackedBatch:
    """A [B, S] batch with its padding dropped: ``ids`` [T] the real tokens, row by row; ``cu`` [B+1] their offsets;
    ``valid`` [B, S] the real positions; ``lens`` [B]; ``cache`` the rows' hybrid cache."""

    input_ids: torch.Tensor
    valid: torch.Tensor
    lens: torch.Tensor
    cu: torch.Tensor
    ids: torch.Tensor
    cache: Qwen4ExpHybridCache
    use_cache: bool


class Qwen4ExpTextModel(nn.Module):
    """embed_tokens, layers, hyper_connection_mixer (the final mixer is the output norm)."""

    def __init__(self, config, prefix: str = "model"):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, prefix=f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.hyper_connection_mixer = HyperConnection(config, inject=False, prefix=f"{prefix}.hyper_connection_mixer")
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T] or [3, T] RoPE positions
        cu_seqlens: torch.Tensor,  # [N+1]
        cache: Qwen4ExpHybridCache,
        rows: torch.Tensor,  # [N] cache row of each sequence
        embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed tokens -> (final hidden [T, D], pre-mixer multi-stream state [T, nD])."""
        c = self.config
        emb = self.embed_tokens(ids) if embeds is None else embeds
        H = embed_streams(emb, c.hc_count)
        H, Hn = run_layers(self.layers, H, ids, positions, cu_seqlens, cache.layers, rows, cache.lengths[rows],
                           self.rotary_emb, cache.journal, self.hyper_connection_mixer)
        out, _ = self.hyper_connection_mixer(H, Hn)
        return out, H


class Qwen4ExpModel(nn.Module):
    """The composite backbone: ``visual`` (the vision tower) and ``language_model`` (the text backbone)."""

    def __init__(self, config: Qwen4ExpConfig):
        super().__init__()
        self.visual = VisionTower(config.vision_config)
        self.language_model = Qwen4ExpTextModel(config.text_config, prefix="model.language_model")


class Qwen4ExpPreTrainedModel(PreTrainedModel):
    """What both models share: weight init, loading / saving the official checkpoint format, the hybrid cache and
    generation plumbing, the MTP entry points, and the two halves of a forward (``_pack`` the inputs,
    ``_lm_output`` from the packed hidden states)."""

    config_class = Qwen4ExpTextConfig
    base_model_prefix = "model"
    _is_stateful = True
    _supports_cache_class = False
    _no_split_modules = ["DecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        std = getattr(self.config.get_text_config(), "initializer_range", 0.02)
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv3d)):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, RMSNorm):
            module.weight.zero_()
        elif isinstance(module, (GatedRMSNorm, nn.LayerNorm)):
            module.weight.fill_(1.0)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, NGramTable):
            module.weight.normal_(0.0, std)
        elif isinstance(module, Experts):
            module.gate_up_proj.normal_(0.0, std)
            module.down_proj.normal_(0.0, std)
        elif isinstance(module, GatedDeltaNet):
            module.dt_bias.fill_(1.0)
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16).log_())
        elif isinstance(getattr(module, "gate", None), Router):  # at the MoE block, after its experts (as ever)
            module.gate.weight.normal_(0.0, std)
        if isinstance(module, PLE):
            module.conv1d.weight.zero_()

    # ---------------------------------------------------------------------------------------------------------------
    # loading / saving in the official checkpoint format
    @classmethod
    def from_pretrained(cls, path, *, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
                        config=None, quant_mode: str = "dequantize", emulate_w4a4: bool = False, **kwargs):
        """Load an official checkpoint (BF16, or ModelOpt-quantized: ``qwen4exp.hf.quant``).

        ``quant_mode`` (quantized checkpoints): "dequantize" (default) turns the quantized routed experts into
        ``dtype`` weights at load; "packed" keeps them packed and dequantizes per forward (same results, a quarter
        of the memory for NVFP4 experts). ``emulate_w4a4=True`` fake-quantizes the NVFP4 experts' inputs with the
        checkpoint's ``input_scale``, as Blackwell's W4A4 kernels compute."""
        from .loading import load_pretrained

        if kwargs.pop("torch_dtype", None) is not None and dtype is None:
            raise TypeError("qwen4exp: use dtype=..., not torch_dtype=...")
        if kwargs:
            raise TypeError(f"qwen4exp from_pretrained: unsupported arguments {sorted(kwargs)}")
        return load_pretrained(cls, path, dtype=dtype, device=device, config=config, quant_mode=quant_mode,
                               emulate_w4a4=emulate_w4a4)

    def save_pretrained(self, save_directory, **kwargs):
        from .loading import save_pretrained

        save_pretrained(self, save_directory, **kwargs)

    # ---------------------------------------------------------------------------------------------------------------
    # cache and generation
    @property
    def text_model(self) -> Qwen4ExpTextModel:
        raise NotImplementedError

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length, *args, **kwargs):
        # generate expands every row into max(num_beams, num_return_sequences) rows before the prefill; beam search
        # then calls the cache's reorder_cache(beam_idx) after each step
        expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        cache = model_kwargs.get("past_key_values")
        if cache is None:
            if generation_config.use_cache is not False:
                model_kwargs["past_key_values"] = self.new_cache(batch_size * expand)
        elif expand > 1 and cache.batch_size == batch_size:  # a user cache of the unexpanded batch
            cache.batch_repeat_interleave(expand)

    def new_cache(self, batch_size: int) -> Qwen4ExpHybridCache:
        p = self.text_model.embed_tokens.weight
        n_mtp = len(self.mtp.layers) if getattr(self, "mtp", None) is not None else 0
        return Qwen4ExpHybridCache(self.config.get_text_config(), batch_size, p.dtype, p.device, mtp_layers=n_mtp)

    # ---------------------------------------------------------------------------------------------------------------
    # MTP: the draft head's forward and greedy speculative decoding with it live in ``hf.mtp``
    def mtp_forward(self, H_prev: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                    cache: Qwen4ExpHybridCache, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step over the tokens of one row (``hf.mtp.mtp_forward``)."""
        return hf_mtp.mtp_forward(self, H_prev, next_ids, positions, cache, row)

    def mtp_logits(self, mtp_hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Training forward of the MTP head over whole unpadded rows (``hf.mtp.mtp_logits``)."""
        return hf_mtp.mtp_logits(self, mtp_hidden, input_ids)

    def _draft(self, cache, H_pend, next_pend, pos_pend, k):
        return hf_mtp.draft(self, cache, H_pend, next_pend, pos_pend, k)

    @torch.no_grad()
    def generate(self, *args, use_mtp: bool = False, **kwargs):
        """Transformers' ``generate``: greedy, sampling and beam search (``num_beams`` > 1, with
        ``num_return_sequences``, left-padded batches; the hybrid cache reorders every per-row state along the beams).

        ``use_mtp=True``: greedy speculative decoding with the MTP head (``num_speculative_tokens``, default 3;
        ``hf.mtp.generate_mtp``); the output equals plain greedy decoding. One unpadded sequence, no sampling, no beam
        search. Statistics land in ``self.last_mtp_stats``."""
        if not use_mtp:
            return super().generate(*args, **kwargs)
        return hf_mtp.generate_mtp(self, *args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      inputs_embeds=None, **kwargs):
        model_inputs = {"past_key_values": past_key_values, "attention_mask": attention_mask,
                        "use_cache": kwargs.get("use_cache", True)}
        done = past_key_values.get_seq_length() if past_key_values is not None else 0
        if inputs_embeds is not None and done == 0:
            model_inputs["inputs_embeds"] = inputs_embeds
            model_inputs["input_ids"] = input_ids if input_ids is not None and input_ids.shape[1] else None
        else:
            model_inputs["input_ids"] = input_ids[:, done:]
        if kwargs.get("logits_to_keep") is not None:
            model_inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        if done == 0:  # images / videos enter with the prompt; decode steps continue from the cached positions
            for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids"):
                if kwargs.get(k) is not None:
                    model_inputs[k] = kwargs[k]
        return model_inputs

    # ---------------------------------------------------------------------------------------------------------------
    # the two halves of a forward
    def _reverse_embedding(self, embeds: torch.Tensor) -> torch.Tensor:
        """Recover token ids from exact embedding rows (PLE needs ids when only embeddings are given)."""
        table = self.text_model.embed_tokens.weight
        flat = embeds.reshape(-1, embeds.shape[-1]).to(table.dtype)
        d = torch.cdist(flat.float(), table.float())
        ids = d.argmin(-1)
        if not torch.equal(table[ids], flat):
            raise ValueError("qwen4exp: inputs_embeds given without input_ids, and they are not exact rows of "
                             "embed_tokens; PLE needs the token ids: pass input_ids (or ple_input_ids)")
        return ids.view(embeds.shape[:-1])

    def _pack(self, input_ids, attention_mask, inputs_embeds, ple_input_ids, past_key_values,
              use_cache) -> _PackedBatch:
        """Check the inputs, bind (or make) the cache, drop the padding."""
        if (input_ids is None) == (inputs_embeds is None) and ple_input_ids is None:
            raise ValueError("qwen4exp: pass exactly one of input_ids or inputs_embeds")
        tm = self.text_model
        if input_ids is None:
            input_ids = ple_input_ids if ple_input_ids is not None else self._reverse_embedding(inputs_embeds)
        if input_ids.dim() != 2:
            raise ValueError(f"qwen4exp: input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        B, S = input_ids.shape
        if int(input_ids.max()) >= tm.config.vocab_size or int(input_ids.min()) < 0:
            raise ValueError(f"qwen4exp: input_ids out of range [0, {tm.config.vocab_size})")
        use_cache = self.config.get_text_config().use_cache if use_cache is None else use_cache
        cache = past_key_values
        if cache is None:
            cache = self.new_cache(B)
        elif cache.batch_size != B:
            raise ValueError(f"qwen4exp: past_key_values holds {cache.batch_size} rows but the batch has {B}")
        if attention_mask is None:
            valid = torch.ones(B, S, dtype=torch.bool, device=input_ids.device)
        else:
            if attention_mask.dim() != 2:
                raise ValueError("qwen4exp: attention_mask must be a 2-D padding mask [batch, past + seq]")
            valid = attention_mask[:, -S:].bool()
        lens = valid.sum(1)
        cu = torch.zeros(B + 1, dtype=torch.long, device=input_ids.device)
        cu[1:] = lens.cumsum(0)
        return _PackedBatch(input_ids, valid, lens, cu, input_ids[valid], cache, use_cache)

    @staticmethod
    def _positions(b: _PackedBatch, position_ids: torch.Tensor | None) -> torch.Tensor:
        """RoPE positions of the packed tokens: the given ``position_ids`` (3-D for M-RoPE, a leading text axis
        dropped), else each row's next positions in its cache (on three axes once the row has M-RoPE positions)."""
        S = b.input_ids.shape[1]
        if position_ids is not None:
            pos = position_ids[1:] if position_ids.dim() == 3 and position_ids.shape[0] == 4 else position_ids
            pos = pos[..., -S:]
            return pos[:, b.valid] if pos.dim() == 3 else pos[b.valid]
        cache, ids = b.cache, b.ids
        base = (cache.lengths + cache.rope_deltas).to(b.input_ids.device)
        pos = torch.repeat_interleave(base - b.cu[:-1], b.lens) + torch.arange(ids.numel(), device=ids.device)
        if cache.mrope:  # the rows' QSA caches hold (t, h, w) positions: keep three axes
            pos = pos.expand(3, -1)
        return pos

    def _lm_output(self, b: _PackedBatch, pos: torch.Tensor, emb: torch.Tensor | None, labels, logits_to_keep: int,
                   return_mtp_hidden: bool) -> CausalLMOutputWithPast:
        """Run the text backbone on the packed batch, advance the cache, and scatter the kept logits back to
        [B, keep, V] (plus the loss, and the pre-mixer state ``mtp_hidden`` [B, S, nD] on request)."""
        B, S = b.input_ids.shape
        valid, cache = b.valid, b.cache
        hidden, H = self.text_model(b.ids, pos, b.cu, cache, torch.arange(B), emb)
        cache.lengths += b.lens.cpu()
        cache.columns += S
        keep = S if not logits_to_keep else min(int(logits_to_keep), S)
        sel = valid.clone()
        sel[:, : S - keep] = False
        tok_sel = sel[valid]
        logits_p = self.lm_head(hidden[tok_sel])
        logits = logits_p.new_zeros((B, keep, logits_p.shape[-1]))
        logits[sel[:, S - keep:]] = logits_p
        loss = None
        if labels is not None:
            lf = logits.float()[:, :-1].reshape(-1, logits.shape[-1])
            lab = labels[:, -keep:][:, 1:].reshape(-1).masked_fill(~valid[:, -keep:][:, 1:].reshape(-1), -100)
            loss = nn.functional.cross_entropy(lf, lab, ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache if b.use_cache else None)
        if return_mtp_hidden:
            Hs = H.new_zeros((B, S, H.shape[-1]))
            Hs[valid] = H
            out["mtp_hidden"] = Hs
        return out


class Qwen4ExpForCausalLM(Qwen4ExpPreTrainedModel, GenerationMixin):
    """Text-only: checkpoint names ``model.*``, ``lm_head.weight`` (and ``mtp.*``)."""

    config_class = Qwen4ExpTextConfig

    def __init__(self, config: Qwen4ExpTextConfig, mtp_layers: int | None = None, mtp_shared_head: bool = False):
        super().__init__(config)
        self.model = Qwen4ExpTextModel(config, prefix="model")
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        n_mtp = config.mtp_num_hidden_layers if mtp_layers is None else mtp_layers
        self.mtp = Qwen4ExpMTP(config, n_mtp, mtp_shared_head) if n_mtp else None
        self.post_init()

    @property
    def text_model(self) -> Qwen4ExpTextModel:
        return self.model

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Qwen4ExpHybridCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        ple_input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        return_mtp_hidden: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``ple_input_ids``: the token ids PLE hashes when only ``inputs_embeds`` are given (else recovered from
        exact embedding rows); ``return_mtp_hidden``: also return the pre-mixer state the MTP head reads. Image /
        video arguments are refused (they need ``Qwen4ExpForConditionalGeneration``)."""
        if any(x is not None for x in (pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)):
            raise NotImplementedError("qwen4exp: Qwen4ExpForCausalLM is text-only; image/video inputs need "
                                      "Qwen4ExpForConditionalGeneration")
        b = self._pack(input_ids, attention_mask, inputs_embeds, ple_input_ids, past_key_values, use_cache)
        emb = inputs_embeds[b.valid] if inputs_embeds is not None else None
        return self._lm_output(b, self._positions(b, position_ids), emb, labels, logits_to_keep, return_mtp_hidden)


class Qwen4ExpForConditionalGeneration(Qwen4ExpPreTrainedModel, GenerationMixin):
    """Checkpoint names ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight`` (and ``mtp.*``)."""

    config_class = Qwen4ExpConfig

    def __init__(self, config: Qwen4ExpConfig, mtp_layers: int | None = None, mtp_shared_head: bool = False):
        super().__init__(config)
        tc = config.text_config
        self.model = Qwen4ExpModel(config)
        self.lm_head = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)
        n_mtp = tc.mtp_num_hidden_layers if mtp_layers is None else mtp_layers
        self.mtp = Qwen4ExpMTP(tc, n_mtp, mtp_shared_head) if n_mtp else None
        self.post_init()

    @property
    def text_model(self) -> Qwen4ExpTextModel:
        return self.model.language_model

    def visual_tower(self):
        return self.model.visual

    def get_input_embeddings(self):
        return self.model.language_model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Qwen4ExpHybridCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        ple_input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        return_mtp_hidden: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """As ``Qwen4ExpForCausalLM.forward``, plus images / video: their placeholder tokens take the tower's output,
        and a prompt with ``image_grid_thw`` / ``video_grid_thw`` gets (t, h, w) M-RoPE positions."""
        b = self._pack(input_ids, attention_mask, inputs_embeds, ple_input_ids, past_key_values, use_cache)
        if position_ids is None and (image_grid_thw is not None or video_grid_thw is not None):
            pos = self._mrope_prefill_positions(b.ids, b.cu, b.valid, b.cache, mm_token_type_ids, image_grid_thw,
                                                video_grid_thw)
        else:
            pos = self._positions(b, position_ids)
        emb = inputs_embeds[b.valid] if inputs_embeds is not None else None
        if pixel_values is not None or pixel_values_videos is not None:
            emb = self._merge_vision(b.ids, emb, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        return self._lm_output(b, pos, emb, labels, logits_to_keep, return_mtp_hidden)

    def _merge_vision(self, ids, emb, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw):
        """Packed token embeddings with every image / video placeholder token replaced by the tower's output (in
        order: the k-th placeholder token of a kind takes the k-th merged patch of that kind)."""
        tower = self.visual_tower()
        if emb is None:
            emb = self.text_model.embed_tokens(ids)
        else:
            emb = emb.clone()
        cfg = self.config
        for name, px, grid, tok in (("image", pixel_values, image_grid_thw, cfg.image_token_id),
                                    ("video", pixel_values_videos, video_grid_thw, cfg.video_token_id)):
            if px is None:
                continue
            tower.check_inputs(px, grid, "pixel_values" if name == "image" else "pixel_values_videos")
            feats = tower(px.to(emb.device), grid.to(emb.device))
            mask = ids == tok
            if int(mask.sum()) != feats.shape[0]:
                raise ValueError(f"qwen4exp: {int(mask.sum())} {name} placeholder tokens (id {tok}) in input_ids "
                                 f"but {name}_grid_thw gives {feats.shape[0]} {name} embeddings")
            emb[mask] = feats.to(emb.dtype)
        return emb

    def _mrope_prefill_positions(self, ids, cu, valid, cache, mm_token_type_ids, image_grid_thw, video_grid_thw):
        """(t, h, w) positions [3, T] of the packed prompt tokens (``layers.rope.mrope_positions`` per row), and
        each row's delta for its later tokens. Without ``mm_token_type_ids`` the types come from the placeholder
        token ids."""
        if bool((cache.lengths > 0).any()):
            raise ValueError("qwen4exp: image_grid_thw / video_grid_thw must come with a row's first forward (an "
                             "empty past_key_values); continue a cached row with text")
        cfg = self.config
        if mm_token_type_ids is not None:
            types = mm_token_type_ids[:, -valid.shape[1]:].to(ids.device)[valid].long()
        else:
            types = (ids == cfg.image_token_id).long() * IMAGE + (ids == cfg.video_token_id).long() * VIDEO
        merge = cfg.vision_config.spatial_merge_size
        img = iter(image_grid_thw.tolist() if image_grid_thw is not None else [])
        vid = iter(video_grid_thw.tolist() if video_grid_thw is not None else [])
        pos = torch.empty(3, ids.numel(), dtype=torch.long)
        cl = cu.tolist()
        for b in range(len(cl) - 1):
            pos[:, cl[b]:cl[b + 1]], cache.rope_deltas[b] = mrope_positions(types[cl[b]:cl[b + 1]], img, vid, merge)
        if next(img, None) is not None or next(vid, None) is not None:
            raise ValueError("qwen4exp: image_grid_thw / video_grid_thw hold more entries than input_ids has "
                             "placeholder runs for")
        cache.mrope = True
        return pos.to(ids.device)
