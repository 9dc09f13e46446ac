"""Gated delta rule (Gated DeltaNet's recurrence): ``reference`` (readable torch, the contract: the recurrent and the
chunked form), ``fla_kernel`` (the call of flash-linear-attention's CUDA kernels on our layout, and what they take;
Triton-free), ``cuda`` (their registration as custom operators and the host wrappers; imports fla). Tests:
``tests/ops/test_gated_delta_rule.py``."""

from .. import _registry
from . import reference
from .reference import l2norm

KERNELS = _registry.Kernels(__name__, cuda=".cuda")  # fla's kernels (cuda.py), loaded on the first CUDA call
pick = KERNELS.pick


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True):
    fn = pick("chunk_gated_delta_rule", q.device, reference.chunk_gated_delta_rule)
    return fn(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


def recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True):
    fn = pick("recurrent_gated_delta_rule", q.device, reference.recurrent_gated_delta_rule)
    return fn(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


def gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True):
    """Recurrent form when the sequences bring at most 4 tokens on average (decode, speculative verification: the
    chunked form's 64-token chunks would be mostly padding there, and take several launches), chunked form otherwise.
    Decided from shapes alone (no host sync)."""
    if q.shape[0] <= 4 * (cu_seqlens.numel() - 1):
        return recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "gated_delta_rule", "l2norm", "reference"]
