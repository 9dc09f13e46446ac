"""QSA: Qwen Sparse Attention (the ``indexed_attention`` layers; ``full_attention`` in official configs).

Main attention: [Q | gate] = W_q x (per head: d_h query dims then d_h gate dims), K = W_k x, V = W_v x;
Q, K zero-centred-RMS-normed per head, then partial RoPE; GQA; softmax(QK^T / sqrt(d_h)) over the selected tokens;
output o * sigmoid(gate), then W_o.
Indexer: [q_1..q_h | kappa] = W_idx x; queries normed + rotated; raw keys kappa are kept un-normed and un-rotated;
complete blocks of r raw keys are mean-pooled, normed and rotated at the block's first position (``block_keys``).

This module is only the math of those pieces; the runtime keeps K/V, block keys and the open block's raw keys, and
runs the selection + attention (``qwen4exp.ops.qsa``) over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.layout import stacked_weight
from ..ops.qsa.reference import output_gate
from .linear import LinearFactory, default_linear, linear_weight
from .norms import RMSNorm
from .rope import apply_rope, norm_rope_many


@dataclass
class QSAProjections:
    q: torch.Tensor  # [T, Hq, d] normed + rotated
    gate: torch.Tensor  # [T, Hq, d] (a view of the [Q | gate] projection's output)
    k: torch.Tensor  # [T, Hkv, d] normed + rotated
    v: torch.Tensor  # [T, Hkv, d]
    index_q: torch.Tensor  # [T, h_i, d_i] normed + rotated
    index_k_raw: torch.Tensor  # [T, d_i] raw (un-normed, un-rotated)


class QSAIndexer(nn.Module):
    def __init__(self, config, linear: LinearFactory = default_linear, prefix: str = ""):
        super().__init__()
        self.n_heads, self.head_dim = config.indexer_n_heads, config.indexer_head_dim
        self.index_qk_proj = linear(config.hidden_size, (self.n_heads + 1) * self.head_dim,
                                    prefix=f"{prefix}.index_qk_proj")
        self.q_layernorm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)


class QSAAttention(nn.Module):
    def __init__(self, config, linear: LinearFactory = default_linear, prefix: str = ""):
        super().__init__()
        missing = [f for f in ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
                   if getattr(config, f, None) is None]
        if missing:
            raise ValueError(f"Qwen4Exp config field `{missing[0]}`: QSA (indexed attention) layers need "
                             f"{', '.join(missing)} set")
        D = config.hidden_size
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.scale = self.head_dim ** -0.5
        self.r, self.budget = config.indexer_compress_ratio, config.indexer_budget
        self.q_proj = linear(D, 2 * self.n_heads * self.head_dim, prefix=f"{prefix}.q_proj")
        self.k_proj = linear(D, self.n_kv * self.head_dim, prefix=f"{prefix}.k_proj")
        self.v_proj = linear(D, self.n_kv * self.head_dim, prefix=f"{prefix}.v_proj")
        self.o_proj = linear(self.n_heads * self.head_dim, D, prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.indexer = QSAIndexer(config, linear, f"{prefix}.indexer")
        self.index_scale = self.indexer.head_dim ** -0.5

    def _linears(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x W^T for [Q | gate], K, V and the indexer's [q | kappa]: ONE GEMM where a runtime laid the four weights
        out as row ranges of one buffer (``ops.layout.stacked_weight``; the outputs are then column slices), else
        four."""
        mods = (self.q_proj, self.k_proj, self.v_proj, self.indexer.index_qk_proj)
        ws = [linear_weight(m) for m in mods]
        w = stacked_weight(ws, pad=8)
        if w is None:
            return [m(x) for m in mods]
        sizes = [wi.shape[0] for wi in ws]
        return list(F.linear(x, w)[..., :sum(sizes)].split(sizes, -1))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> QSAProjections:
        T, d = x.shape[0], self.head_dim
        qg, k, v, iqk = self._linears(x)
        qg = qg.view(T, self.n_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]
        v = v.view(T, self.n_kv, d)
        ix = self.indexer
        iq = iqk[:, : ix.n_heads * ix.head_dim].view(T, ix.n_heads, ix.head_dim)
        # the three norm + RoPEs (queries, keys, indexer queries): one launch on GPUs
        q, k, iq = norm_rope_many([(q, self.q_norm.weight, self.q_norm.eps),
                                   (k.view(T, self.n_kv, d), self.k_norm.weight, self.k_norm.eps),
                                   (iq, ix.q_layernorm.weight, ix.q_layernorm.eps)], cos, sin)
        return QSAProjections(q, gate, k, v, iq, iqk[:, ix.n_heads * ix.head_dim:])

    def block_keys(self, pooled: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Mean-pooled raw keys [Nb, d_i] -> normed, rotated block keys (cos/sin at each block's first token)."""
        return apply_rope(self.indexer.k_layernorm(pooled).unsqueeze(1), cos, sin).squeeze(1)

    def output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """o [T, Hq, d] (attention output in the activation dtype) -> W_o (o * sigmoid(gate)); gate None: o is
        gated already (a runtime's attention kernel applied ``output_gate``)."""
        if gate is not None:
            o = output_gate(o, gate)
        return self.o_proj(o.reshape(o.shape[0], -1))
