"""The MoE output (routed experts plus the gated shared expert): ``reference`` (readable torch, the contract),
``triton_kernel`` (the CUDA kernel), ``cuda`` (its registration as a custom operator and the host wrapper),
``host`` (what the kernel covers; Triton-free). Tests: ``tests/ops/test_moe_combine.py``."""

from .. import _registry
from . import reference

KERNELS = _registry.Kernels(__name__, cuda=".cuda")  # the CUDA kernel (cuda.py), loaded on the first CUDA call
pick = KERNELS.pick


def shared_gate_combine(x, gate_weight, shared, routed):
    return pick("shared_gate_combine", x.device, reference.shared_gate_combine)(x, gate_weight, shared, routed)


__all__ = ["shared_gate_combine", "reference"]
