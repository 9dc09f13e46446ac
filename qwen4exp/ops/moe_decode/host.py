"""What the MoE decode kernels cover and how they are launched, from shapes, dtypes and strides alone (no Triton, no
device checks), so that CPU tests check it; ``cuda.py`` adds the device check and the switch
(``QWEN4EXP_MOE_DECODE``) and sends the rest to the torch reference."""

from __future__ import annotations

import torch

MAX_TOKENS = 4  # decode and MTP verify (up to 3 drafts + 1); more tokens: a grouped GEMM wins
MAX_EXPERTS = 1024  # the router's top-k holds one token's logits in one block
MAX_TOP_K = 32
GROUP = 16  # NVFP4: one scale per 16 inputs
DTYPES = (torch.bfloat16, torch.float32)


def router_covers(x, weight, top_k) -> bool:
    """``router_topk_triton``: x [M, D] (1 <= M <= MAX_TOKENS, rows contiguous), weight [E, D] contiguous, of one
    dtype (bf16 or fp32), E <= MAX_EXPERTS, 1 <= top_k <= min(E, MAX_TOP_K)."""
    return (x.ndim == 2 and weight.ndim == 2 and x.dtype in DTYPES and weight.dtype == x.dtype
            and 1 <= x.shape[0] <= MAX_TOKENS and x.shape[1] == weight.shape[1] > 0 and x.stride(-1) == 1
            and weight.is_contiguous() and 0 < weight.shape[0] <= MAX_EXPERTS
            and 1 <= top_k <= min(weight.shape[0], MAX_TOP_K))


def experts_covers(x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, topk_weights, topk_ids) -> bool:
    """``experts_nvfp4_triton``: x [M, D] (1 <= M <= MAX_TOKENS, bf16 or fp32, rows contiguous); the plain NVFP4
    layout of ``reference`` (contiguous, D and I multiples of 16); top-k weights [M, k] (float) and ids [M, k]
    (int32 / int64)."""
    if not (x.ndim == 2 and x.dtype in DTYPES and 1 <= x.shape[0] <= MAX_TOKENS and x.stride(-1) == 1):
        return False
    M, D = x.shape
    if w13.ndim != 3 or w2.ndim != 3:
        return False
    E, I2 = w13.shape[0], w13.shape[1]
    I = I2 // 2
    shapes = ((w13, torch.uint8, (E, 2 * I, D // 2)), (w13_scale, torch.float8_e4m3fn, (E, 2 * I, D // GROUP)),
              (w2, torch.uint8, (E, D, I // 2)), (w2_scale, torch.float8_e4m3fn, (E, D, I // GROUP)))
    return (D % GROUP == 0 and I2 % 2 == 0 and I > 0 and I % GROUP == 0
            and all(t.dtype == dt and tuple(t.shape) == s and t.is_contiguous() for t, dt, s in shapes)
            and all(g.dtype == torch.float32 and g.numel() == E and g.is_contiguous() for g in (w13_gs, w2_gs))
            and topk_ids.ndim == 2 and topk_ids.shape[0] == M and 1 <= topk_ids.shape[1] <= MAX_TOP_K
            and topk_ids.dtype in (torch.int32, torch.int64) and topk_weights.shape == topk_ids.shape
            and topk_weights.dtype in DTYPES and topk_ids.is_contiguous() and topk_weights.is_contiguous())


def w2_groups(top_k: int, experts_per_program: int) -> tuple[int, int]:
    """The down projection's split of its reduction (top-k experts x I) over programs: (experts a program, groups).
    One group: each program sums all k experts and stores its rows; more: fp32 atomics and a last-arriver store."""
    g = max(1, min(experts_per_program, top_k))
    return g, -(-top_k // g)


def block_k(K: int, knob: int) -> int:
    """The inputs one loop step reads per row: the knob, at most K rounded up to a power of two, at least a group."""
    p = 1 << max(0, (K - 1).bit_length())
    return max(GROUP, min(knob, p))
