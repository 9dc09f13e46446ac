"""One QSA layer's decode step over its paged cache (``layout``), from the step's lengths, cache slots and block
table alone: the per-row inputs (``decode_inputs``) and the cache writes (``decode_writes``) that come before the
selection + attention (``qsa_decode_paged``). Fixed shapes and no host sync, so a FULL CUDA graph can capture it.
Used by the vLLM plugin's uniform decode / MTP verification path (``qwen4exp.vllm.qsa``) and by the layer harness
(``benchmarks/bench_layer.py``), which has no vLLM."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from . import decode_cache_writes, layout


class DecodeInputs(NamedTuple):
    n: int  # rows: requests x queries per request (row b * nq + j is query j of request b)
    valid: torch.Tensor  # [n] bool: a real token (False: a request padding a captured batch)
    pos: torch.Tensor  # [n] int64 token positions (clamped to 0 on padding)
    slots: torch.Tensor  # [n] int64 cache slots (-1: padding)
    block_table: torch.Tensor  # [n, pages] each row's block-table row
    cos: torch.Tensor  # the rotation of the block key each row may complete (at the block's first position)
    sin: torch.Tensor


def decode_inputs(seq_lens: torch.Tensor, block_table: torch.Tensor, slot_mapping: torch.Tensor, nq: int, r: int,
                  rotary: Callable, dtype: torch.dtype, positions: torch.Tensor | None = None) -> DecodeInputs:
    """The rows of a batch of ``nq`` queries per request whose lengths (this step's tokens included) are
    ``seq_lens`` [B]: query j of request b is its token seq_len - nq + j. ``rotary(positions, dtype) -> (cos, sin)``;
    ``positions`` [3, T] (M-RoPE) rotate the block keys at the step's own positions (a decode token is text after
    the prompt: the block it completes starts r - 1 tokens earlier on every axis)."""
    B = seq_lens.shape[0]
    n = B * nq
    seq = seq_lens[:B].long()
    if nq == 1:
        pos, valid, bt = (seq - 1).clamp(min=0), seq > 0, block_table[:B]
    else:
        p = seq.unsqueeze(1) - nq + torch.arange(nq, device=seq.device)
        valid = ((seq > 0).unsqueeze(1) & (p >= 0)).reshape(n)
        pos, bt = p.clamp(min=0).reshape(n), block_table[:B].repeat_interleave(nq, 0)
    if positions is not None and positions.dim() == 2:
        cb, sb = rotary((positions[:, :n].long() - (r - 1)).clamp(min=0), dtype)
    else:
        cb, sb = rotary((pos - (r - 1)).clamp(min=0), dtype)
    slots = slot_mapping[:n].long()
    return DecodeInputs(n, valid, pos, slots, bt, cb, sb)


def decode_writes(kv: torch.Tensor, views: layout.IndexViews, k: torch.Tensor, v: torch.Tensor,
                  index_k_raw: torch.Tensor, inp: DecodeInputs, norm_weight: torch.Tensor, eps: float, r: int,
                  nq: int) -> None:
    """The step's K/V rows into the cache, its raw index keys into their pages' rings, and the key of every block a
    token completes (normed, rotated) into its page's key row (``decode_cache_writes``)."""
    n = inp.n
    # K|V rows, ring rows and block keys in one launch on GPUs (a row completing a block reads the step's earlier
    # rows' keys from ``raw`` there, rather than from the ring another program may not have written yet)
    decode_cache_writes(kv, views.index_kv, views.ring, inp.slots, inp.pos, inp.valid, k[:n], v[:n],
                        index_k_raw[:n], norm_weight, eps, inp.cos, inp.sin, r, nq)
