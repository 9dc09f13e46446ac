"""HF transformers runtime: ``Qwen4ExpForCausalLM`` and ``Qwen4ExpForConditionalGeneration`` (PreTrainedModel +
GenerationMixin) over the shared model assembly.

Batches are packed internally: padding tokens are dropped (each row's real tokens form one sequence), the model runs
on the packed tokens, and logits are scattered back to [B, S, V] (zeros at padding positions). Positions count real
tokens, so a left-padded row behaves exactly like the same row unpadded.

``generate`` supports greedy, sampling and beam search (``num_beams`` > 1, ``num_return_sequences``): the hybrid cache
(``Qwen4ExpHybridCache.reorder_cache``) moves every per-row state (GDN, PLE, QSA, lengths) along with its beam.
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
from ..layers.rope import IMAGE, VIDEO, RotaryEmbedding, mrope_positions
from ..layers.vision import VisionTower
from ..modeling import DecoderLayer, embed_streams, next_mixer
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
        H = embed_streams(emb, c.hc_count)
        H, Hn = run_layers(self.layers, H, ids, positions, cu_seqlens, cache.layers, rows, cache.lengths[rows],
                           self.rotary_emb, cache.journal, self.hyper_connection_mixer)
        out, _ = self.hyper_connection_mixer(H, Hn)
        return out, H


def run_layers(layers, H, ids, positions, cu_seqlens, layer_states, rows, starts, rotary, journal=None, final=None):
    """Run decoder layers over packed tokens, binding each layer's per-row state (updated in place) -> (H, H
    normalised for the ``final`` mixer, or None without it).

    ``starts`` [N]: tokens each sequence had consumed before (QSA token indices). With a ``journal`` list, every
    state update is recorded so that ``rollback`` can keep only a prefix of these tokens (speculative decoding).
    """
    cos, sin = rotary(positions, H.dtype)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    tok_idx = torch.repeat_interleave(starts.to(ids.device) - cu_seqlens[:-1], lens) + \
        torch.arange(ids.numel(), device=ids.device)
    rows_l = rows.tolist()
    Hn = None
    for i, (layer, st) in enumerate(zip(layers, layer_states)):
        ple_fn = None
        if layer.ple is not None:
            def ple_fn(H, layer=layer, st=st):
                prev = (st["ple_ctx"][rows], st["ple_conv"][rows])
                if journal is not None:
                    journal.append(("ple", layer, st, rows, prev, H, ids))
                out, st["ple_ctx"][rows], st["ple_conv"][rows] = layer.ple(H, ids, cu_seqlens, *prev)
                return out
        if layer.layer_type == LINEAR:
            def mix(x, layer=layer, st=st):
                prev = (st["conv"][rows], st["ssm"][rows])
                if journal is not None:
                    journal.append(("gdn", layer, st, rows, prev, x, None))
                y, st["conv"][rows], st["ssm"][rows] = layer.linear_attn(x, cu_seqlens, *prev)
                return y
        else:
            def mix(x, layer=layer, st=st):
                row_states = [st["qsa"][r] for r in rows_l]
                if journal is not None:
                    journal.append(("qsa", layer, st, rows, [(rs.k.len, rs.block_keys.len, rs.open_keys,
                                                              rs.open_pos) for rs in row_states], None, None))
                return _qsa_mix(layer.self_attn, rotary, x, cos, sin, positions, tok_idx, cu_seqlens, row_states)
        H, Hn = layer(H, mix, ple_fn, Hn, next_mixer(layers, i, final))
    return H, Hn


def rollback(journal, keep: int, rotary) -> None:
    """Undo the journaled forward of ONE sequence except its first ``keep`` tokens: restore each state and replay the
    state update (not the whole model) on the kept tokens; QSA caches are cropped and their open block rebuilt."""
    for kind, layer, st, rows, prev, inp, ids in journal:
        cu = torch.tensor([0, keep], device=rows.device)
        if kind == "gdn":
            _, st["conv"][rows], st["ssm"][rows] = layer.linear_attn(inp[:keep], cu, *prev)
        elif kind == "ple":
            _, st["ple_ctx"][rows], st["ple_conv"][rows] = layer.ple(inp[:keep], ids[:keep], cu, *prev)
        else:
            for r, (klen, blen, open_k, open_p) in zip(rows.tolist(), prev):
                rs = st["qsa"][r]
                new_raw = rs.pending_raw
                rs.k.len = rs.v.len = klen + keep
                raw = torch.cat([x for x in (open_k, new_raw[:keep]) if x is not None], 0)
                pos = torch.cat([x for x in (open_p, rs.pending_pos[..., :keep]) if x is not None], -1)
                r_ = layer.self_attn.r
                nfull = raw.shape[0] // r_
                rs.block_keys.len = blen + nfull
                rs.open_keys, rs.open_pos = raw[nfull * r_:], pos[..., nfull * r_:]
    journal.clear()


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
        st.pending_raw, st.pending_pos = raw, pos
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
    # MTP: the draft head, and greedy speculative decoding with it (upstream transformers cannot use the head)
    def mtp_forward(self, H_prev: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                    cache: Qwen4ExpHybridCache, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step over the tokens of one row: inputs pair the target's pre-mixer state at position q
        (``H_prev`` [T, nD]) with the token at q+1 (``next_ids`` [T]); -> (logits [T, V], draft state [T, nD])."""
        if self.mtp is None:
            raise ValueError("qwen4exp: this checkpoint has no MTP head (mtp.* weights)")
        tm, mtp = self.text_model, self.mtp
        H = mtp(tm.embed_tokens(next_ids), H_prev)
        rows = torch.tensor([row])
        cu = torch.tensor([0, next_ids.numel()], device=next_ids.device)
        H, _ = run_layers(mtp.layers[:1], H, next_ids, positions, cu, cache.mtp_layers[:1], rows,
                          cache.mtp_lengths[rows], tm.rotary_emb, cache.journal)
        cache.mtp_lengths[row] += next_ids.numel()
        out, _ = mtp.hyper_connection_mixer(H)
        head = mtp.shared_head.head if hasattr(mtp, "shared_head") else self.lm_head
        return head(out), H

    def mtp_logits(self, mtp_hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Training forward of the MTP head over whole unpadded rows (differentiable; no cache is kept).

        ``mtp_hidden`` [B, S, nD]: the target's pre-mixer state (``forward(..., return_mtp_hidden=True)``);
        ``input_ids`` [B, S]. Position q pairs the state at q with the token at q+1, exactly as ``mtp_forward``
        does at inference, and -> logits [B, S-1, V] where entry q predicts the token at q+2 (the last entry
        looks past the row and has no target)."""
        if self.mtp is None:
            raise ValueError("qwen4exp: this checkpoint has no MTP head (mtp.* weights)")
        B, S = input_ids.shape
        tm, mtp = self.text_model, self.mtp
        nxt = input_ids[:, 1:].reshape(-1)
        H = mtp(tm.embed_tokens(nxt), mtp_hidden[:, :-1].reshape(B * (S - 1), -1))
        pos = torch.arange(S - 1, device=input_ids.device).repeat(B)
        cu = torch.arange(B + 1, device=input_ids.device) * (S - 1)
        cache = self.new_cache(B)
        rows = torch.arange(B)
        H, _ = run_layers(mtp.layers[:1], H, nxt, pos, cu, cache.mtp_layers[:1], rows, cache.mtp_lengths[rows],
                          tm.rotary_emb)
        out, _ = mtp.hyper_connection_mixer(H)
        head = mtp.shared_head.head if hasattr(mtp, "shared_head") else self.lm_head
        return head(out).view(B, S - 1, -1)

    def _draft(self, cache, H_pend, next_pend, pos_pend, k):
        """k greedy draft tokens: one MTP pass over the pending (accepted) positions, then k-1 chained steps whose
        cache entries are dropped again (the next round re-feeds accepted positions with the target's state)."""
        logits, Hd = self.mtp_forward(H_pend, next_pend, pos_pend, cache)
        drafts = [int(logits[-1].argmax())]
        h, pos = Hd[-1:], int(pos_pend[-1])
        cache.journal = []
        for i in range(1, k):
            logits, h = self.mtp_forward(h, torch.tensor([drafts[-1]]), torch.tensor([pos + i]), cache)
            drafts.append(int(logits[-1].argmax()))
        rollback(cache.journal, 0, self.text_model.rotary_emb)
        cache.journal = None
        cache.mtp_lengths[0] -= k - 1
        return drafts

    @torch.no_grad()
    def generate(self, *args, use_mtp: bool = False, **kwargs):
        """Transformers' ``generate``: greedy, sampling and beam search (``num_beams`` > 1, with
        ``num_return_sequences``, left-padded batches; the hybrid cache reorders every per-row state along the beams).

        ``use_mtp=True``: greedy speculative decoding with the MTP head (``num_speculative_tokens``, default 3);
        the output equals plain greedy decoding. One unpadded sequence, no sampling, no beam search. Statistics land
        in ``self.last_mtp_stats``."""
        if not use_mtp:
            return super().generate(*args, **kwargs)
        return self._generate_mtp(*args, **kwargs)

    def _generate_mtp(self, input_ids, max_new_tokens: int = 20, num_speculative_tokens: int = 3,
                      eos_token_id=None, attention_mask=None, do_sample: bool = False, num_beams: int | None = None,
                      num_return_sequences: int | None = None, generation_config=None, **unused):
        gc = generation_config if generation_config is not None else self.generation_config
        if (num_beams if num_beams is not None else (gc.num_beams or 1)) > 1:
            raise NotImplementedError("qwen4exp: use_mtp=True does not support beam search (num_beams > 1); drop "
                                      "use_mtp for beam search, or use num_beams=1")
        if (num_return_sequences if num_return_sequences is not None else (gc.num_return_sequences or 1)) > 1:
            raise NotImplementedError("qwen4exp: use_mtp=True returns one sequence (num_return_sequences must be 1)")
        if do_sample:
            raise NotImplementedError("qwen4exp: use_mtp=True supports greedy decoding only")
        if input_ids.shape[0] != 1 or (attention_mask is not None and not bool(attention_mask.all())):
            raise NotImplementedError("qwen4exp: use_mtp=True supports one unpadded sequence at a time")
        if self.mtp is None:
            raise ValueError("qwen4exp: use_mtp=True needs a checkpoint with an MTP head (mtp.* weights)")
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        cache = self.new_cache(1)
        out = self(input_ids, past_key_values=cache, use_cache=True, return_mtp_hidden=True)
        passes, steps, accepted_total = 1, 0, 0
        t_next = int(out.logits[0, -1].argmax())
        gen = [t_next]
        L0 = input_ids.shape[1]
        H_pend = out["mtp_hidden"][0]
        next_pend = torch.cat([input_ids[0, 1:], torch.tensor([t_next])])
        pos_pend = torch.arange(L0)
        while len(gen) < max_new_tokens and t_next not in eos:
            k = min(num_speculative_tokens, max_new_tokens - len(gen))
            drafts = self._draft(cache, H_pend, next_pend, pos_pend, k)
            v_ids = torch.tensor([[t_next] + drafts])
            start = int(cache.lengths[0])
            cache.journal = []
            out = self(v_ids, past_key_values=cache, use_cache=True, return_mtp_hidden=True)
            passes += 1
            pred = out.logits[0].argmax(-1).tolist()
            j = 0
            while j < k and pred[j] == drafts[j] and drafts[j] not in eos:
                j += 1
            keep = j + 1
            if keep < k + 1:
                rollback(cache.journal, keep, self.text_model.rotary_emb)
                cache.lengths[0] -= k + 1 - keep
                cache.columns -= k + 1 - keep
            cache.journal = None
            steps, accepted_total = steps + 1, accepted_total + j
            t_next = pred[j]
            gen += drafts[:j] + [t_next]
            H_pend = out["mtp_hidden"][0, :keep]
            next_pend = torch.tensor(drafts[:j] + [t_next])
            pos_pend = torch.arange(start, start + keep)
        gen = gen[:max_new_tokens]
        if eos and any(t in eos for t in gen):
            gen = gen[: next(i for i, t in enumerate(gen) if t in eos) + 1]
        self.last_mtp_stats = {
            "target_forward_passes": passes, "verify_steps": steps, "accepted_drafts": accepted_total,
            "mean_acceptance_length": (1 + accepted_total / steps) if steps else float("nan"),
            "new_tokens": len(gen)}
        return torch.cat([input_ids, torch.tensor([gen], dtype=input_ids.dtype)], 1)

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
        mm_token_type_ids: torch.Tensor | None = None,
        return_mtp_hidden: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if pixel_values is not None or pixel_values_videos is not None:
            self.visual_tower()  # text-only models refuse here
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
        grids = image_grid_thw is not None or video_grid_thw is not None
        if position_ids is not None:
            pos = position_ids[1:] if position_ids.dim() == 3 and position_ids.shape[0] == 4 else position_ids
            pos = pos[..., -S:]
            pos = pos[:, valid] if pos.dim() == 3 else pos[valid]
        elif grids:
            pos = self._mrope_prefill_positions(ids, cu, valid, cache, mm_token_type_ids, image_grid_thw,
                                                video_grid_thw)
        else:
            base = (cache.lengths + cache.rope_deltas).to(input_ids.device)
            pos = torch.repeat_interleave(base - cu[:-1], lens) + torch.arange(ids.numel(), device=ids.device)
            if cache.mrope:  # the rows' QSA caches hold (t, h, w) positions: keep three axes
                pos = pos.expand(3, -1)
        emb = inputs_embeds[valid] if inputs_embeds is not None else None
        if pixel_values is not None or pixel_values_videos is not None:
            emb = self._merge_vision(ids, emb, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
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

    # ---------------------------------------------------------------------------------------------------------------
    # images and video (Qwen4ExpForConditionalGeneration)
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
