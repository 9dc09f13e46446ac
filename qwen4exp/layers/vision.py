"""The Qwen4Exp vision tower (``model.visual.*``): pixels of images / video frames -> text-width embeddings.

Input: ``pixel_values`` [N, C * Tp * P * P], the patches of every image or video laid end to end (the processor's
layout: per temporal group of Tp frames, the patches in spatial-merge-block order: block row, block column, then the
m x m patches inside the block), and ``grid_thw`` [n, 3] = (t, h, w) patches of each image / video (t temporal
groups of h x w patches). The function, per patch:

1. patch embedding: a linear map of the C x Tp x P x P pixels (the checkpoint's Conv3d with stride = kernel);
2. plus the learned square position grid (side x side) bilinearly resampled (align_corners) to the image's h x w;
3. ``depth`` pre-norm blocks (LayerNorm, attention, LayerNorm, MLP), the attention restricted to the patches of one
   temporal group of one image (segments of h * w patches), with 2-D RoPE: of the head dims' first half, the first
   quarter rotates by the patch's row, the second by its column (both with frequencies theta^(-4i/d), i < d/4), and
   rotate-half pairs dim j with j + d/2; the rotation is computed in fp32;
4. the merger: LayerNorm per patch, then the m x m patches of each merge block concatenated -> Linear, GELU, Linear
   to the text width: one output token per merge block, [N / m^2, out_hidden_size].

No deep-stack features: only the merger's output leaves the tower. Everything is vectorised over images of
different sizes (per-patch coordinates by ``repeat_interleave``; one attention call for all segments).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .rope import apply_rope

_ACTS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
}


def patch_coordinates(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, ...]:
    """grid_thw [n, 3] -> per patch (row, col, h, w) [N] each: its row and column in its frame's h x w patch grid,
    for patches in spatial-merge-block order, and its image's grid height and width."""
    grid_thw = grid_thw.long()
    counts = grid_thw.prod(-1)
    total = int(counts.sum())
    h = torch.repeat_interleave(grid_thw[:, 1], counts, output_size=total)
    w = torch.repeat_interleave(grid_thw[:, 2], counts, output_size=total)
    start = torch.repeat_interleave(counts.cumsum(0) - counts, counts, output_size=total)
    k = (torch.arange(total, device=grid_thw.device) - start) % (h * w)  # index inside its frame
    block, inner = k // (merge * merge), k % (merge * merge)
    bw = w // merge
    row = (block // bw) * merge + inner // merge
    col = (block % bw) * merge + inner % merge
    return row, col, h, w


def frame_lengths(grid_thw: torch.Tensor) -> torch.Tensor:
    """Attention segments: one per temporal group of each image / video, of h * w patches."""
    grid_thw = grid_thw.long()
    return torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])


def resample_grid(table: torch.Tensor, row, col, h, w) -> torch.Tensor:
    """The learned position grid ``table`` [side^2, W] bilinearly resampled (align_corners=True) to each patch's
    (row, col) of an h x w grid -> [N, W] fp32."""
    side = math.isqrt(table.shape[0])

    def taps(i, n):
        src = i.float() * (side - 1) / torch.clamp(n - 1, min=1)
        lo = src.floor()
        frac = src - lo
        lo = lo.long().clamp(0, side - 1)
        return lo, (lo + 1).clamp(max=side - 1), 1.0 - frac, frac

    r0, r1, wr0, wr1 = taps(row, h)
    c0, c1, wc0, wc1 = taps(col, w)
    t = table.float()
    return ((t[r0 * side + c0] * (wr0 * wc0)[:, None] + t[r0 * side + c1] * (wr0 * wc1)[:, None])
            + (t[r1 * side + c0] * (wr1 * wc0)[:, None] + t[r1 * side + c1] * (wr1 * wc1)[:, None]))


def vision_rope(row: torch.Tensor, col: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, ...]:
    """2-D RoPE tables [N, head_dim] fp32: first quarter rotated by row, second by column, repeated for the
    rotate-half partner half."""
    q = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, q, 2, dtype=torch.float, device=row.device) / q))
    f = torch.cat([row.float()[:, None] * inv, col.float()[:, None] * inv], -1)
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()


def segment_attention(q, k, v, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Bidirectional attention inside each segment of packed q, k, v [N, H, d] (segments of ``lens`` tokens)."""
    N, H, d = q.shape
    n = lens.numel()
    L = int(lens.max())
    if bool((lens == L).all()):  # equal segments (one image, a video): a plain batch
        qb, kb, vb = (x.view(n, L, H, d).transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(qb, kb, vb, scale=scale).transpose(1, 2).reshape(N, H, d)
    # ragged segments: right-pad to the longest, mask padded keys
    valid = torch.arange(L, device=q.device)[None] < lens[:, None]  # [n, L]
    qb, kb, vb = (x.new_zeros(n, L, H, d).index_put_((valid,), x).transpose(1, 2) for x in (q, k, v))
    mask = valid[:, None, None, :]
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
    return o.transpose(1, 2)[valid]


class VisionTower(nn.Module):
    def __init__(self, vc):
        super().__init__()
        C, P, Tp, W = vc.in_channels, vc.patch_size, vc.temporal_patch_size, vc.hidden_size
        self.hidden_size, self.num_heads, self.merge = W, vc.num_heads, vc.spatial_merge_size
        self.theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        act = getattr(vc, "hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTS:
            raise ValueError(f"qwen4exp: vision_config.hidden_act={act!r} is not supported ({sorted(_ACTS)})")
        self.act = _ACTS[act]
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

    @property
    def patch_dim(self) -> int:
        return self.patch_embed.proj.weight[0].numel()

    def check_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, name: str = "pixel_values") -> None:
        """Clear errors for inputs that do not describe whole merge blocks of this tower's patches."""
        grid = "image_grid_thw" if name == "pixel_values" else "video_grid_thw"
        if grid_thw is None:
            raise ValueError(f"qwen4exp: {name} given without {grid}")
        if grid_thw.dim() != 2 or grid_thw.shape[-1] != 3:
            raise ValueError(f"qwen4exp: {grid} must be [num_items, 3] (t, h, w), got {tuple(grid_thw.shape)}")
        if pixel_values.dim() != 2 or pixel_values.shape[-1] != self.patch_dim:
            raise ValueError(f"qwen4exp: {name} must be [num_patches, {self.patch_dim}] (C * temporal_patch * "
                             f"patch^2), got {tuple(pixel_values.shape)}")
        if bool((grid_thw <= 0).any()) or bool((grid_thw[:, 1:] % self.merge != 0).any()):
            raise ValueError(f"qwen4exp: {grid} entries must be positive with h and w multiples of "
                             f"spatial_merge_size={self.merge}, got {grid_thw.tolist()}")
        n = int(grid_thw.long().prod(-1).sum())
        if n != pixel_values.shape[0]:
            raise ValueError(f"qwen4exp: {grid} describes {n} patches but {name} has {pixel_values.shape[0]}")

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C*Tp*P*P], grid_thw [n, 3] -> [N / m^2, out_hidden_size] (items in input order)."""
        self.check_inputs(pixel_values, grid_thw)
        proj = self.patch_embed.proj
        x = F.linear(pixel_values.to(proj.weight.dtype), proj.weight.flatten(1), proj.bias)
        row, col, h, w = patch_coordinates(grid_thw.to(x.device), self.merge)
        x = x + resample_grid(self.pos_embed.weight, row, col, h, w).to(x.dtype)
        H = self.num_heads
        d = self.hidden_size // H
        cos, sin = vision_rope(row, col, d, self.theta)
        lens = frame_lengths(grid_thw.to(x.device))
        N = x.shape[0]
        for b in self.blocks:
            y = F.layer_norm(x, (self.hidden_size,), b.norm1.weight, b.norm1.bias, b.norm1.eps)
            q, k, v = b.attn.qkv(y).view(N, 3, H, d).unbind(1)
            q = apply_rope(q.float(), cos, sin).to(x.dtype)
            k = apply_rope(k.float(), cos, sin).to(x.dtype)
            x = x + b.attn.proj(segment_attention(q, k, v, lens, d ** -0.5).reshape(N, -1))
            y = F.layer_norm(x, (self.hidden_size,), b.norm2.weight, b.norm2.bias, b.norm2.eps)
            x = x + b.mlp.linear_fc2(self.act(b.mlp.linear_fc1(y)))
        mg = self.merger
        y = F.layer_norm(x, (self.hidden_size,), mg.norm.weight, mg.norm.bias, mg.norm.eps)
        y = y.reshape(N // self.merge ** 2, -1)
        return mg.linear_fc2(F.gelu(mg.linear_fc1(y)))

    def tokens_per_item(self, grid_thw: torch.Tensor) -> list[int]:
        """Output tokens of each image / video: t * h * w / m^2."""
        return (grid_thw.long().prod(-1) // self.merge ** 2).tolist()
