"""Partial rotate-half RoPE, and the per-head norm + RoPE of the QSA queries and keys: ``reference`` (readable
torch, the contract), ``triton_kernel`` (the CUDA kernels), ``cuda`` (their registration as custom operators and
the host wrappers), ``host`` (what the kernels cover, the norm + RoPE fallback; Triton-free). Tests:
``tests/ops/test_rope.py``."""

from .. import _registry
from . import reference

KERNELS = _registry.Kernels(__name__, cuda=".cuda")  # the CUDA kernels (cuda.py), loaded on the first CUDA call
pick = KERNELS.pick


def apply_rope(x, cos, sin):
    return pick("apply_rope", x.device, reference.apply_rope)(x, cos, sin)


def norm_rope(x, weight, eps, cos, sin):
    return pick("norm_rope", x.device, reference.norm_rope)(x, weight, eps, cos, sin)


def norm_rope_many(groups, cos, sin):
    """[(x, weight, eps), ...] of the same tokens sharing cos / sin -> [``norm_rope`` of each]; on GPUs three groups
    run in one launch."""
    return pick("norm_rope_many", cos.device, reference.norm_rope_many)(groups, cos, sin)


__all__ = ["apply_rope", "norm_rope", "norm_rope_many", "reference"]
