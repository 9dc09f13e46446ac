"""Memory-layout detection for runtimes that join projections into one GEMM.

A runtime may lay out the weights of projections that read the same input as consecutive row ranges of one buffer
(the vLLM plugin: ``qwen4exp.vllm.layers.colocate_projections``); the layers and ops that run those projections ask
``stacked_weight`` for the joined view and run one GEMM where there is one, the separate projections otherwise.
"""

from __future__ import annotations

import torch


def stacked_weight(weights, pad: int = 1) -> torch.Tensor | None:
    """The 2-D weights [R_i, K] as ONE [sum R_i, K] view when each one's rows follow the previous one's in memory (a
    runtime laid them out so: ``qwen4exp.vllm.layers.colocate_rows``), else None; their projections can then run as
    one GEMM. ``pad``: the rows rounded up to a multiple of it where the storage holds them (zero rows a runtime
    added so that the GEMM's output rows are 16-byte aligned); rows past the last weight's are not weights."""
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
