"""Linear-layer factory. Layers never construct ``nn.Linear`` directly: they ask a factory, so that a runtime can
substitute tensor-parallel or quantized linears (vLLM's, NVFP4, FP8) without touching the math.

A factory is ``factory(in_features, out_features, *, prefix) -> nn.Module`` whose forward maps [..., in] to
[..., out] (a plain tensor). ``prefix`` is the module's checkpoint name, e.g. ``model.layers.3.self_attn.q_proj``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class LinearFactory(Protocol):
    def __call__(self, in_features: int, out_features: int, *, prefix: str = "") -> nn.Module: ...


def default_linear(in_features: int, out_features: int, *, prefix: str = "") -> nn.Module:
    return nn.Linear(in_features, out_features, bias=False)


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


def linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The dense weight of a linear module, or None when it is quantized / not a plain linear."""
    w = getattr(module, "weight", None)
    # numel() == 0: a runtime moved the weight into a packed kernel (vLLM CPU GEMM dispatch): call the module
    if isinstance(w, torch.Tensor) and w.numel() and w.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return w
    return None
