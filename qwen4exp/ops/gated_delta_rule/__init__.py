from .._dispatch import pick
from . import reference
from .reference import l2norm


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True):
    fn = pick("chunk_gated_delta_rule", q.device, reference.chunk_gated_delta_rule)
    return fn(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


def recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True):
    fn = pick("recurrent_gated_delta_rule", q.device, reference.recurrent_gated_delta_rule)
    return fn(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


def gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, use_qk_l2norm=True):
    """Recurrent form when every sequence brings one token (decode), chunked form otherwise."""
    if q.shape[0] == cu_seqlens.numel() - 1:
        return recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "gated_delta_rule", "l2norm", "reference"]
