"""QSA (Qwen Sparse Attention): ``reference`` (readable torch, the contract); the CUDA kernels by stage, ``score``
(the indexer's block scores), ``select`` (top-m blocks), ``attend`` (attention over the selected tokens + merge),
``cache`` (paged writes, the decode's index update), composed into the ops by ``triton_kernel``; ``launch`` (their
launch settings) and ``host`` (what the kernels cover, which select runs, launch plans, the warm-up's cases), both
Triton-free; ``cuda`` (the registration as custom operators and the host wrappers); ``layout`` (the paged cache
page) and ``step`` (a decode step's inputs and cache writes). Tests: ``tests/ops/test_qsa.py``."""

from .. import _registry
from . import layout, reference
from .reference import (block_mean, indexer_scores, num_complete_blocks, output_gate, paged_rows, qsa_attention_gathered,
                        qsa_decode_batched, reused_block_ids, select_blocks, selected_token_indices, selection_mask,
                        sparse_attention)

KERNELS = _registry.Kernels(__name__, cuda=".cuda")  # the CUDA kernels (cuda.py), loaded on the first CUDA call
pick = KERNELS.pick


def qsa_attention(q, k, v, q_pos, index_q, block_keys, r, budget, scale, index_scale):
    fn = pick("qsa_attention", q.device, reference.qsa_attention)
    return fn(q, k, v, q_pos, index_q, block_keys, r, budget, scale, index_scale)


def index_update_decode(index_kv, ring, slots, pos, valid, raw, norm_weight, eps, cos, sin, r):
    """One token per row: its raw key into its page's ring, and the key of the block it completes (if any) into
    the index cache (``reference.index_update_decode``; the page layout: ``layout``)."""
    fn = pick("qsa_index_update_decode", index_kv.device, reference.index_update_decode)
    return fn(index_kv, ring, slots, pos, valid, raw, norm_weight, eps, cos, sin, r)


def decode_cache_writes(kv, index_kv, ring, slots, pos, valid, k, v, raw, norm_weight, eps, cos, sin, r, nq=1):
    """One token per row (``nq`` consecutive ones a request): its K|V rows into the paged cache (``write_paged``)
    and the index update (``index_update_decode``): one launch on GPUs."""
    fn = pick("qsa_decode_writes", kv.device, reference.decode_cache_writes)
    return fn(kv, index_kv, ring, slots, pos, valid, k, v, raw, norm_weight, eps, cos, sin, r, nq)


def write_paged(kv, slots, k, v):
    return pick("qsa_write_paged", kv.device, reference.write_paged)(kv, slots, k, v)


def qsa_decode_paged(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, n_blocks, r, budget, scale,
                     index_scale, gate=None):
    """``gate`` [B, Hq, d] (any row and head strides): the output gate applied too (``reference.output_gate``; on
    GPUs inside the attention's last kernel)."""
    fn = pick("qsa_decode_paged", q.device, reference.qsa_decode_paged)
    return fn(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, n_blocks, r, budget, scale,
              index_scale, gate)


def qsa_select_paged(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget, index_scale):
    """The selection half of ``qsa_decode_paged``: block ids [B, budget // r] (-1 pad)."""
    fn = pick("qsa_select_paged", q_pos.device, reference.qsa_select_paged)
    return fn(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget, index_scale)


def qsa_attend_paged(q, q_pos, kv, block_table, block_ids, r, budget, scale, gate=None):
    """The attention half of ``qsa_decode_paged``, over a given selection (e.g. one reused across MTP draft steps)."""
    fn = pick("qsa_attend_paged", q.device, reference.qsa_attend_paged)
    return fn(q, q_pos, kv, block_table, block_ids, r, budget, scale, gate)


def qsa_prefill_paged(q, q_pos, index_q, kv, block_row, index_kv, seq_len, r, budget, scale, index_scale):
    fn = pick("qsa_prefill_paged", q.device, reference.qsa_prefill_paged)
    return fn(q, q_pos, index_q, kv, block_row, index_kv, seq_len, r, budget, scale, index_scale)


def warm_up_prefill(kv, index_kv, n_heads, index_heads, max_len, r, budget, scale, index_scale, dtype):
    """Compile every kernel variant ``qsa_prefill_paged`` may launch on these caches for prompts of up to
    ``max_len`` tokens (a server's start-up, so that no request waits on a compile); the (queries, blocks) cases
    run. Nothing where the device has no QSA kernels (the reference compiles nothing)."""
    fn = pick("qsa_warm_up_prefill", kv.device, lambda *a, **k: [])
    return fn(kv, index_kv, n_heads, index_heads, max_len, r, budget, scale, index_scale, dtype=dtype)


def warm_up_decode(kv, index_kv, n_heads, index_heads, max_len, max_rows, r, budget, scale, index_scale, dtype):
    """``warm_up_prefill`` for ``qsa_decode_paged``: every kernel variant for up to ``max_rows`` single queries
    over up to ``max_len`` tokens (decode rows of mixed steps and MTP verifications run eagerly, outside the CUDA
    graphs whose capture compiles the pure-decode ones)."""
    fn = pick("qsa_warm_up_decode", kv.device, lambda *a, **k: [])
    return fn(kv, index_kv, n_heads, index_heads, max_len, max_rows, r, budget, scale, index_scale, dtype=dtype)


__all__ = ["layout", "qsa_attention", "qsa_decode_paged", "qsa_select_paged", "qsa_attend_paged", "qsa_prefill_paged",
           "warm_up_prefill", "warm_up_decode", "paged_rows", "write_paged", "index_update_decode",
           "decode_cache_writes",
           "qsa_attention_gathered", "qsa_decode_batched", "reused_block_ids", "block_mean", "indexer_scores",
           "num_complete_blocks", "output_gate",
           "select_blocks", "selected_token_indices", "selection_mask", "sparse_attention", "reference"]
