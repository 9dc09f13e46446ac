"""Zero-centred RMSNorm, per group of elements: ``reference`` (readable torch, the contract), ``triton_kernel`` (the
CUDA kernel), ``cuda`` (its registration as a custom operator and the host wrapper), ``host`` (what the kernel
covers; Triton-free). Tests: ``tests/ops/test_norm.py``."""

from .. import _registry
from . import reference

KERNELS = _registry.Kernels(__name__, cuda=".cuda")  # the CUDA kernel (cuda.py), loaded on the first CUDA call
pick = KERNELS.pick


def grouped_rms_norm(x, weight, group: int, eps: float):
    return pick("rms_norm", x.device, reference.grouped_rms_norm)(x, weight, group, eps)


__all__ = ["grouped_rms_norm", "reference"]
