"""Partial, interleaved multimodal RoPE (rotate-half on the first R = head_dim * partial_rotary_factor dims).

Frequencies inv_f_i = theta^(-2i/R), i < R/2 (fp32). With 3-axis positions (t, h, w), frequency i takes axis h
when i % 3 == 1 and i < 3*sec_h, axis w when i % 3 == 2 and i < 3*sec_w, else axis t; for text all axes are equal
and this is plain 1-D RoPE. cos/sin are computed in fp32 and cast to the activation dtype before use.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.rope import apply_rope, norm_rope, norm_rope_many  # noqa: F401  (the layers import them from here)


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        rp = config.rope_parameters or {}
        rtype = rp.get("rope_type", "default")
        if rtype not in ("default", None):
            raise NotImplementedError(f"rope_parameters.rope_type={rtype!r} is not supported yet (only 'default')")
        self.rotary_dim = int(config.head_dim * rp.get("partial_rotary_factor", 1.0))
        theta = float(rp.get("rope_theta", 10000.0))
        R = self.rotary_dim
        inv = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.float) / R))
        self.register_buffer("inv_freq", inv, persistent=False)
        sec = list(rp.get("mrope_section", [11, 11, 10]))
        half = R // 2
        axis = torch.zeros(half, dtype=torch.long)
        i = torch.arange(half)
        axis[(i % 3 == 1) & (i < 3 * sec[1])] = 1
        axis[(i % 3 == 2) & (i < 3 * sec[2])] = 2
        self.register_buffer("axis", axis, persistent=False)
        self.register_buffer("axis_cols", axis.repeat(2), persistent=False)  # the axis of each of the R columns

        self.table_positions = 0  # > 0: cos / sin rows of positions [0, table_positions) precomputed (use_table)
        self._tables: dict = {}

    def use_table(self, n_positions: int) -> None:
        """Serve positions below ``n_positions`` from precomputed cos / sin rows (per device and dtype, built at
        first use): one gather per table and call instead of ~7 small kernels (cast, product, concat, cos, sin, two
        casts), the same values bit for bit (the rows are this module's own formula at positions 0, 1, ...).
        Callers guarantee every position is below ``n_positions`` (vLLM: the model length and the batch size
        bound them); positions past it are an indexing error."""
        self.table_positions = int(n_positions)
        self._tables.clear()

    def _table(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (str(device), dtype)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = self._compute(torch.arange(self.table_positions, device=device), dtype)
        return t

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (text) or [3, T] (t, h, w) -> cos, sin [T, R] in ``dtype``."""
        if not self.table_positions:
            return self._compute(positions, dtype)
        cos_t, sin_t = self._table(positions.device, dtype)
        if positions.dim() == 1:
            return cos_t[positions], sin_t[positions]
        # three axes: column j of the rows takes the position of its frequency's axis (axis[j % (R / 2)])
        cols = self.axis_cols.to(positions.device).view(1, 1, -1).expand(1, positions.shape[1], -1)
        return cos_t[positions].gather(0, cols)[0], sin_t[positions].gather(0, cols)[0]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq.to(positions.device)
        if positions.dim() == 1:
            freqs = positions.float().unsqueeze(-1) * inv
        else:
            f3 = positions.float().unsqueeze(-1) * inv  # [3, T, R/2]
            freqs = f3.gather(0, self.axis.to(positions.device).view(1, 1, -1).expand(1, f3.shape[1], -1))[0]
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids values


def mrope_positions(types, image_grids=(), video_grids=(), spatial_merge_size: int = 2
                    ) -> tuple[torch.Tensor, int]:
    """(t, h, w) RoPE positions of one sequence -> (positions [3, L] long, delta).

    ``types`` [L]: TEXT / IMAGE / VIDEO per token (``mm_token_type_ids``). ``image_grids`` / ``video_grids``: the
    (t, h, w) patch grids of the sequence's images / videos in order (iterables; pass one shared iterator over the
    rows of a batch to consume them row after row). A video counts as t separate frames of (1, h, w) (the processor
    gives every frame its own timestamp text and placeholder run).

    Text tokens count up on all three axes. A run of placeholder tokens takes its items' grids one after another:
    an item of (t, h/m, w/m) merged tokens starting at position p gets (p + frame, p + row, p + col), and the next
    token continues at p + max(h, w) / m. ``delta`` = max position + 1 - L: later tokens (decode) sit at their
    index + delta on all three axes.
    """
    types = torch.as_tensor(types, dtype=torch.long).cpu()
    L = types.numel()
    m = int(spatial_merge_size)
    items = {IMAGE: iter(image_grids if image_grids is not None else ()),
             VIDEO: (f for (t, h, w) in (video_grids if video_grids is not None else ()) for f in [(1, h, w)] * int(t))}
    names = {IMAGE: "image", VIDEO: "video"}
    pos = torch.empty(3, L, dtype=torch.long)
    bounds = [0, *(torch.nonzero(types[1:] != types[:-1]).flatten() + 1).tolist(), L]
    cur = 0
    for s, e in zip(bounds[:-1], bounds[1:]):
        kind = int(types[s])
        if kind == TEXT:
            pos[:, s:e] = torch.arange(cur, cur + e - s)
            cur += e - s
            continue
        if kind not in items:
            raise ValueError(f"qwen4exp: mm_token_type_ids holds {kind} (text 0, image 1, video 2 expected)")
        i = s
        while i < e:
            grid = next(items[kind], None)
            if grid is None:
                raise ValueError(f"qwen4exp: more {names[kind]} placeholder tokens than the {names[kind]}_grid_thw "
                                 f"entries describe")
            t, gh, gw = int(grid[0]), int(grid[1]) // m, int(grid[2]) // m
            n = t * gh * gw
            if i + n > e:
                raise ValueError(f"qwen4exp: a run of {e - s} {names[kind]} placeholder tokens does not match the "
                                 f"{names[kind]}_grid_thw entries ({n} tokens for grid {[int(g) for g in grid]})")
            pos[0, i:i + n] = cur + torch.arange(t).repeat_interleave(gh * gw)
            pos[1, i:i + n] = cur + torch.arange(gh).repeat_interleave(gw).repeat(t)
            pos[2, i:i + n] = cur + torch.arange(gw).repeat(t * gh)
            cur += max(gh, gw)
            i += n
    delta = int(pos.max()) + 1 - L if L else 0
    return pos, delta
