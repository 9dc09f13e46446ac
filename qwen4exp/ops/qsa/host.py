"""The QSA CUDA path's host-side decisions: what each kernel covers and which top-k select a paged decode runs,
from shapes, dtypes and strides alone (no Triton, no device checks), so that CPU tests check them. ``cuda.py``
adds the device checks (``*_supported``) and sends whatever a kernel does not cover to the torch reference."""

from __future__ import annotations

import torch

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


# ------------------------------------------------------------------------------------------ the decode's select
def vllm_topk_loaded() -> bool:
    """Whether vLLM's top-k operator (``torch.ops._C.cooperative_topk``, its CUDA build's) is registered: once
    vLLM's extension is loaded (an engine, or ``load_vllm_kernels``)."""
    try:
        return hasattr(torch.ops._C, "cooperative_topk")
    except (AttributeError, RuntimeError):
        return False


def vllm_topk_covers(rows: int, m: int) -> bool:
    """Whether vLLM's top-k operator is loaded and serves ``rows`` rows of top ``m``."""
    if rows > 64 or m not in (512, 1024, 2048):  # its row limit (one cluster wave) and its k values
        return False
    return vllm_topk_loaded()


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
