"""MTP in the HF runtime: the draft head (``mtp.*``) and greedy speculative decoding with it (upstream transformers
cannot use the head).

The head pairs the target's pre-mixer state at position q with the token at q+1 and predicts the token at q+2. It has
its own QSA cache rows (``Qwen4ExpHybridCache.mtp_layers``). ``generate_mtp`` drafts k tokens with the head, verifies
them in one target forward, keeps the accepted prefix and rolls every state back past it (``hf.packed.rollback``):
the output equals plain greedy decoding.

The models expose this as ``generate(use_mtp=True)``, ``mtp_forward`` and ``mtp_logits`` (``hf.modeling``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..configuration import INDEXED
from ..layers.hyper_connection import HyperConnection
from ..layers.mtp import MTPInput
from ..modeling import DecoderLayer
from .cache import Qwen4ExpHybridCache
from .packed import rollback, run_layers


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


def _require_head(model) -> Qwen4ExpMTP:
    if model.mtp is None:
        raise ValueError("qwen4exp: this checkpoint has no MTP head (mtp.* weights)")
    return model.mtp


def _head(model, mtp: Qwen4ExpMTP) -> nn.Module:
    return mtp.shared_head.head if hasattr(mtp, "shared_head") else model.lm_head


def mtp_forward(model, H_prev: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                cache: Qwen4ExpHybridCache, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One MTP step over the tokens of one row: inputs pair the target's pre-mixer state at position q
    (``H_prev`` [T, nD]) with the token at q+1 (``next_ids`` [T]); -> (logits [T, V], draft state [T, nD])."""
    mtp = _require_head(model)
    tm = model.text_model
    H = mtp(tm.embed_tokens(next_ids), H_prev)
    rows = torch.tensor([row])
    cu = torch.tensor([0, next_ids.numel()], device=next_ids.device)
    H, _ = run_layers(mtp.layers[:1], H, next_ids, positions, cu, cache.mtp_layers[:1], rows,
                      cache.mtp_lengths[rows], tm.rotary_emb, cache.journal)
    cache.mtp_lengths[row] += next_ids.numel()
    out, _ = mtp.hyper_connection_mixer(H)
    return _head(model, mtp)(out), H


def mtp_logits(model, mtp_hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Training forward of the MTP head over whole unpadded rows (differentiable; no cache is kept).

    ``mtp_hidden`` [B, S, nD]: the target's pre-mixer state (``forward(..., return_mtp_hidden=True)``);
    ``input_ids`` [B, S]. Position q pairs the state at q with the token at q+1, exactly as ``mtp_forward``
    does at inference, and -> logits [B, S-1, V] where entry q predicts the token at q+2 (the last entry
    looks past the row and has no target)."""
    mtp = _require_head(model)
    B, S = input_ids.shape
    tm = model.text_model
    nxt = input_ids[:, 1:].reshape(-1)
    H = mtp(tm.embed_tokens(nxt), mtp_hidden[:, :-1].reshape(B * (S - 1), -1))
    pos = torch.arange(S - 1, device=input_ids.device).repeat(B)
    cu = torch.arange(B + 1, device=input_ids.device) * (S - 1)
    cache = model.new_cache(B)
    rows = torch.arange(B)
    H, _ = run_layers(mtp.layers[:1], H, nxt, pos, cu, cache.mtp_layers[:1], rows, cache.mtp_lengths[rows],
                      tm.rotary_emb)
    out, _ = mtp.hyper_connection_mixer(H)
    return _head(model, mtp)(out).view(B, S - 1, -1)


def draft(model, cache: Qwen4ExpHybridCache, H_pend: torch.Tensor, next_pend: torch.Tensor,
          pos_pend: torch.Tensor, k: int) -> list[int]:
    """k greedy draft tokens: one MTP pass over the pending (accepted) positions, then k-1 chained steps whose
    cache entries are dropped again (the next round re-feeds accepted positions with the target's state)."""
    logits, Hd = model.mtp_forward(H_pend, next_pend, pos_pend, cache)
    drafts = [int(logits[-1].argmax())]
    h, pos = Hd[-1:], int(pos_pend[-1])
    cache.journal = []
    for i in range(1, k):
        logits, h = model.mtp_forward(h, torch.tensor([drafts[-1]]), torch.tensor([pos + i]), cache)
        drafts.append(int(logits[-1].argmax()))
    rollback(cache.journal, 0, model.text_model.rotary_emb)
    cache.journal = None
    cache.mtp_lengths[0] -= k - 1
    return drafts


@torch.no_grad()
def generate_mtp(model, input_ids, max_new_tokens: int = 20, num_speculative_tokens: int = 3, eos_token_id=None,
                 attention_mask=None, do_sample: bool = False, num_beams: int | None = None,
                 num_return_sequences: int | None = None, generation_config=None, **unused) -> torch.Tensor:
    """Greedy speculative decoding of one unpadded sequence with ``model``'s MTP head -> input_ids + the new tokens
    (equal to plain greedy decoding). Drafts come from ``model._draft`` (``draft``); statistics land in
    ``model.last_mtp_stats``."""
    gc = generation_config if generation_config is not None else model.generation_config
    if (num_beams if num_beams is not None else (gc.num_beams or 1)) > 1:
        raise NotImplementedError("qwen4exp: use_mtp=True does not support beam search (num_beams > 1); drop "
                                  "use_mtp for beam search, or use num_beams=1")
    if (num_return_sequences if num_return_sequences is not None else (gc.num_return_sequences or 1)) > 1:
        raise NotImplementedError("qwen4exp: use_mtp=True returns one sequence (num_return_sequences must be 1)")
    if do_sample:
        raise NotImplementedError("qwen4exp: use_mtp=True supports greedy decoding only")
    if input_ids.shape[0] != 1 or (attention_mask is not None and not bool(attention_mask.all())):
        raise NotImplementedError("qwen4exp: use_mtp=True supports one unpadded sequence at a time")
    if model.mtp is None:
        raise ValueError("qwen4exp: use_mtp=True needs a checkpoint with an MTP head (mtp.* weights)")
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    cache = model.new_cache(1)
    out = model(input_ids, past_key_values=cache, use_cache=True, return_mtp_hidden=True)
    passes, steps, accepted_total = 1, 0, 0
    t_next = int(out.logits[0, -1].argmax())
    gen = [t_next]
    L0 = input_ids.shape[1]
    H_pend = out["mtp_hidden"][0]
    next_pend = torch.cat([input_ids[0, 1:], torch.tensor([t_next])])
    pos_pend = torch.arange(L0)
    while len(gen) < max_new_tokens and t_next not in eos:
        k = min(num_speculative_tokens, max_new_tokens - len(gen))
        drafts = model._draft(cache, H_pend, next_pend, pos_pend, k)
        v_ids = torch.tensor([[t_next] + drafts])
        start = int(cache.lengths[0])
        cache.journal = []
        out = model(v_ids, past_key_values=cache, use_cache=True, return_mtp_hidden=True)
        passes += 1
        pred = out.logits[0].argmax(-1).tolist()
        j = 0
        while j < k and pred[j] == drafts[j] and drafts[j] not in eos:
            j += 1
        keep = j + 1
        if keep < k + 1:
            rollback(cache.journal, keep, model.text_model.rotary_emb)
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
    model.last_mtp_stats = {
        "target_forward_passes": passes, "verify_steps": steps, "accepted_drafts": accepted_total,
        "mean_acceptance_length": (1 + accepted_total / steps) if steps else float("nan"),
        "new_tokens": len(gen)}
    return torch.cat([input_ids, torch.tensor([gen], dtype=input_ids.dtype)], 1)

