"""The QSA CUDA path's host-side decisions: what each kernel covers, which top-k select a paged decode runs, the
launch plans (select, split attention, prefill chunks) and the start-up warm-up's cases (the kernel variants a
server can reach), from shapes, dtypes, strides and the launch settings (``launch``) alone (no Triton, no device
checks), so that CPU tests check them. ``cuda.py`` adds the device checks (``*_supported``) and sends whatever a
kernel does not cover to the torch reference."""

from __future__ import annotations

import torch

from ... import envs
from . import launch

MAX_TQ = 64  # qsa_attention (unpaged K/V): decode / verify / short chunks; longer ones go to the reference
CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)  # FP8 (unit scales) widens exactly to bf16
# The paged decode's top-m select: vLLM's own CUDA select (the one its in-tree model uses; faster than ours) where
# its operator is loaded (inside a vLLM engine) and covers the call, else the Triton select. vLLM's choice among
# blocks tied at the threshold is its own (not the reference's lower ids), and the order of the ids it returns varies
# between calls (so does the attention's fp32 summation order: bf16 outputs may differ in the last bit between
# runs); the set is the reference's wherever the scores at the threshold do not tie. Tests that hold the kernels to
# the reference's tie rule switch it off.
VLLM_TOPK = True


def attention_covers(q, k, v, q_pos, index_q, block_keys, r, budget) -> bool:
    """``qsa_attention_triton`` (unpaged K/V): bf16, up to MAX_TQ queries, the head sizes its kernels take."""
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16):
        return False
    Tq, Hq, HD = q.shape
    Hkv = k.shape[1]
    if Tq == 0 or Tq > MAX_TQ or Hq % Hkv or HD not in (64, 128, 256) or Hq // Hkv > 16 or r < 1:
        return False
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        return False
    if index_q is not None and block_keys is not None:
        if index_q.dtype != torch.bfloat16 or block_keys.dtype != torch.bfloat16:
            return False
        di = block_keys.shape[-1]
        if di not in (32, 64, 128, 256) or index_q.shape[-1] != di or index_q.shape[1] > 16:
            return False
        if index_q.stride(-1) != 1 or block_keys.stride(-1) != 1:
            return False
    return True


def select_paged_covers(index_q, index_kv, index_block_table, r) -> bool:
    """``qsa_select_paged_triton``: bf16 indexer queries, a bf16 or FP8 index cache, the widths its kernels take."""
    if not (index_q.dtype == torch.bfloat16 and index_kv.dtype in CACHE_DTYPES):
        return False
    di = index_kv.shape[-1] // 2
    if index_q.shape[0] == 0 or r < 1 or di not in (32, 64, 128, 256) or index_q.shape[-1] != di:
        return False
    # any block/head/row strides (vLLM pads each block of a hybrid model's caches to the common page size, so the
    # caches are not contiguous); elements of a row contiguous
    return (index_q.shape[1] <= 16 and index_kv.shape[1] == 1 and index_kv.stride(-1) == 1
            and index_q.stride(-1) == 1 and index_block_table.dim() == 2)


def attend_paged_covers(q, kv, block_table, r) -> bool:
    """``qsa_attend_paged_triton``: bf16 queries, a bf16 or FP8 K|V cache, the head sizes its kernels take."""
    if not (q.dtype == torch.bfloat16 and kv.dtype in CACHE_DTYPES):
        return False
    B, Hq, HD = q.shape
    Hkv = kv.shape[1]
    if B == 0 or Hq % Hkv or Hq // Hkv > 16 or HD not in (64, 128, 256) or kv.shape[-1] != 2 * HD or r < 1:
        return False
    return kv.stride(-1) == 1 and q.stride(-1) == 1 and block_table.dim() == 2


def gate_covers(q, gate) -> bool:
    """The output gate the decode attention's merge applies: none, or [B, Hq, d] in q's dtype, elements of a head
    contiguous (row and head strides free: a view of the [Q | gate] projection)."""
    return gate is None or (gate.shape == q.shape and gate.dtype == q.dtype and gate.stride(-1) == 1
                            and gate.device == q.device)


def paged_covers(q, q_pos, index_q, kv, block_table, index_kv, index_block_table, r, budget) -> bool:
    """``qsa_decode_paged_triton``: its two halves' conditions, one indexer query per query."""
    return (select_paged_covers(index_q, index_kv, index_block_table, r)
            and attend_paged_covers(q, kv, block_table, r) and q.shape[0] == index_q.shape[0])


def prefill_paged_covers(q, q_pos, index_q, kv, block_row, index_kv, r, budget) -> bool:
    """``qsa_prefill_paged_triton``: ``paged_covers``' caches and widths, one block-table row."""
    row = block_row.unsqueeze(0)
    return (block_row.dim() == 1 and index_q.dim() == 3
            and paged_covers(q, q_pos, index_q, kv, row, index_kv, row, r, budget))


def write_paged_covers(kv, slots, k, v) -> bool:
    """``write_paged_triton``: K|V rows of one dtype (bf16, fp16, fp32), rows contiguous."""
    return (kv.dim() == 4 and k.dim() == v.dim() == 3 and k.shape == v.shape
            and kv.shape[-1] == 2 * k.shape[-1] and kv.shape[1] == k.shape[1] and kv.stride(-1) == 1
            and k.stride(-1) == 1 and v.stride(-1) == 1 and slots.dim() == 1 and slots.shape[0] == k.shape[0]
            and kv.dtype in (torch.bfloat16, torch.float16, torch.float32) and k.dtype == v.dtype == kv.dtype)


def index_update_covers(index_kv, ring, slots, pos, valid, raw, norm_weight, cos, sin, r) -> bool:
    """``index_update_triton``: bf16, one index head, a ring as wide as the raw keys, RoPE on an even prefix of the
    row, blocks of up to 64 that the ring holds."""
    B, di = raw.shape if raw.dim() == 2 else (0, 0)
    if not (index_kv.dtype == ring.dtype == raw.dtype == cos.dtype == sin.dtype == torch.bfloat16):
        return False
    RD = cos.shape[-1] if cos.dim() == 2 else 0
    return (index_kv.dim() == 4 and index_kv.shape[1] == 1 and index_kv.shape[-1] == 2 * di and raw.dim() == 2
            and ring.dim() == 4 and ring.shape[0] == index_kv.shape[0] and ring.shape[1] == 1
            and ring.shape[-1] == di and r <= ring.shape[2] and ring.stride(-1) == 1
            and 0 < RD <= di and RD % 2 == 0 and cos.shape == sin.shape == (B, RD) and cos.stride() == sin.stride()
            and cos.stride(-1) == 1 and raw.stride(-1) == 1 and index_kv.stride(-1) == 1 and 1 <= r <= 64
            and norm_weight.numel() == di and norm_weight.is_contiguous()
            and slots.shape == pos.shape == valid.shape == (B,))


def decode_writes_covers(kv, index_kv, ring, slots, pos, valid, k, v, raw, norm_weight, cos, sin, r,
                         nq: int = 1) -> bool:
    """``index_update_triton`` with the K|V rows: what the index update covers, K|V rows ``write_paged_triton``
    covers, of the index cache's dtype and pages (the plugin's one cache: its index views), up to 8 KV heads of
    up to 256; ``nq`` queries a request, whole requests (up to 16: an MTP verification)."""
    return (1 <= nq <= 16 and raw.shape[0] % nq == 0
            and index_update_covers(index_kv, ring, slots, pos, valid, raw, norm_weight, cos, sin, r)
            and write_paged_covers(kv, slots, k, v) and kv.dtype == index_kv.dtype
            and kv.shape[0] == index_kv.shape[0] and kv.shape[2] == index_kv.shape[2]
            and k.shape[1] <= 8 and k.shape[2] <= 256)


# ------------------------------------------------------------------------------------------ the decode's select
def _vllm_op_loaded(name: str) -> bool:
    """Whether vLLM's operator ``torch.ops._C.<name>`` (its CUDA build's) is registered: once vLLM's extension is
    loaded (an engine, or ``load_vllm_kernels``)."""
    try:
        return hasattr(torch.ops._C, name)
    except (AttributeError, RuntimeError):
        return False


def vllm_topk_loaded() -> bool:
    """vLLM's top-k select (``cooperative_topk``)."""
    return _vllm_op_loaded("cooperative_topk")


def vllm_persistent_topk_loaded() -> bool:
    """vLLM's many-row select (``persistent_topk``, the one upstream's prefill runs)."""
    return _vllm_op_loaded("persistent_topk")


VLLM_COOPERATIVE_MAX_ROWS = 64  # cooperative_topk's row limit (one cluster wave); past it persistent_topk
VLLM_TOPK_KS = (512, 1024, 2048)  # the top-k sizes vLLM's selects take


def vllm_topk_covers(rows: int, m: int) -> bool:
    """Whether vLLM's top-k operator is loaded and serves ``rows`` rows of top ``m``."""
    if rows > VLLM_COOPERATIVE_MAX_ROWS or m not in VLLM_TOPK_KS:
        return False
    return vllm_topk_loaded()


def prefill_select(m: int) -> str:
    """Which select a paged prefill chunk past the budget runs: "vllm" (``QWEN4EXP_QSA_PREFILL_SELECT=vllm``, the
    default: its cooperative select up to 64 rows, its persistent one past them; fp32 scores; the timings behind
    it: docs/performance.md, Decisions) or "triton" (ours, on int64 sort keys: with ``=triton``, and where vLLM is
    not loaded or for other top-k sizes)."""
    if (envs.QWEN4EXP_QSA_PREFILL_SELECT == "vllm" and VLLM_TOPK and m in VLLM_TOPK_KS and vllm_topk_loaded()
            and vllm_persistent_topk_loaded()):
        return "vllm"
    return "triton"


def load_vllm_kernels() -> bool:
    """Registers vLLM's operators the way its platform does at engine start (outside an engine: benchmarks,
    tests); False where vLLM is not installed."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    current_platform.import_kernels()
    return True


def decode_select(rows: int, n_blocks: int, m: int) -> str:
    """Which select ``qsa_select_paged_triton`` runs for ``rows`` queries over up to ``n_blocks`` blocks, top m:
    "dense" (no query can be past the budget: every visible block, no scores), "vllm" or "triton"."""
    if not (n_blocks > m and m > 0):
        return "dense"
    if VLLM_TOPK and vllm_topk_covers(rows, m):
        return "vllm"
    return "triton"


# ------------------------------------------------------------------------------------------- launch plans, warm-up
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The next power of two >= n (1 for n <= 1), as ``triton.next_power_of_2``."""
    return 1 << max(int(n) - 1, 0).bit_length()


def topk_plan(Tq: int, Nb: int, m: int) -> tuple:
    """The select ``top_ids`` runs for Tq rows of Nb keys: ("split", n_chunks, N_P of the merge launch), ("small",
    N_P) or ("radix",). Shared with ``prefill_variants`` (what a warm-up must compile)."""
    n_chunks = cdiv(Nb, launch.TOPK_SPLIT) if launch.TOPK_SPLIT else 0
    if (n_chunks > 1 and Tq <= launch.TOPK_SPLIT_MAX_ROWS and 2 * m <= launch.TOPK_SPLIT
            and n_chunks * m <= launch.TOPK_SMALL_MAX):
        return ("split", n_chunks, max(launch.TOPK_SMALL_MIN, next_pow2(n_chunks * m)))
    if Nb <= launch.TOPK_SMALL_MAX:  # keys in registers, the threshold by TOPK_SMALL_BITS a step
        return ("small", min(max(launch.TOPK_SMALL_MIN, next_pow2(max(Nb, 1))), launch.TOPK_SMALL_MAX))
    return ("radix",)  # radix select over chunks of keys


def attn_split(Tq: int, Hkv: int, n_slots: int) -> tuple:
    """The split attention's launch for Tq queries over n_slots slots: (many-query settings, slots a loop step,
    warps, slot chunks, chunks a program, programs a (query, KV head))."""
    many = Tq >= launch.ATTN_MANY_QUERIES
    SB, warps = ((launch.ATTN_SLOT_BLOCK_MANY, launch.ATTN_WARPS_MANY) if many
                 else (launch.ATTN_SLOT_BLOCK, launch.ATTN_WARPS))
    n_chunks = cdiv(max(n_slots, 1), SB)
    cpp = cdiv(n_chunks, min(n_chunks, max(1, cdiv(launch.ATTN_PROGRAMS, Tq * Hkv))))  # chunks a program
    return many, SB, warps, n_chunks, cpp, cdiv(n_chunks, cpp)


def prefill_step(Tq: int, n_blocks: int, m: int) -> tuple[bool, int]:
    """(whether the indexer selects, queries a chunk) of ``qsa_prefill_paged_triton``: chunks whose int64 sort keys
    stay below PREFILL_KEYS_BYTES, at most PREFILL_MAX_QUERIES (the attention grids put queries on an axis limited
    to 65,535)."""
    indexed = n_blocks > m and m > 0
    step = max(1, min(Tq, launch.PREFILL_KEYS_BYTES // (8 * n_blocks))) if indexed else max(Tq, 1)
    return indexed, min(step, launch.PREFILL_MAX_QUERIES)


def _topk_variants(plan: tuple) -> set:
    """``topk_plan``'s launches as variant keys (the split's chunk count is a runtime size, not a variant)."""
    if plan[0] == "split":
        return {("topk", "split-chunks"), ("topk", "split", plan[2])}
    return {("topk",) + plan}


def _split_attn_variants(Tq: int, Hkv: int, n_slots: int) -> set:
    """The split attention's two launches (``attn_split``) as variant keys."""
    many, *_, n_split = attn_split(Tq, Hkv, n_slots)
    return {("attn", many), ("merge", next_pow2(n_split))}


def _warmup_block_counts(max_blocks: int, m: int) -> list:
    """Block counts up to ``max_blocks`` on both sides of every point where a select's launch changes: the dense
    regime's end (m), the powers of two that set the in-register select's width, the split and radix thresholds."""
    split, small = launch.TOPK_SPLIT, launch.TOPK_SMALL_MAX
    nbs = {min(m, max_blocks), max_blocks, m + 1, split, split + 1, small, small + 1}
    p = launch.TOPK_SMALL_MIN // 2
    while p <= 4 * max(launch.TOPK_SMALL_MAX, launch.TOPK_SPLIT * launch.TOPK_SMALL_MAX // max(m, 1)):
        nbs.update((p, p + 1))
        p *= 2
    return sorted(n for n in nbs if 1 <= n <= max_blocks)


def _cover(cands: list, variants) -> list:
    """The candidates, in order, that each launch a variant (``variants(*cand)``) none before them did."""
    seen, cases = set(), []
    for c in cands:
        v = variants(*c)
        if not v <= seen:
            seen |= v
            cases.append(c)
    return cases


def decode_variants(B: int, n_blocks: int, m: int, r: int, Hkv: int) -> set:
    """The kernel variants ``qsa_decode_paged_triton`` launches for B single queries over up to n_blocks blocks
    (``prefill_variants``' keys; the select as ``host.decode_select`` picks it: vLLM's, compiled ahead, or ours)."""
    out = _split_attn_variants(B, Hkv, m * r + (r - 1))
    select = decode_select(B, n_blocks, m)
    if select != "dense":
        out.add(("score_paged", select == "vllm"))
    if select == "triton":
        out |= _topk_variants(topk_plan(B, n_blocks, m))
    return out


def decode_warmup_cases(max_rows: int, max_blocks: int, m: int, r: int, Hkv: int) -> list:
    """(rows, blocks) cases whose ``qsa_decode_paged_triton`` calls together launch every kernel variant that a call
    of up to ``max_rows`` queries over up to ``max_blocks`` blocks can (``decode_variants``): the decode rows of
    mixed steps and MTP verifications run eagerly, outside the CUDA graphs that compile the pure-decode ones."""
    nbs = _warmup_block_counts(max_blocks, m)
    # the attention's variants change with the rows alone, the select's with rows and blocks: every row count over
    # the cheapest block count, then the block counts over the few row counts where the select changes
    # (past ATTN_PROGRAMS rows the split no longer changes: each (query, KV head) is one program)
    rows_b = sorted({*range(1, min(max_rows, launch.ATTN_PROGRAMS) + 1), max_rows})
    select_rows = sorted(b for b in {1, 64, 65, launch.TOPK_SPLIT_MAX_ROWS, launch.TOPK_SPLIT_MAX_ROWS + 1, max_rows}
                         if b <= max_rows)
    cands = [(b, nbs[0]) for b in rows_b] + sorted(((b, n) for b in select_rows for n in nbs),
                                                   key=lambda c: c[0] * c[1])
    return _cover(cands, lambda b, n: decode_variants(b, n, m, r, Hkv))


def prefill_variants(Tq: int, n_blocks: int, m: int, r: int, Hkv: int) -> set:
    """The kernel variants (kernel, what its compiled code depends on) that ``qsa_prefill_paged_triton`` launches
    for Tq queries over n_blocks blocks: its integer sizes are not specialised, so these are what a first use
    compiles."""
    indexed, step = prefill_step(Tq, n_blocks, m)
    n_slots = m * r + (r - 1)
    vllm = prefill_select(m) == "vllm"
    out = set()
    for c0 in range(0, Tq, step):
        t = min(step, Tq - c0)
        if indexed:
            out |= {("score_prefill", vllm)} | (set() if vllm else _topk_variants(topk_plan(t, n_blocks, m)))
        out |= {("attn_loop",)} if t >= launch.LOOP_MIN_QUERIES else _split_attn_variants(t, Hkv, n_slots)
    return out


def prefill_warmup_cases(max_blocks: int, m: int, r: int, Hkv: int) -> list:
    """(queries, blocks) cases whose ``qsa_prefill_paged_triton`` calls together launch every kernel variant that a
    call over at most ``max_blocks`` blocks can launch (``prefill_variants``; any number of queries: a call's last
    chunk may hold a single one); cheapest first, each adding a variant the ones before did not."""
    nbs = _warmup_block_counts(max_blocks, m)
    tqs = sorted({*range(1, launch.LOOP_MIN_QUERIES + 1), launch.TOPK_SPLIT_MAX_ROWS + 1})
    cands = sorted(((t, n) for t in tqs for n in nbs), key=lambda c: (c[0] * c[1], c))
    return _cover(cands, lambda t, n: prefill_variants(t, n, m, r, Hkv))
