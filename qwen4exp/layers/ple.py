"""PLE: per-layer hashed n-gram embeddings injected into every residual stream.

emb = concat of G hashed table rows (``qwen4exp.ops.ple``); k = GroupedNorm(W_key emb) [n x D];
v = W_val emb [D]; q = GroupedNorm(H) [n x D]; d_s = <k_s, q_s> / sqrt(D);
g_s = sigmoid(sign(d_s) sqrt(max(|d_s|, 1e-6))); u_s = g_s v; u~ = GroupedNorm(u);
z = SiLU(dilated causal depthwise conv(u~), kernel K_p, dilation n);  PLE(H) = u + z.

State per sequence: the last n-1 token ids (``ctx``, EOS-filled at start) and the last (K_p-1)*n conv inputs.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..configuration import first_eos
from ..ops.ple import (hash_multipliers, head_table_sizes, lookup_to, ngram_context, ngram_ids, ngram_lookup_decode,
                       ple_mix, table_rows)
from .linear import LinearFactory, default_linear
from .norms import RMSNorm


class NGramTable(nn.Module):
    """The shared hashed table [R, d_g]: bf16/fp32, or fp8 with a per-tensor ``weight_scale``. ``weight``: the
    [R, d_g] parameter where a runtime placed it (the vLLM plugin on GPUs: page-locked host memory,
    ``qwen4exp.vllm.layers.host_ngram_table``); default a new one on the default device."""

    def __init__(self, rows: int, dim: int, weight: nn.Parameter | None = None):
        super().__init__()
        if weight is not None and tuple(weight.shape) != (rows, dim):
            raise ValueError(f"NGramTable: weight of shape {tuple(weight.shape)}, expected {(rows, dim)}")
        self.weight = nn.Parameter(torch.empty(rows, dim)) if weight is None else weight
        self.register_buffer("weight_scale", None)

    def set_scale(self, scale: torch.Tensor | None) -> None:
        self.weight_scale = None if scale is None else scale.float().reshape(())


class NGramEmbedding(nn.Module):
    def __init__(self, config, ple_index: int, table: Callable[[int, int], nn.Module] | None = None):
        """``table(rows, dim)``: a runtime's n-gram table module (default ``NGramTable``)."""
        super().__init__()
        self.n = config.ngram_size
        self.heads_per_ngram = config.heads_per_ngram
        G = (self.n - 1) * self.heads_per_ngram
        self.dim = config.ple_embed_dim // G
        self.eos = first_eos(config.eos_token_id)
        sizes = head_table_sizes(config.ngram_vocab_size_base, G, ple_index)
        offsets = [0]
        for s in sizes[:-1]:
            offsets.append(offsets[-1] + s)
        self.rows = table_rows(sizes, config.make_ngram_vocab_size_divisible_by)
        self.register_buffer("layer_multipliers", torch.tensor(
            hash_multipliers(config.vocab_size, self.n, ple_index, config.seed), dtype=torch.long))
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes, dtype=torch.long))
        self.register_buffer("ngram_heads_offsets", torch.tensor(offsets, dtype=torch.long))
        self.ngram_embedding = (table or NGramTable)(self.rows, self.dim)

    def forward(self, ids, cu_seqlens, ctx_state, out_dtype):
        """``cu_seqlens`` None: one token per sequence (decode; fixed shapes, no host sync)."""
        t = self.ngram_embedding
        if cu_seqlens is None:  # decode: context, hashing and gather as one op
            return ngram_lookup_decode(ids, ctx_state, self.eos, self.layer_multipliers, self.ngram_heads_vocab_sizes,
                                       self.ngram_heads_offsets, self.heads_per_ngram, t.weight, t.weight_scale,
                                       out_dtype)
        ctx = ngram_context(ids, cu_seqlens, ctx_state, self.eos)
        rows = ngram_ids(ctx, self.layer_multipliers, self.ngram_heads_vocab_sizes, self.ngram_heads_offsets,
                         self.heads_per_ngram)
        # a pinned host table with GPU ids: the GPU gathers the rows through unified addressing
        emb = lookup_to(ids.device, t.weight, rows, t.weight_scale, out_dtype)
        return emb, _next_context(ids, cu_seqlens, ctx_state)

    def verify(self, ids, ctx_state, nq: int, out_dtype):
        """``forward``'s decode form over ``nq`` consecutive tokens a sequence in one call (an MTP verification):
        ids [N * nq] (row b * nq + j: token j of sequence b), ctx_state [N, n-1] the ids before the first ->
        (embeddings [N * nq, ...], the context after each token [N, nq, n-1]). Token j's previous ids are the
        window j .. j + n-1 of (ctx_state, the sequence's ids), so every token is computed as stepping one at a
        time would. Fixed shapes, no host sync."""
        N, c = ctx_state.shape
        seq = torch.cat([ctx_state.long(), ids.view(N, nq).long()], 1)  # [N, c + nq]
        emb, nxt = self.forward(ids, None, seq.unfold(1, c, 1)[:, :nq].reshape(N * nq, c), out_dtype)
        return emb, nxt.view(N, nq, c)


def _next_context(ids, cu_seqlens, prev):
    """Last n-1 ids of each sequence's history (prev context followed by the new ids of packed sequences)."""
    c = prev.shape[1]
    if c == 0:
        return prev
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    j = torch.arange(c, device=ids.device)
    src = lens.unsqueeze(1) - c + j  # index into the new ids; < 0 -> from prev
    from_new = ids[(cu_seqlens[:-1].unsqueeze(1) + src).clamp(min=0, max=max(ids.numel() - 1, 0))]
    from_prev = prev.gather(1, (src + c).clamp(min=0, max=c - 1))
    return torch.where(src >= 0, from_new, from_prev).to(prev.dtype)


class PLE(nn.Module):
    def __init__(self, config, ple_index: int, linear: LinearFactory = default_linear, prefix: str = "",
                 table: Callable[[int, int], nn.Module] | None = None):
        super().__init__()
        n, D, Ep = config.hc_count, config.hidden_size, config.ple_embed_dim
        self.n, self.D = n, D
        self.dilation = config.ngram_size
        self.kernel = config.ple_conv_kernel_size
        self.ple_embedding = NGramEmbedding(config, ple_index, table)
        self.key_proj = linear(Ep, n * D, prefix=f"{prefix}.key_proj")
        self.value_proj = linear(Ep, D, prefix=f"{prefix}.value_proj")
        eps = config.rms_norm_eps
        self.norm_key = RMSNorm(n * D, eps=eps, group=D)
        self.norm_query = RMSNorm(n * D, eps=eps, group=D)
        self.norm_conv = RMSNorm(n * D, eps=eps, group=D)
        self.conv1d = nn.Conv1d(n * D, n * D, self.kernel, groups=n * D, dilation=self.dilation, bias=False)

    @staticmethod
    def state_shapes(config) -> tuple[tuple[int, int], tuple[int]]:
        """Per-sequence state of one PLE layer: dilated-conv inputs [nD, (K_p-1)*n] (model dtype) and the last n-1
        token ids [n-1]. The one source for every runtime's cache (``hf.cache``, the vLLM plugin's state slots)."""
        nD = config.hc_count * config.hidden_size
        return (nD, (config.ple_conv_kernel_size - 1) * config.ngram_size), (config.ngram_size - 1,)

    @property
    def context_len(self) -> int:
        return self.ple_embedding.n - 1

    @property
    def conv_state_len(self) -> int:
        return (self.kernel - 1) * self.dilation

    def embed(
        self,
        ids: torch.Tensor,  # [T] raw token ids
        cu_seqlens: torch.Tensor | None,  # None: one token per sequence (decode, graph-capturable)
        ctx_state: torch.Tensor,  # [N, n-1] int64
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The part that needs only the token ids: n-gram rows, table gather, key and value projections ->
        (normed keys [T, nD], values [T, D], the new n-gram context). A runtime may run it ahead of the layer (the
        table gather reads host memory: the vLLM model can overlap it with the layers before this one)."""
        emb, ctx_state = self.ple_embedding(ids, cu_seqlens, ctx_state, dtype)
        return (*self.project(emb), ctx_state)

    def project(self, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered n-gram embeddings [T, Ep] -> (normed keys [T, nD], values [T, D]): per token, so a runtime that
        steps the n-gram context one position at a time (speculative verification) projects all positions at once."""
        return self.norm_key(self.key_proj(emb)), self.value_proj(emb)

    def mix(
        self,
        H: torch.Tensor,  # [T, nD]
        k: torch.Tensor,  # [T, nD] and
        v: torch.Tensor,  # [T, D] from ``embed``
        cu_seqlens: torch.Tensor | None,
        conv_state: torch.Tensor | None,  # [N, nD, (K-1)*n]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated, convolved injection of the embedded n-grams into the streams -> (PLE(H), new conv state)."""
        return ple_mix(H, k, v, self.norm_query.weight, self.norm_conv.weight, self.conv1d.weight.squeeze(1),
                       cu_seqlens, conv_state, self.n, self.norm_query.eps, self.dilation)

    def mix_verify(self, H, k, v, conv_state, nq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``mix``'s decode form over ``nq`` consecutive tokens a sequence (an MTP verification): H, k, v rows
        b * nq + j (token j of sequence b), conv_state [N, nD, S] the state before the first -> (PLE(H) [N * nq,
        nD], the conv state after each token [N, nq, nD, S]), each token computed from its own state as stepping
        one at a time would, in two calls of the one-token form: the first (every token from the first state)
        yields each token's conv input as its new state's last column, and the state before token j is the
        window j .. j + S of (conv_state, those inputs). Fixed shapes, no host sync."""
        N, nD, S = conv_state.shape
        rows = N * nq
        _, first = self.mix(H, k, v, None, conv_state.repeat_interleave(nq, 0))
        x = first[:, :, -1].reshape(N, nq, nD).transpose(1, 2).to(conv_state.dtype)  # [N, nD, nq]
        before = torch.cat([conv_state, x], 2).unfold(2, S, 1)[:, :, :nq]  # [N, nD, nq, S]
        out, new = self.mix(H, k, v, None, before.permute(0, 2, 1, 3).reshape(rows, nD, S))
        return out, new.view(N, nq, nD, S)

    def forward(
        self,
        H: torch.Tensor,  # [T, nD]
        ids: torch.Tensor,  # [T] raw token ids
        cu_seqlens: torch.Tensor | None,  # None: one token per sequence (decode, graph-capturable)
        ctx_state: torch.Tensor,  # [N, n-1] int64
        conv_state: torch.Tensor | None,  # [N, nD, (K-1)*n]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, v, ctx_state = self.embed(ids, cu_seqlens, ctx_state, H.dtype)
        out, conv_state = self.mix(H, k, v, cu_seqlens, conv_state)
        return out, ctx_state, conv_state
