"""The HF runtime's hybrid cache: one row per sequence of the batch.

GDN layers: conv [B, conv_dim, K-1] and recurrent state [B, n_v, d_k, d_v] (fp32); PLE layer: the last n-1 token
ids [B, n-1] (EOS-filled) and the dilated-conv inputs [B, nD, (K_p-1)*n]. Their per-row shapes come from the layers
(``GatedDeltaNet.state_shapes``, ``PLE.state_shapes``), as the vLLM plugin's state slots take them.
QSA layers, per row: K and V of every token, the normalised + rotated block key of every complete block (kept
incrementally: each block key is computed once, when its block completes), and the raw indexer keys (+ RoPE
positions) of the still-open block.
Beam search / num_return_sequences: ``reorder_cache`` / ``batch_repeat_interleave`` / ``batch_select_indices``
(``select_rows``) move every per-row state along its row.
"""

from __future__ import annotations

import torch

from ..configuration import LINEAR, first_eos
from ..layers.gdn import GatedDeltaNet
from ..layers.ple import PLE
from ..modeling import ple_index_of


class GrowingRows:
    """Append-only [L, ...] buffer with amortised O(1) appends."""

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.len = 0

    def append(self, x: torch.Tensor) -> None:
        need = self.len + x.shape[0]
        if self.buf is None or need > self.buf.shape[0]:
            cap = max(need, 2 * (0 if self.buf is None else self.buf.shape[0]), 64)
            nb = x.new_empty((cap, *x.shape[1:]))
            if self.buf is not None and self.len:
                nb[: self.len] = self.buf[: self.len]
            self.buf = nb
        self.buf[self.len: need] = x
        self.len = need

    def view(self) -> torch.Tensor | None:
        return None if self.buf is None else self.buf[: self.len]

    def clone(self) -> "GrowingRows":
        c = GrowingRows()
        if self.buf is not None:
            c.buf, c.len = self.buf.clone(), self.len
        return c


class QSARowState:
    def __init__(self):
        self.k, self.v, self.block_keys = GrowingRows(), GrowingRows(), GrowingRows()
        self.open_keys: torch.Tensor | None = None  # raw indexer keys of the open block [< r, d_i]
        self.open_pos: torch.Tensor | None = None  # their RoPE positions [< r] or [3, < r]
        self.pending_raw = self.pending_pos = None  # raw keys / positions of the last forward (for rollback)

    def clone(self) -> "QSARowState":
        """An independent copy (the growing buffers are appended to in place; the other fields are replaced, never
        written into, so they can be shared)."""
        c = QSARowState()
        c.k, c.v, c.block_keys = self.k.clone(), self.v.clone(), self.block_keys.clone()
        c.open_keys, c.open_pos, c.pending_raw, c.pending_pos = \
            self.open_keys, self.open_pos, self.pending_raw, self.pending_pos
        return c


def _select_row_states(states: list, idx: list[int]) -> list:
    """Row i of the result is row idx[i]: the first use of a row takes its object, every further use a copy."""
    seen, out = set(), []
    for j in idx:
        out.append(states[j] if j not in seen else states[j].clone())
        seen.add(j)
    return out


class Qwen4ExpHybridCache:
    """Per-row state of every layer. ``lengths[b]`` counts the real (non-padding) tokens row b has consumed;
    ``get_seq_length()`` counts input columns (padding included), as generation utilities expect."""

    is_compileable = False

    def __init__(self, config, batch_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 mtp_layers: int = 0):
        self.config, self.batch_size, self.dtype, self.device = config, batch_size, dtype, torch.device(device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        self.columns = 0
        # M-RoPE: set once a row got (t, h, w) positions (images / video); later tokens of row b sit at their index
        # + rope_deltas[b] on all three axes
        self.mrope = False
        self.rope_deltas = torch.zeros(batch_size, dtype=torch.long)
        self.journal: list | None = None  # set to a list to record state updates (speculative verification)
        # the MTP draft layers' own QSA caches (positions they have consumed: mtp_lengths)
        self.mtp_layers = [{"qsa": [QSARowState() for _ in range(batch_size)]} for _ in range(mtp_layers)]
        self.mtp_lengths = torch.zeros(batch_size, dtype=torch.long)
        self.eos = first_eos(config.eos_token_id)
        self.layers: list[dict] = []
        for i, t in enumerate(config.layer_types):
            st: dict = {}
            if t == LINEAR:
                conv, ssm = GatedDeltaNet.state_shapes(config)
                st["conv"] = torch.zeros(batch_size, *conv, dtype=dtype, device=self.device)
                st["ssm"] = torch.zeros(batch_size, *ssm, dtype=torch.float32, device=self.device)
            else:
                st["qsa"] = [QSARowState() for _ in range(batch_size)]
            if ple_index_of(config, i) is not None:
                conv, ctx = PLE.state_shapes(config)
                st["ple_ctx"] = torch.full((batch_size, *ctx), self.eos, dtype=torch.long, device=self.device)
                st["ple_conv"] = torch.zeros(batch_size, *conv, dtype=dtype, device=self.device)
            self.layers.append(st)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_mask_sizes(self, *args, **kwargs):  # generation utilities may ask
        return self.columns, 0

    def __len__(self) -> int:
        return len(self.layers)

    # ---------------------------------------------------------------------------------------------------------------
    # batch reindexing (beam search, num_return_sequences): every per-row state follows its row
    def select_rows(self, idx: torch.Tensor | list[int]) -> None:
        """Make row i of the cache a copy of (current) row ``idx[i]``, in place; the batch size becomes len(idx).
        Rows may repeat (their states are then copied, not shared) or be dropped."""
        if self.journal:
            raise RuntimeError("qwen4exp: cannot reindex the cache rows during a journaled (speculative) forward")
        idx_l = [int(i) for i in (idx.tolist() if torch.is_tensor(idx) else idx)]
        if any(i < 0 or i >= self.batch_size for i in idx_l):
            raise IndexError(f"qwen4exp: row index out of range for a cache of {self.batch_size} rows: {idx_l}")
        cpu = torch.tensor(idx_l, dtype=torch.long)
        dev = cpu.to(self.device)
        self.lengths, self.rope_deltas, self.mtp_lengths = \
            self.lengths[cpu], self.rope_deltas[cpu], self.mtp_lengths[cpu]
        for st in self.layers + self.mtp_layers:
            for key, val in st.items():
                st[key] = _select_row_states(val, idx_l) if key == "qsa" else val.index_select(0, dev.to(val.device))
        self.batch_size = len(idx_l)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row i continues the hypothesis of row ``beam_idx[i]``."""
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(self.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(indices)

    @property
    def is_empty(self) -> bool:
        return self.columns == 0
