"""Memory-layout detection for runtimes that join projections into one GEMM.

A runtime may lay out the weights of projections that read the same input as consecutive row ranges of one buffer
(``colocate_rows``; ``qwen4exp.modeling.colocate_projections`` picks the groups); the layers and ops that run those
projections ask ``stacked_weight`` for the joined view and run one GEMM where there is one, the separate projections
otherwise.
"""

from __future__ import annotations

import torch
from torch import nn


def stacked_weight(weights, pad: int = 1) -> torch.Tensor | None:
    """The 2-D weights [R_i, K] as ONE [sum R_i, K] view when each one's rows follow the previous one's in memory (a
    runtime laid them out so: ``colocate_rows``), else None; their projections can then run as one GEMM. ``pad``:
    the rows rounded up to a multiple of it where the storage holds them (zero rows a runtime added so that the
    GEMM's output rows are 16-byte aligned); rows past the last weight's are not weights."""
    if not weights or any(not isinstance(w, torch.Tensor) or w.dim() != 2 for w in weights):
        return None
    w0 = weights[0]
    K, ptr, off = w0.shape[1], w0.untyped_storage().data_ptr(), w0.storage_offset()
    for w in weights:
        if (w.dtype != w0.dtype or w.device != w0.device or w.shape[1] != K or w.stride() != (K, 1)
                or w.untyped_storage().data_ptr() != ptr or w.storage_offset() != off):
            return None
        off += w.shape[0] * K
    rows = (off - w0.storage_offset()) // K
    padded = -(-rows // pad) * pad
    if (w0.storage_offset() + padded * K) * w0.element_size() <= w0.untyped_storage().nbytes():
        rows = padded
    return w0.as_strided((rows, K), (K, 1))


def colocate_rows(weights, pad: int = 8) -> bool:
    """Lay out 2-D weight parameters of one input width as consecutive row ranges of ONE buffer (zero rows padding
    it to a multiple of ``pad`` rows: 16-byte aligned GEMM output rows), so that ``ops.layout.stacked_weight``
    finds them and their projections run as one GEMM. The parameters stay separate (checkpoint names; weight
    loaders and the dummy initialisation write into their views). False (nothing changed) unless all are plain
    parameters of one dtype, device and width."""
    w0 = weights[0]
    if not all(isinstance(w, nn.Parameter) and w.dim() == 2 and w.dtype == w0.dtype and w.device == w0.device
               and w.shape[1] == w0.shape[1] for w in weights):
        return False
    rows = sum(w.shape[0] for w in weights)
    buf = torch.zeros(-(-rows // pad) * pad, w0.shape[1], dtype=w0.dtype, device=w0.device)
    r = 0
    for w in weights:
        buf[r: r + w.shape[0]].copy_(w.data)
        w.data = buf[r: r + w.shape[0]]
        r += w.shape[0]
    return True
