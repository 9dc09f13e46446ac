"""The MoE output kernel (``routed + sigmoid(x . w_gate) * shared`` in one pass) as the
``qwen4exp::shared_gate_combine`` custom operator (``_registry``), and the host wrapper the dispatcher
(``__init__``) picks on CUDA: what the kernel does not cover (``host``) goes to the torch reference, outside the
custom op. Imported on the first CUDA call (it imports Triton)."""

from __future__ import annotations

import torch

from .. import _registry
from . import host
from . import reference as ref
from . import triton_kernel as tk

Tensor = torch.Tensor


def supported(x, gate_weight, shared, routed) -> bool:
    return (x.is_cuda and gate_weight.device == shared.device == routed.device == x.device
            and host.covers(x, gate_weight, shared, routed))


@_registry.custom_op("qwen4exp::shared_gate_combine", mutates_args=())
def shared_gate_combine_op(x: Tensor, gate_weight: Tensor, shared: Tensor, routed: Tensor) -> Tensor:
    return tk.shared_gate_combine_triton(x, gate_weight, shared, routed)


@shared_gate_combine_op.register_fake
def _(x, gate_weight, shared, routed):
    return torch.empty_like(routed)


def shared_gate_combine(x, gate_weight, shared, routed):
    if not supported(x, gate_weight, shared, routed):
        return ref.shared_gate_combine(x, gate_weight, shared, routed)
    _registry.ran("shared_gate_combine", "kernel")
    return shared_gate_combine_op(x, gate_weight, shared, routed)


KERNELS = {"shared_gate_combine": shared_gate_combine}
