"""Launch settings of the QSA Triton kernels, grouped by kernel family, and the launch record; Triton-free, so the
host-side planning (``host``) and CPU tests read them. The kernel modules read them at each call: tests and
``benchmarks/bench_ops.py`` change them for a run (``tests/ops/interpreter.settings(launch, ...)``). The measurements
behind the values: ``docs/performance.md``."""

from __future__ import annotations

from .._registry import Launches

LAUNCHED = Launches()  # the last launch of each kernel, under _registry.record() (which ran; registers / spills)
INT64_MIN = -(1 << 63)  # the sort key of a block a query cannot see
# Positions and block-table rows reach the kernels as views into the step's batch (``positions[s:e]``,
# ``block_table[b]``): their start is 16-byte aligned or not depending on where the request sits, and Triton would
# compile one variant per alignment, in the middle of serving. Not specialised on it (their loads are tiny).
ROW_VIEWS = ['QPOS', 'POS', 'BT', 'IBT']

# --- scores (``score``) -----------------------------------------------------------------------------------------
# Block keys per program of the decode score kernel, and its warps (128 x 8: more of the memory bandwidth at batch
# 32 than 64 x 4; the same at batch 1)
SCORE_PAGED_BLOCK_N = 128
SCORE_PAGED_WARPS = 8
SCORE_BLOCK_M = 64  # queries x block keys per program of the prefill score kernel
SCORE_BLOCK_N = 64
SCORE_WARPS = 4
SCORE_STACK_HEADS = False  # the prefill scores' heads as rows of one product (bench_ops --tune-prefill times both)

# --- the top-m select (``select``) ---------------------------------------------------------------------------------
VLLM_TOPK_WORKSPACE_BYTES = 1 << 20  # vLLM's select's scratch (the size vLLM's callers give it)
TOPK_CHUNK = 8192  # keys per pass step of the chunked radix select (past TOPK_SMALL_MAX blocks)
TOPK_SMALL_MAX = 16384  # up to this many blocks the in-register select (<= 2^16: it packs two counts in an int32)
# Threshold bits per search step of the in-register select in one launch (0: one bit a step; the fastest measured
# against two bits, a search over all 32 bits and 8-bit radix digits)
TOPK_SMALL_BITS = 0
TOPK_SMALL_WARPS = 16  # its warps
# It holds N_P = the next power of two >= the block count, at least this: four variants (2048 .. 16384), each
# compiled at its first use (the kernels' integer sizes are not specialised, so no other length compiles anything).
TOPK_SMALL_MIN = 2048
# Past this many blocks, for up to TOPK_SPLIT_MAX_ROWS queries (decode, MTP verification): the select in two
# launches, chunks of TOPK_SPLIT keys each selecting their top m (one program per chunk: more SMs at work than one
# program per query), then the top m of those candidates (exact: every key of the top m is in its chunk's top m).
# 0: one launch, one program per query (prefill-sized batches always).
TOPK_SPLIT = 4096
TOPK_SPLIT_MAX_ROWS = 128
TOPK_SPLIT_WARPS = 8
TOPK_SPLIT_BITS = 2  # the split select's threshold bits a step (two: faster than one at batch 1 and 32)

# --- the split attention + merge (``attend``; decode, short chunks) -------------------------------------------------
# Few queries (batch 1): selected-token slots per loop step and warps. 32 x 8 fits the real widths (12 heads padded
# to 16 x 256) in registers without spills; 64 x 8 is a little faster but spills.
ATTN_SLOT_BLOCK = 32
ATTN_WARPS = 8
# Each (query, KV head) is split over slot ranges so that about this many programs run (batch 1: one chunk a
# program; batch 32: several chunks a program, which keeps the fp32 partials the merge reads back few).
ATTN_PROGRAMS = 512
ATTN_STAGES = 1  # software-pipeline stages of its loop over chunks, few queries (1-3 within noise)
ATTN_STAGES_MANY = 3  # many queries: Triton's pipeliner issues the next chunks' K/V loads ahead of the math
ATTN_MANY_QUERIES = 8  # from this many queries (batch-32 decode) the many-query settings: 16 slots x 2 warps
ATTN_SLOT_BLOCK_MANY = 16
ATTN_WARPS_MANY = 2
# Look the next chunk's rows up while this chunk's K/V loads are in flight: a gain for many-query decode; for few
# queries noise-level, and it makes the 32 x 8 launch spill.
ATTN_PREFETCH_MANY = True
ATTN_PREFETCH = False

# --- prefill chunks (``triton_kernel.qsa_prefill_paged_triton``; the looping attention in ``attend``) -------------
LOOP_MIN_QUERIES = 256  # prefill chunks of this many queries on: one looping program per (query, KV head)
# Slots per loop iteration of that kernel, its warps and software-pipeline stages (the fastest of the shapes swept
# at 4,096 queries x 50k context: ``benchmarks/bench_ops.py --tune-prefill``)
LOOP_SLOT_BLOCK = 128
LOOP_WARPS = 4
LOOP_STAGES = 2
# The next chunk's rows (ids -> block table -> row offsets) looked up while this chunk's K/V loads are in flight, as
# the many-query decode does: an open A/B for the looping prefill (bench_ops.py --tune-prefill sweeps it)
LOOP_PREFETCH = False
PREFILL_KEYS_BYTES = 256 << 20  # the int64 sort keys of one query chunk of qsa_prefill_paged_triton stay below this
PREFILL_MAX_QUERIES = 16384  # and a chunk has at most this many queries
