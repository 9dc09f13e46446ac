"""Vision tower (Qwen3-VL style) parameters, so official checkpoints load with their ``model.visual.*`` weights.

The tower's forward lands in a later issue; until then image and video inputs are refused with a clear error.
"""

from __future__ import annotations

import torch
from torch import nn


class VisionTower(nn.Module):
    def __init__(self, vc):
        super().__init__()
        C, P, Tp, W = vc.in_channels, vc.patch_size, vc.temporal_patch_size, vc.hidden_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(C, W, (Tp, P, P), stride=(Tp, P, P), bias=True)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, W)
        self.blocks = nn.ModuleList()
        for _ in range(vc.depth):
            b = nn.Module()
            b.norm1, b.norm2 = nn.LayerNorm(W, eps=1e-6), nn.LayerNorm(W, eps=1e-6)
            b.attn = nn.Module()
            b.attn.qkv, b.attn.proj = nn.Linear(W, 3 * W), nn.Linear(W, W)
            b.mlp = nn.Module()
            b.mlp.linear_fc1, b.mlp.linear_fc2 = nn.Linear(W, vc.intermediate_size), nn.Linear(vc.intermediate_size, W)
            self.blocks.append(b)
        m = vc.spatial_merge_size ** 2
        self.merger = nn.Module()
        self.merger.norm = nn.LayerNorm(W, eps=1e-6)
        self.merger.linear_fc1 = nn.Linear(W * m, W * m)
        self.merger.linear_fc2 = nn.Linear(W * m, vc.out_hidden_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "qwen4exp: the Qwen4Exp vision tower is not implemented yet (image/video inputs: pixel_values, "
            "image_grid_thw, video_grid_thw); use text-only inputs for now")
