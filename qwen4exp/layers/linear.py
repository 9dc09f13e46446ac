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


def linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The dense weight of a linear module, or None when it is quantized / not a plain linear."""
    w = getattr(module, "weight", None)
    # numel() == 0: a runtime moved the weight into a packed kernel (vLLM CPU GEMM dispatch): call the module
    if isinstance(w, torch.Tensor) and w.numel() and w.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return w
    return None
