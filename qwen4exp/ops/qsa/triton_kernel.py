"""The QSA ops on CUDA, composed of the Triton stages (imported only on the CUDA path and by the CPU interpreter
checks): ``score`` (the indexer's block scores as sort keys), ``select`` (top m blocks), ``attend`` (attention over
the selected tokens + merge) and ``cache`` (paged writes, the decode's index update); their launch settings in
``launch``, the plans and the warm-up's cases in ``host``. No host synchronisation on the decode paths (CUDA graphs
capture them).

* ``qsa_decode_paged_triton``: one query per sequence over paged caches: paged scores, the select
  (``host.decode_select``: vLLM's where loaded, else ours), the split attention with the output gate in its merge.
* ``qsa_prefill_paged_triton``: queries of one sequence in chunks whose int64 sort keys stay under
  ``PREFILL_KEYS_BYTES``: tiled scores, top-m, the looping attention for long chunks.
* ``qsa_attention_triton``: unpaged K/V (decode / verify / short chunks of the HF runtime).
* ``warm_up_decode`` / ``warm_up_prefill``: every kernel variant a server can reach, compiled at start-up.
"""

from __future__ import annotations

import torch

from . import host, launch
from .attend import sparse_attention_slots
from .cache import index_update_triton, write_paged_triton
from .launch import INT64_MIN, LAUNCHED
from .score import paged_score_keys, prefill_score_keys, score_keys
from .select import dense_ids, select_block_ids, top_ids, top_keys, uses_indexer, vllm_top_ids

# (the stages' entry points, for callers that reach the CUDA path through this module: tests, benchmarks)
__all__ = ["INT64_MIN", "LAUNCHED", "index_update_triton", "paged_score_keys", "prefill_score_keys",
           "qsa_attend_paged_triton", "qsa_attention_triton", "qsa_decode_paged_triton", "qsa_prefill_paged_triton",
           "qsa_select_paged_triton", "score_keys", "select_block_ids", "sparse_attention_slots", "top_ids",
           "top_keys", "vllm_top_ids", "warm_up_decode", "warm_up_prefill", "write_paged_triton"]


def qsa_attention_triton(q, k, v, q_pos, index_q, block_keys, r: int, budget: int, scale: float,
                         index_scale: float):
    m = budget // r
    if not uses_indexer(index_q, block_keys, m):
        return sparse_attention_slots(q, k, v, q_pos, dense_ids(q_pos, r, m), r, scale, keys=False)
    keys = score_keys(q_pos, index_q, block_keys, r, index_scale)  # the attention decodes the ids from its top keys
    return sparse_attention_slots(q, k, v, q_pos, top_keys(keys, m), r, scale, keys=True)


def _warmup_queries(kv, index_kv, n_heads: int, index_heads: int, dtype, seed: int):
    """n -> (queries [n, n_heads, head dim], indexer queries [n, index_heads, its dim]) for a warm-up on these
    caches: random, in ``dtype``, from one generator."""
    HD, DI, dev = kv.shape[-1] // 2, index_kv.shape[-1] // 2, kv.device
    g = torch.Generator(device=dev).manual_seed(seed)
    return lambda n: (torch.randn(n, n_heads, HD, generator=g, device=dev).to(dtype),
                      torch.randn(n, index_heads, DI, generator=g, device=dev).to(dtype))


def warm_up_decode(kv, index_kv, n_heads: int, index_heads: int, max_len: int, max_rows: int, r: int, budget: int,
                   scale: float, index_scale: float, dtype=torch.bfloat16) -> list:
    """``warm_up_prefill`` for ``qsa_decode_paged_triton``: every variant for up to ``max_rows`` single queries
    (``decode_warmup_cases``) on these caches, reading block 0 only. Returns the cases run."""
    bs, dev = kv.shape[2], kv.device
    cases = host.decode_warmup_cases(max(1, max_rows), max(1, max_len // r), budget // r, r, kv.shape[1])
    queries = _warmup_queries(kv, index_kv, n_heads, index_heads, dtype, seed=1)
    for i, (B, n_blocks) in enumerate(cases):
        seq_len = n_blocks * r + (r - 1)
        q, iq = queries(B)
        pos = torch.full((B,), seq_len - 1, dtype=torch.long, device=dev)
        bt = torch.zeros(B, host.cdiv(seq_len, bs), dtype=torch.int32, device=dev)
        if i == 0 and not host.paged_covers(q, pos, iq, kv, bt, index_kv, bt, r, budget):
            return []  # decodes of these caches run the torch reference: nothing to compile
        sel = qsa_select_paged_triton(pos, iq, index_kv, bt, n_blocks, r, budget, index_scale)
        # the attention with and without the output gate in its merge (gated: a uniform decode batch run eagerly,
        # past the captured sizes or in eager mode; ungated: a mixed step's decode rows)
        for gate in (None, q):
            qsa_attend_paged_triton(q, pos, kv, bt, sel, r, scale, gate)
    return cases


def qsa_decode_paged_triton(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, n_blocks: int, r: int,
                            budget: int, scale: float, index_scale: float, gate=None):
    """One query per sequence, caches read through the block tables (``qwen4exp.ops.qsa.reference.
    qsa_decode_paged`` is the contract): scores of every block key in the paged index cache, top-m select, split
    attention over the selected tokens' paged K/V. Fixed grid given ``n_blocks``: no host sync."""
    sel = qsa_select_paged_triton(q_pos, index_q, index_kv, index_block_table, n_blocks, r, budget, index_scale)
    return qsa_attend_paged_triton(q, q_pos, kv, block_table, sel, r, scale, gate)


def qsa_select_paged_triton(q_pos, index_q, index_kv, index_block_table, n_blocks: int, r: int, budget: int,
                            index_scale: float):
    """The selection of ``qsa_decode_paged_triton``: block ids [B, m] (-1 pad, int32): scores of every paged block
    key, then top-m (``host.decode_select``: vLLM's select or ``top_ids``); dense ids when no row can be past the
    budget."""
    m = budget // r
    select = host.decode_select(q_pos.shape[0], n_blocks, m)
    if select == "dense":
        return dense_ids(q_pos, r, m)
    if select == "vllm":
        lg, vis = paged_score_keys(q_pos, index_q, index_kv, index_block_table, n_blocks, r, index_scale, True)
        return vllm_top_ids(lg, q_pos, r, m, vis)
    return top_ids(paged_score_keys(q_pos, index_q, index_kv, index_block_table, n_blocks, r, index_scale), m)


def qsa_attend_paged_triton(q, q_pos, kv, block_table, sel, r: int, scale: float, gate=None):
    """The split attention of ``qsa_decode_paged_triton`` over the selected blocks ``sel`` [B, m] (-1 = none) and
    each query's tail, K/V read through the block table; ``gate``: the output gate applied by the merge."""
    HD = q.shape[-1]
    return sparse_attention_slots(q, kv[..., :HD], kv[..., HD:], q_pos, sel, r, scale, keys=False,
                                  block_table=block_table, gate=gate)


def warm_up_prefill(kv, index_kv, n_heads: int, index_heads: int, max_len: int, r: int, budget: int, scale: float,
                    index_scale: float, dtype=torch.bfloat16) -> list:
    """Compile every kernel variant of ``qsa_prefill_paged_triton`` for these caches (``prefill_warmup_cases`` up to
    ``max_len`` tokens) before serving, so no prefill stalls on a Triton compile. It only reads the caches (block
    0 for every block: vLLM's null block) and its outputs are discarded. ``dtype``: the queries' (the model's).
    Returns the cases run."""
    bs, dev = kv.shape[2], kv.device
    cases = host.prefill_warmup_cases(max(1, max_len // r), budget // r, r, kv.shape[1])
    queries = _warmup_queries(kv, index_kv, n_heads, index_heads, dtype, seed=0)
    for i, (Tq, n_blocks) in enumerate(cases):
        seq_len = n_blocks * r + (r - 1)  # the open tail too
        q, iq = queries(Tq)
        pos = torch.arange(seq_len - Tq, seq_len, device=dev)
        row = torch.zeros(host.cdiv(seq_len, bs), dtype=torch.int32, device=dev)
        if i == 0 and not host.prefill_paged_covers(q, pos, iq, kv, row, index_kv, r, budget):
            return []  # prefills of these caches run the torch reference: nothing to compile
        qsa_prefill_paged_triton(q, pos, iq, kv, row, index_kv, seq_len, r, budget, scale, index_scale)
    return cases


def qsa_prefill_paged_triton(q, q_pos, index_q, kv, block_row, index_kv, seq_len: int, r: int, budget: int,
                             scale: float, index_scale: float):
    """Queries of ONE sequence over its paged caches (``qwen4exp.ops.qsa.reference.qsa_prefill_paged`` is the
    contract), in query chunks whose sort keys fit ``PREFILL_KEYS_BYTES``: tiled scores of the chunk against the
    sequence's block keys, top-m per query, attention over the selected tokens (looping kernel for long chunks)."""
    Tq, HD = q.shape[0], q.shape[-1]
    m = budget // r
    n_blocks = seq_len // r
    out = torch.empty_like(q)
    if Tq == 0:
        return out
    k_cache, v_cache = kv[..., :HD], kv[..., HD:]
    indexed, step = host.prefill_step(Tq, n_blocks, m)
    for c0 in range(0, Tq, step):
        qc, pc, iqc = q[c0: c0 + step], q_pos[c0: c0 + step], index_q[c0: c0 + step]
        if indexed and host.prefill_select(m) == "vllm":
            lg, vis = prefill_score_keys(pc, iqc, index_kv, block_row, n_blocks, r, index_scale, logits=True)
            sel = vllm_top_ids(lg, pc, r, m, vis)
        elif indexed:
            sel = top_ids(prefill_score_keys(pc, iqc, index_kv, block_row, n_blocks, r, index_scale), m)
        else:
            sel = dense_ids(pc, r, m)
        bt = block_row.unsqueeze(0).expand(qc.shape[0], -1)  # stride 0: every query reads the sequence's row
        out[c0: c0 + qc.shape[0]] = sparse_attention_slots(qc, k_cache, v_cache, pc, sel, r, scale, keys=False,
                                                           block_table=bt, loop=qc.shape[0] >= launch.LOOP_MIN_QUERIES)
    return out
