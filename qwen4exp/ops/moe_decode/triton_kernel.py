"""Triton kernels of the MoE decode op at M <= 4 tokens (``reference`` is the contract; ``host`` says what they
cover). Imported only on the CUDA path (``cuda.py``) or under the CPU interpreter (tests).

Router (``_router_topk_kernel``, one launch): each program computes the logits of BLOCK_E experts for all M tokens
(fp32 dot products, rounded to the activation dtype as ``F.linear``'s output is) and stores them; the last program to
finish (an atomic ticket; the counter resets itself, so the launch replays in a CUDA graph) reads the M x E logits
back and does softmax (fp32), top-k (k rounds of arg-max; ties go to the lower expert id) and the renormalisation.
512 x 2560 bf16 is 2.6 MB: one program a token would read it at one SM's bandwidth, so the GEMV is spread over
E / BLOCK_E programs (128 at the defaults) and only the 512-wide selection is serial.

Experts (two launches), NVFP4 weights decoded in registers; each 16-input group's partial dot product is multiplied
by its e4m3 scale and the sum by the expert's fp32 global scale at the end. The first design's decode (``DECODE =
"select"``: each nibble through exponent / mantissa selects, ~14 INT32 instructions a code in the loop's SASS) bound
the kernels on INT32 issue (docs/performance.md, runs 30-31); ``DECODE = "shift"`` (the default, awaiting its GPU
A/B) moves the code's bits into an fp32 subnormal-scaled value with two shifts and a logic operation (~6 INT32
instructions a code with the byte extraction and addressing, ``tools/kernel_resources.py --sass``), same bits.
An int32-word decode that reshaped [rows, groups, 2 words, 8 codes] measured slower than select (run 31): its
layout cost shuffles; the shift decode keeps select's byte tile.

* ``_w13_silu_kernel``: grid (I / W13_BLOCK_N, M * k): one program = W13_BLOCK_N gate rows and the matching up rows
  of one selected expert of one token, over the whole input (K = 2560). At M = 1 that is 10 x 640 / 8 = 800 programs
  of ~20 KB each (~6 programs an SM on 132 SMs), so rows alone fill the GPU and no program needs another's partial
  sums: SiLU(gate) * up is the epilogue, stored in the activation dtype (the reference's rounding point) to a
  [M * k, I] buffer. A split over K here would need a cross-program reduction before the SiLU for no gain in
  parallelism, so there is none.
* ``_w2_combine_kernel``: grid (D / W2_BLOCK_N, M * groups): the down projection and the weighted top-k sum are one
  reduction of length k x I (6,400) per output row; it is split over the experts: a program sums W2_EXPERTS experts
  (each over all of I = 640), weighted by their routing weights, in fp32. With one group (W2_EXPERTS >= k) it stores
  its rows directly (deterministic); with several (the default: 5 groups of 2 at k = 10, 80 x 5 = 400 programs of
  ~20 KB at M = 1) each adds its partial sums to an fp32 scratch row with atomics, and the last of a row block's
  programs (an atomic ticket) swaps the sums out (resetting the scratch to zero), rounds once and stores them.
  The fp32 atomics make the summation order, so the last bit, run-dependent.

M > 1 tokens loop: each (token, expert) pair has its programs, also where two tokens picked the same expert (L2 may
serve the second read); sharing the read between tokens is left for the GPU tuning. The scratch buffers (router
counter, the down projection's fp32 rows and tickets) are cached per device: one launch at a time per device, and
the first call should run before any CUDA-graph capture (vLLM's warm-up does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import exp as _exp
from ..triton_utils import round_bf16 as _rbf
from ..triton_utils import silu as _silu
from . import host

# launch knobs (benchmarks/bench_ops.py sweeps them with ``with_knobs``)
ROUTER_BLOCK_E, ROUTER_BLOCK_D, ROUTER_WARPS = 4, 512, 4
W13_BLOCK_N, W13_BLOCK_K, W13_WARPS = 8, 512, 4
W2_BLOCK_N, W2_BLOCK_K, W2_EXPERTS, W2_WARPS = 32, 128, 2, 4
DECODE = "shift"  # NVFP4 codes: "shift" (~4 integer operations a code) or "select" (~14; the measured first design)


# ------------------------------------------------------------------------------------------------------- router
@triton.jit
def _router_topk_kernel(X, W, LOGITS, TW, TID, COUNTER, M, E, D, stride_x, TOP_K: tl.constexpr,
                        RENORM: tl.constexpr, BF16: tl.constexpr, M_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_D: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr):
    e_offs = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = e_offs < E
    m_offs = tl.arange(0, M_PAD)
    m_mask = m_offs < M
    acc = tl.zeros((M_PAD, BLOCK_E), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        w = tl.load(W + e_offs[:, None].to(tl.int64) * D + d[None, :], mask=e_mask[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)
        x = tl.load(X + m_offs[:, None] * stride_x + d[None, :], mask=m_mask[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if BF16:
        acc = _rbf(acc)  # F.linear's output dtype: the logits the reference's softmax sees
    tl.store(LOGITS + m_offs[:, None] * E + e_offs[None, :], acc.to(LOGITS.dtype.element_ty),
             mask=m_mask[:, None] & e_mask[None, :])
    tl.debug_barrier()  # every thread's stores issued before the release of the ticket
    ticket = tl.atomic_add(COUNTER, 1)  # acq_rel, GPU scope
    if ticket == tl.num_programs(0) - 1:  # the last program: all logits are stored
        offs = tl.arange(0, E_PAD)
        kk = tl.arange(0, K_PAD)
        for m in range(M):
            lg = tl.load(LOGITS + m * E + offs, mask=offs < E, other=float("-inf"),
                         cache_modifier=".cg").to(tl.float32)  # (.cg: from L2, not a stale L1 line)
            p = _exp(lg - tl.max(lg, 0))
            p = tl.where(offs < E, p, 0.0)
            p = tl.div_rn(p, tl.sum(p, 0))
            cur = tl.where(offs < E, p, -1.0)
            sel_w = tl.zeros((K_PAD,), tl.float32)
            sel_i = tl.zeros((K_PAD,), tl.int32)
            for j in tl.static_range(TOP_K):  # k rounds of arg-max, lowest id among equals
                best = tl.max(cur, 0)
                idx = tl.min(tl.where(cur == best, offs, E_PAD), 0)
                sel_w = tl.where(kk == j, best, sel_w)
                sel_i = tl.where(kk == j, idx, sel_i)
                cur = tl.where(offs == idx, -1.0, cur)
            if RENORM:
                sel_w = tl.div_rn(sel_w, tl.sum(sel_w, 0))  # (lanes past k hold 0)
            if BF16:
                sel_w = _rbf(sel_w)
            tl.store(TW + m * TOP_K + kk, sel_w.to(TW.dtype.element_ty), mask=kk < TOP_K)
            tl.store(TID + m * TOP_K + kk, sel_i.to(TID.dtype.element_ty), mask=kk < TOP_K)
        tl.atomic_xchg(COUNTER, 0)  # ready for the next launch


_COUNTERS: dict = {}


def _router_counter(device) -> torch.Tensor:
    key = ("router", device)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def router_topk_triton(x, weight, top_k: int, renormalize: bool):
    M, D = x.shape
    E = weight.shape[0]
    logits = torch.empty(M, E, dtype=x.dtype, device=x.device)
    tw = torch.empty(M, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(M, top_k, dtype=torch.int64, device=x.device)
    _router_topk_kernel[(triton.cdiv(E, ROUTER_BLOCK_E),)](
        x, weight, logits, tw, ids, _router_counter(x.device), M, E, D, x.stride(0), TOP_K=top_k,
        RENORM=bool(renormalize), BF16=x.dtype == torch.bfloat16, M_PAD=triton.next_power_of_2(M),
        BLOCK_E=ROUTER_BLOCK_E, BLOCK_D=min(ROUTER_BLOCK_D, triton.next_power_of_2(D)),
        E_PAD=triton.next_power_of_2(E), K_PAD=triton.next_power_of_2(top_k), num_warps=ROUTER_WARPS)
    return logits, tw, ids


# ------------------------------------------------------------------------------------------------ NVFP4 decode
@triton.jit
def _e2m1(code):
    """E2M1 codes (int32, 0..15) -> fp32: magnitude 2^(e-1) * (1 + m/2) for exponent e > 0, m/2 for e = 0."""
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(b):
    """float8_e4m3fn bytes (int32, 0..255) -> fp32 (bias 7; subnormals m * 2^-9; NaN codes are never written)."""
    e = (b >> 3) & 15
    m = b & 7
    v = tl.where(e > 0, (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True), m.to(tl.float32) * 0.001953125)
    return tl.where((b & 128) != 0, -v, v)


@triton.jit
def _nvfp4_dot_bytes(Wp, Sp, rows, rmask, row_bytes, row_groups, k0, K, Xp, R: tl.constexpr, BLOCK_K: tl.constexpr,
                     SHIFT: tl.constexpr):
    """sum over inputs k0 .. k0 + BLOCK_K of w[row, k] * x[k] / global scale, for R rows: packed codes (bytes) at
    Wp + row * row_bytes, e4m3 scales at Sp + row * row_groups, x at Xp -> [R] fp32.

    SHIFT (the default decode): a code's magnitude bits (e1 e0 m) moved to fp32 bits 24..22 and its sign to bit 31
    make an fp32 equal to the E2M1 value times 2^-126 (exponent 0: a subnormal, exact), two shifts and two logic
    operations a code; x is read times 2^64 and each group's scale times 2^62, so every product is the unscaled one
    times 2^-62 (exact: 2 significant bits times 8) and every sum rounds as the unscaled sum does (powers of two
    commute with rounding): the same bits as the select decode for |x| in [2^-63, 2^64). No flush-to-zero may touch
    the products (the compile check looks). Otherwise each nibble goes through exponent / mantissa selects (~14
    integer operations a code: INT32 issue bound the first GPU runs, docs/performance.md)."""
    HALF: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 16
    b = k0 // 2 + tl.arange(0, HALF)
    bm = b < K // 2
    xe = tl.load(Xp + 2 * b, mask=bm, other=0.0).to(tl.float32)
    xo = tl.load(Xp + 2 * b + 1, mask=bm, other=0.0).to(tl.float32)
    g = k0 // 16 + tl.arange(0, G)
    p = tl.load(Wp + rows[:, None] * row_bytes + b[None, :], mask=rmask[:, None] & bm[None, :], other=0).to(tl.int32)
    s = tl.load(Sp + rows[:, None] * row_groups + g[None, :], mask=rmask[:, None] & (g < K // 16)[None, :],
                other=0).to(tl.int32)
    if SHIFT:
        SIGN: tl.constexpr = -2147483648  # bit 31
        MAG: tl.constexpr = 0x01C00000  # bits 24..22
        lo = (((p << 22) & MAG) | ((p << 28) & SIGN)).to(tl.float32, bitcast=True)
        hi = (((p << 18) & MAG) | ((p << 24) & SIGN)).to(tl.float32, bitcast=True)
        t = lo * (xe * 18446744073709551616.0)[None, :] + hi * (xo * 18446744073709551616.0)[None, :]  # x * 2^64
        sc = _e4m3(s) * 4611686018427387904.0  # * 2^62
    else:
        t = _e2m1(p & 15) * xe[None, :] + _e2m1(p >> 4) * xo[None, :]  # [R, HALF]
        sc = _e4m3(s)
    t = tl.sum(tl.reshape(t, (R, G, 8)), axis=2)  # per 16-input group (8 bytes)
    return tl.sum(t * sc, axis=1)


# ---------------------------------------------------------------------------------------------- gate / up + SiLU
@triton.jit
def _w13_silu_kernel(X, W13, S13, GS13, IDS, ACT, D, I, stride_x, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BF16: tl.constexpr, SHIFT: tl.constexpr):
    pair = tl.program_id(1)  # token * TOP_K + slot
    m = pair // TOP_K
    e = tl.load(IDS + pair).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < I
    rw = D // 2  # bytes a packed row
    wg = W13 + e * (2 * I) * rw  # gate rows of expert e; up rows I further
    sg = S13 + e * (2 * I) * (D // 16)
    wu = wg + I * rw
    su = sg + I * (D // 16)
    xp = X + m * stride_x
    acc_g = tl.zeros((BLOCK_N,), tl.float32)
    acc_u = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        acc_g += _nvfp4_dot_bytes(wg, sg, rows, rmask, rw, D // 16, k0, D, xp, BLOCK_N, BLOCK_K, SHIFT)
        acc_u += _nvfp4_dot_bytes(wu, su, rows, rmask, rw, D // 16, k0, D, xp, BLOCK_N, BLOCK_K, SHIFT)
    gs = tl.load(GS13 + e)
    a = _silu(acc_g * gs) * (acc_u * gs)
    if BF16:
        a = _rbf(a)  # the down projection's input, rounded once (the reference's rounding point)
    tl.store(ACT + pair * I + rows, a.to(ACT.dtype.element_ty), mask=rmask)


# ---------------------------------------------------------------------------------- down + weighted top-k sum
@triton.jit
def _w2_combine_kernel(ACT, W2, S2, GS2, IDS, TW, OUT, WS, WS_BITS, CNT, D, I, stride_o, TOP_K: tl.constexpr,
                       EXPERTS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BF16: tl.constexpr, SHIFT: tl.constexpr):
    rw = I // 2  # bytes a packed row
    pid_n = tl.program_id(0)
    m = tl.program_id(1) // GROUPS
    grp = tl.program_id(1) % GROUPS
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < D
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for jj in tl.static_range(EXPERTS):
        j = grp * EXPERTS + jj
        if j < TOP_K:
            pair = m * TOP_K + j
            e = tl.load(IDS + pair).to(tl.int64)
            wp = W2 + e * D * rw
            sp = S2 + e * D * (I // 16)
            part = tl.zeros((BLOCK_N,), tl.float32)
            for k0 in range(0, I, BLOCK_K):
                ap = ACT + pair * I
                part += _nvfp4_dot_bytes(wp, sp, rows, rmask, rw, I // 16, k0, I, ap, BLOCK_N, BLOCK_K, SHIFT)
            acc += (part * tl.load(GS2 + e)) * tl.load(TW + pair).to(tl.float32)
    if GROUPS == 1:
        if BF16:
            acc = _rbf(acc)
        tl.store(OUT + m * stride_o + rows, acc.to(OUT.dtype.element_ty), mask=rmask)
    else:
        tl.atomic_add(WS + m * D + rows, acc, mask=rmask)
        tl.debug_barrier()  # every thread's adds issued before the release of the ticket
        cnt = CNT + m * tl.num_programs(0) + pid_n
        if tl.atomic_add(cnt, 1) == GROUPS - 1:  # the row block's last program: all partial sums are in
            # swap the sums out as bits (WS_BITS: the same buffer as int32; a float exchange is not in the CPU
            # interpreter), leaving zeros for the next launch
            tot = tl.atomic_xchg(WS_BITS + m * D + rows, tl.zeros((BLOCK_N,), tl.int32), mask=rmask)
            tot = tot.to(tl.float32, bitcast=True)
            if BF16:
                tot = _rbf(tot)
            tl.store(OUT + m * stride_o + rows, tot.to(OUT.dtype.element_ty), mask=rmask)
            tl.atomic_xchg(cnt, 0)


def _w2_scratch(device, D, row_blocks):
    key = ("w2", device, D, row_blocks)
    if key not in _COUNTERS:
        _COUNTERS[key] = (torch.zeros(host.MAX_TOKENS, D, dtype=torch.float32, device=device),
                          torch.zeros(host.MAX_TOKENS * row_blocks, dtype=torch.int32, device=device))
    return _COUNTERS[key]


def experts_nvfp4_triton(x, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, topk_weights, topk_ids):
    M, D = x.shape
    k = topk_ids.shape[1]
    I = w2.shape[2] * 2
    bf16 = x.dtype == torch.bfloat16
    if DECODE not in ("shift", "select"):
        raise ValueError(f"moe_decode DECODE={DECODE!r}: 'shift' or 'select'")
    shift = DECODE == "shift"
    # the e4m3 scales read as bytes (decoded in the kernels)
    s13, s2 = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    act = torch.empty(M * k, I, dtype=x.dtype, device=x.device)
    _w13_silu_kernel[(triton.cdiv(I, W13_BLOCK_N), M * k)](
        x, w13, s13, w13_gs, topk_ids, act, D, I, x.stride(0), TOP_K=k, BLOCK_N=W13_BLOCK_N,
        BLOCK_K=host.block_k(D, W13_BLOCK_K), BF16=bf16, SHIFT=shift, num_warps=W13_WARPS)
    out = torch.empty(M, D, dtype=x.dtype, device=x.device)
    experts, groups = host.w2_groups(k, W2_EXPERTS)
    row_blocks = triton.cdiv(D, W2_BLOCK_N)
    ws, cnt = _w2_scratch(x.device, D, row_blocks)
    _w2_combine_kernel[(row_blocks, M * groups)](
        act, w2, s2, w2_gs, topk_ids, topk_weights, out, ws, ws.view(torch.int32), cnt, D, I, out.stride(0), TOP_K=k,
        EXPERTS=experts, GROUPS=groups, BLOCK_N=W2_BLOCK_N, BLOCK_K=host.block_k(I, W2_BLOCK_K), BF16=bf16,
        SHIFT=shift, num_warps=W2_WARPS)
    return out
