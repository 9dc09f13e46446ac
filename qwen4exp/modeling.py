"""Model assembly shared by every runtime: the decoder layer (PLE -> HC mix -> token mixer -> write-back -> HC mix
-> MoE -> write-back) and the text backbone's module tree, named as in the official checkpoint.

Runtimes (``qwen4exp.hf``, ``qwen4exp.vllm``) build this tree (choosing linear layers, experts and token mixers) and
call ``DecoderLayer.forward`` with callables that bind their own caches.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .configuration import INDEXED, LINEAR
from .layers.gdn import GatedDeltaNet
from .layers.hyper_connection import HyperConnection
from .layers.linear import LinearFactory, default_linear
from .layers.moe import MoE
from .layers.ple import PLE
from .layers.qsa import QSAAttention
from .ops.layout import colocate_rows


def ple_index_of(config, layer_idx: int) -> int | None:
    """Dense rank of a layer among the (one-indexed) PLE layer ids, or None."""
    ids = list(config.ple_layer_ids or [])
    return ids.index(layer_idx + 1) if layer_idx + 1 in ids else None


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_idx: int,
        linear: LinearFactory = default_linear,
        prefix: str = "",
        mixer: nn.Module | None = None,
        layer_type: str | None = None,
        with_ple: bool = True,
        moe: Callable[..., nn.Module] = MoE,
        ple_table: Callable[[int, int], nn.Module] | None = None,
    ):
        """``moe(config, linear, prefix)``: the MoE block (a runtime's subclass of ``MoE``); ``ple_table(rows, dim)``:
        the PLE layer's n-gram table module (default ``layers.ple.NGramTable``, on the default device)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = layer_type or config.layer_types[layer_idx]
        if self.layer_type == LINEAR:
            self.linear_attn = mixer if mixer is not None else GatedDeltaNet(config, linear, f"{prefix}.linear_attn")
        elif self.layer_type == INDEXED:
            self.self_attn = mixer if mixer is not None else QSAAttention(config, linear, f"{prefix}.self_attn")
        else:
            raise ValueError(f"layer {layer_idx}: unknown layer type {self.layer_type!r}")
        self.mlp = moe(config, linear, f"{prefix}.mlp")
        q = ple_index_of(config, layer_idx) if with_ple else None
        self.ple = PLE(config, q, linear, f"{prefix}.ple", ple_table) if q is not None else None
        self.attn_hyper_connection = HyperConnection(config, True, linear, f"{prefix}.attn_hyper_connection")
        self.mlp_hyper_connection = HyperConnection(config, True, linear, f"{prefix}.mlp_hyper_connection")

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.layer_type == LINEAR else self.self_attn

    def forward(
        self,
        H: torch.Tensor,  # [T, n*D] residual streams
        mix: Callable[[torch.Tensor], torch.Tensor],  # block input [T, D] -> block output [T, D]
        ple: Callable[[torch.Tensor], torch.Tensor] | None = None,  # H -> PLE(H)
        Hn: torch.Tensor | None = None,  # H normalised for this layer's first mixer (the previous layer's ``then``)
        then: HyperConnection | None = None,  # the mixer that reads this layer's output (see ``next_mixer``)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (H, H normalised for ``then``, or None without it). Each write-back also normalises the new streams
        for the mixer after it (one pass over them instead of two)."""
        if self.ple is not None:
            if ple is None:
                raise RuntimeError(f"layer {self.layer_idx} has PLE but no PLE state was bound")
            if Hn is not None:
                raise RuntimeError(f"layer {self.layer_idx}: its mixer reads H + PLE(H), not the handed-in norm")
            H = H + ple(H)
        x, c = self.attn_hyper_connection(H, Hn)
        H, Hn = self.mlp_hyper_connection.inject_norm(H, c, mix(x))
        x, c = self.mlp_hyper_connection(H, Hn)
        if then is None:
            return HyperConnection.inject(H, c, self.mlp(x)), None
        return then.inject_norm(H, c, self.mlp(x))


def next_mixer(layers, i: int, final: HyperConnection | None) -> HyperConnection | None:
    """The mixer that reads layer i's output: the next layer's first one (None if that layer adds PLE first: its
    mixer reads H + PLE(H)), or ``final`` after the last layer."""
    if i + 1 == len(layers):
        return final
    nxt = layers[i + 1]
    return None if nxt.ple is not None else nxt.attn_hyper_connection


def embed_streams(embeds: torch.Tensor, n: int) -> torch.Tensor:
    """[T, D] token embeddings -> [T, n*D]: every stream starts as a copy."""
    return embeds.repeat(*([1] * (embeds.dim() - 1)), n)


def colocate_projections(model: nn.Module) -> int:
    """One buffer each for the projections that read the same input, so that each group runs as one GEMM: every
    hyper-connection's W_down and W_inj (the many-token HC path, ``ops.hyper_connection.adjacent_rows``) and every
    QSA layer's q, k, v and indexer projections (``QSAAttention._linears``; one GEMM instead of four a layer at
    every step). Returns how many groups were joined."""
    joined = 0
    for m in model.modules():
        if isinstance(m, HyperConnection) and m.block_inject_weight is not None:
            mods = (m.input_mix_weight_down, m.block_inject_weight)
        elif isinstance(m, QSAAttention):
            mods = (m.q_proj, m.k_proj, m.v_proj, m.indexer.index_qk_proj)
        else:
            continue
        ws = [getattr(x, "weight", None) for x in mods]
        joined += colocate_rows(ws) if all(w is not None for w in ws) else 0
    return joined
