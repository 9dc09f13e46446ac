from .._dispatch import pick
from . import reference
from .reference import (block_mean, indexer_scores, num_complete_blocks, qsa_attention_gathered, qsa_decode_batched,
                        select_blocks, selected_token_indices, selection_mask, sparse_attention)


def qsa_attention(q, k, v, q_pos, index_q, block_keys, r, budget, scale, index_scale):
    fn = pick("qsa_attention", q.device, reference.qsa_attention)
    return fn(q, k, v, q_pos, index_q, block_keys, r, budget, scale, index_scale)


__all__ = ["qsa_attention", "qsa_attention_gathered", "qsa_decode_batched", "block_mean", "indexer_scores",
           "num_complete_blocks", "select_blocks", "selected_token_indices", "selection_mask", "sparse_attention",
           "reference"]
