"""MoE decode at M <= 4 tokens (issue 50 item 3): the router (GEMV + softmax + top-k + renormalise) and the NVFP4
W4A16 routed experts (gate/up GEMV, SiLU * up, down GEMV, weighted top-k sum). ``reference`` (readable torch, the
contract), ``triton_kernel`` (the CUDA kernels), ``cuda`` (their registration as custom operators and the host
wrappers), ``host`` (what the kernels cover, their launch plan; Triton-free). The kernels run only with
``QWEN4EXP_MOE_DECODE=1`` (default off: not wired into the vLLM model yet). Tests: ``tests/ops/test_moe_decode.py``."""

from .. import _registry
from . import reference
from .reference import select_experts

KERNELS = _registry.Kernels(__name__, cuda=".cuda")  # the CUDA kernels (cuda.py), loaded on the first CUDA call
pick = KERNELS.pick


def router_topk(x, weight, top_k: int, renormalize: bool):
    """x [M, D], router weight [E, D] -> (logits [M, E], top-k weights [M, k] in x's dtype, ids [M, k])."""
    return pick("router_topk", x.device, reference.router_topk)(x, weight, top_k, renormalize)


def experts_nvfp4(x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, topk_weights, topk_ids):
    """The weighted sum of the selected NVFP4 experts [M, D] (tensor layout: ``reference``)."""
    return pick("experts_nvfp4", x.device, reference.experts_nvfp4)(x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs,
                                                                     topk_weights, topk_ids)


__all__ = ["router_topk", "experts_nvfp4", "select_experts", "reference"]
