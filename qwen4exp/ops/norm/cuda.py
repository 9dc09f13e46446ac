"""The zero-centred (grouped) RMSNorm kernel as the ``qwen4exp::rms_norm`` custom operator (``_registry``), and the
host wrapper the dispatcher (``__init__``) picks on CUDA: what the kernel does not cover (``host``) goes to the
torch reference, outside the custom op. Imported on the first CUDA call (it imports Triton); other ops' wrappers
(HC, RoPE) import it to call the norm kernel."""

from __future__ import annotations

import torch

from .. import _registry
from . import host
from . import reference as ref
from . import triton_kernel as tk

Tensor = torch.Tensor


def supported(x, weight, group: int) -> bool:
    return x.is_cuda and weight.device == x.device and host.covers(x, weight, group)


@_registry.custom_op("qwen4exp::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, group: int, eps: float) -> Tensor:
    return tk.rms_norm_triton(x, weight, group, eps)


@rms_norm_op.register_fake
def _(x, weight, group, eps):
    return torch.empty_like(x)


def rms_norm(x, weight, group, eps):
    if not supported(x, weight, group):
        return ref.grouped_rms_norm(x, weight, group, eps)
    _registry.ran("rms_norm", "kernel")
    return rms_norm_op(x, weight, int(group), float(eps))


KERNELS = {"rms_norm": rms_norm}
