"""HF transformers runtime: ``Qwen4ExpForCausalLM`` and ``Qwen4ExpForConditionalGeneration`` (PreTrainedModel +
GenerationMixin) over the shared model assembly.

Batches are packed internally: padding tokens are dropped (each row's real tokens form one sequence), the model runs
on the packed tokens, and logits are scattered back to [B, S, V] (zeros at padding positions). Positions count real
tokens, so a left-padded row behaves exactly like the same row unpadded.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..configuration import INDEXED, LINEAR, Qwen4ExpConfig, Qwen4ExpTextConfig
from ..layers.mtp import MTPInput
from ..layers.norms import GatedRMSNorm, RMSNorm
from ..layers.hyper_connection import HyperConnection
from ..layers.moe import Experts
from ..layers.ple import NGramTable, PLE
from ..layers.gdn import GatedDeltaNet
from ..layers.rope import RotaryEmbedding
from ..layers.vision import VisionTower
from ..modeling import DecoderLayer, embed_streams
from ..ops.qsa import block_mean, qsa_attention
from .cache import Qwen4ExpHybridCache


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

    def forward_packed(
        self,
        ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T] or [3, T] RoPE positions
        cu_seqlens: torch.Tensor,  # [N+1]
        cache: Qwen4ExpHybridCache,
        rows: torch.Tensor,  # [N] cache row of each sequence
        embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final hidden [T, D], pre-mixer multi-stream state [T, nD])."""
        c = self.config
        emb = self.embed_tokens(ids) if embeds is None else embeds
        dtype = emb.dtype
        H = embed_streams(emb, c.hc_count)
        cos, sin = self.rotary_emb(positions, dtype)
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        starts = cache.lengths[rows].to(ids.device)
        tok_idx = torch.repeat_interleave(starts - cu_seqlens[:-1], lens) + torch.arange(ids.numel(), device=ids.device)
        rows_l = rows.tolist()
        for i, layer in enumerate(self.layers):
            st = cache.layers[i]
            ple_fn = None
            if layer.ple is not None:
                def ple_fn(H, layer=layer, st=st):
                    out, st["ple_ctx"][rows], st["ple_conv"][rows] = layer.ple(
                        H, ids, cu_seqlens, st["ple_ctx"][rows], st["ple_conv"][rows])
                    return out
            if layer.layer_type == LINEAR:
                def mix(x, layer=layer, st=st):
                    y, st["conv"][rows], st["ssm"][rows] = layer.linear_attn(
                        x, cu_seqlens, st["conv"][rows], st["ssm"][rows])
                    return y
            else:
                def mix(x, layer=layer, st=st):
                    return _qsa_mix(layer.self_attn, self.rotary_emb, x, cos, sin, positions, tok_idx, cu_seqlens,
                                    [st["qsa"][r] for r in rows_l])
            H = layer(H, mix, ple_fn)
        out, _ = self.hyper_connection_mixer(H)
        return out, H


def _qsa_mix(attn, rotary, x, cos, sin, positions, tok_idx, cu_seqlens, row_states):
    """QSA over packed tokens with per-row caches: store K/V, complete block keys incrementally, select, attend."""
    p = attn.project(x, cos, sin)
    out = torch.empty_like(p.q)
    r = attn.r
    cu = cu_seqlens.tolist()
    for b, st in enumerate(row_states):
        s, e = cu[b], cu[b + 1]
        if s == e:
            continue
        st.k.append(p.k[s:e])
        st.v.append(p.v[s:e])
        raw, pos = p.index_k_raw[s:e], positions[..., s:e]
        if st.open_keys is not None and st.open_keys.shape[0]:
            raw = torch.cat([st.open_keys, raw], 0)
            pos = torch.cat([st.open_pos, pos], -1)
        nfull = raw.shape[0] // r
        if nfull:
            cb, sb = rotary(pos[..., : nfull * r: r], raw.dtype)
            st.block_keys.append(attn.block_keys(block_mean(raw[: nfull * r], r), cb, sb))
        st.open_keys, st.open_pos = raw[nfull * r:], pos[..., nfull * r:]
        out[s:e] = qsa_attention(p.q[s:e], st.k.view(), st.v.view(), tok_idx[s:e], p.index_q[s:e],
                                 st.block_keys.view(), r, attn.budget, attn.scale, attn.index_scale)
    return attn.output(out, p.gate)


class Qwen4ExpMTP(MTPInput):
    """The MTP draft head (``mtp.*``): input fusion, QSA decoder layer(s), its own final mixer, optional head."""

    def __init__(self, config, num_layers: int, has_shared_head: bool = False):
        super().__init__(config, prefix="mtp")
        self.layers = nn.ModuleList(DecoderLayer(config, i, prefix=f"mtp.layers.{i}", layer_type=INDEXED,
                                                 with_ple=False) for i in range(num_layers))
        self.hyper_connection_mixer = HyperConnection(config, inject=False, prefix="mtp.hyper_connection_mixer")
        if has_shared_head:
            self.shared_head = nn.Module()
            self.shared_head.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class Qwen4ExpPreTrainedModel(PreTrainedModel):
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
        elif hasattr(module, "gate") and hasattr(module.gate, "weight") and module.gate.__class__.__name__ == "Router":
            module.gate.weight.normal_(0.0, std)
        if isinstance(module, PLE):
            module.conv1d.weight.zero_()

    # ---------------------------------------------------------------------------------------------------------------
    # loading / saving in the official checkpoint format
    @classmethod
    def from_pretrained(cls, path, *, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
                        config=None, **kwargs):
        from .loading import load_pretrained

        if kwargs.pop("torch_dtype", None) is not None and dtype is None:
            raise TypeError("qwen4exp: use dtype=..., not torch_dtype=...")
        if kwargs:
            raise TypeError(f"qwen4exp from_pretrained: unsupported arguments {sorted(kwargs)}")
        return load_pretrained(cls, path, dtype=dtype, device=device, config=config)

    def save_pretrained(self, save_directory, **kwargs):
        from .loading import save_pretrained

        save_pretrained(self, save_directory, **kwargs)

    # ---------------------------------------------------------------------------------------------------------------
    @property
    def text_model(self) -> Qwen4ExpTextModel:
        raise NotImplementedError

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length, *args, **kwargs):
        if generation_config.num_beams and generation_config.num_beams > 1:
            raise NotImplementedError("qwen4exp: beam search is not supported (num_beams must be 1)")
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
            model_kwargs["past_key_values"] = self.new_cache(batch_size)

    def new_cache(self, batch_size: int) -> Qwen4ExpHybridCache:
        p = self.text_model.embed_tokens.weight
        return Qwen4ExpHybridCache(self.config.get_text_config(), batch_size, p.dtype, p.device)

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
        for k in ("logits_to_keep", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            if kwargs.get(k) is not None:
                model_inputs[k] = kwargs[k]
        return model_inputs

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
        if pixel_values is not None or pixel_values_videos is not None:
            self.visual_tower()(pixel_values if pixel_values is not None else pixel_values_videos,
                                image_grid_thw if image_grid_thw is not None else video_grid_thw)
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
        ids = input_ids[valid]
        if position_ids is not None:
            pos = position_ids[1:] if position_ids.dim() == 3 and position_ids.shape[0] == 4 else position_ids
            pos = pos[..., -S:]
            pos = pos[:, valid] if pos.dim() == 3 else pos[valid]
        else:
            base = cache.lengths.to(input_ids.device)
            pos = torch.repeat_interleave(base - cu[:-1], lens) + torch.arange(ids.numel(), device=ids.device)
        emb = inputs_embeds[valid] if inputs_embeds is not None else None
        rows = torch.arange(B)
        hidden, H = tm.forward_packed(ids, pos, cu, cache, rows, emb)
        cache.lengths += lens.cpu()
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
        out = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache if use_cache else None)
        if return_mtp_hidden:
            Hs = H.new_zeros((B, S, H.shape[-1]))
            Hs[valid] = H
            out["mtp_hidden"] = Hs
        return out

    def visual_tower(self):
        raise NotImplementedError("qwen4exp: Qwen4ExpForCausalLM is text-only; image/video inputs need "
                                  "Qwen4ExpForConditionalGeneration")


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


class Qwen4ExpModel(nn.Module):
    def __init__(self, config: Qwen4ExpConfig):
        super().__init__()
        self.visual = VisionTower(config.vision_config)
        self.language_model = Qwen4ExpTextModel(config.text_config, prefix="model.language_model")


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
