"""Triton kernels for the HC mixer (decode sizes: T <= ``host.MAX_T`` = 16 tokens, or ``host.MAX_T_HN`` = 32 when the
caller hands in the streams' norm), the HC write-back (alone, or with the next mixer's norm: ``hc_inject_norm``),
and the two kernels of the many-token path (``host.mix_many_tokens``). Imported only on the CUDA path
(``cuda.py``); what the kernels cover, and which path a call takes: ``host``.

``hc_mix`` runs as two launches (a single kernel would need a grid-wide barrier between the down- and the
up-projection, since every output needs all r down-projected values):

  A  ``_hc_down_kernel``  grid (row blocks of W_down + 1 block for W_inj, K splits of 512 inside one stream).  Each
     program loads its weight tile first, recomputes the RMS of its stream for its tokens (an L2 hit), normalises its
     K chunk of H into Hn (fp32 math, one bf16 rounding, as the reference) and writes fp32 split-K partial dot
     products [T, split, r + n].
  B  ``_hc_up_kernel``    grid (D / B_BLOCK_D), launched with programmatic dependent launch: it starts while A runs,
     loads its [n * B_BLOCK_D, r] slice of W_up, then waits for A.  Up to IN_KERNEL_SILU_MAX_T (1) token it sums the
     partials itself and rounds like the reference (bf16 linear output, /n, SiLU in fp32, bf16); past it that step
     runs once per token in ``_hc_finish_kernel``, a small launch between A and B (chained by PDL too).
     Then bf16(W_up a), sigmoid (bf16), the gated re-normalised Hn columns (bf16 product) and the mean over the n
     streams (fp32 sum, * 1/n, bf16).  Program 0 also finishes c = 2*sigmoid(bf16(bf16(W_inj Hn) / n)).

QWEN4EXP_HC_DECODE=fused-ticket: kernel A finishes the down projection itself, at every token count.  Each program
takes a ticket (an atomic counter per row block) after storing its partials; the last of a row block's K splits
sums that block's partials over the splits and writes a (or, for the W_inj block, c) in bf16, then zeroes its
counter.  Kernel B then always reads the finished a [T, r] (A_READY), its PDL wait after the W_up prefetch as
before: no finish launch, and no program of B re-reads the partials.

Rounding points are the reference's (``_rbf`` makes each one explicit: the compiler folded plain
``x.to(bf16).to(fp32)`` round trips away); exp / rsqrt are CUDA's expf / rsqrtf as in PyTorch's kernels.  The dot
products accumulate in fp32 in another order than cuBLAS, so a bf16 result can differ by one unit now and then.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ... import envs
from .._registry import Launches
from ..triton_utils import dot as _dot
from ..triton_utils import round_bf16 as _rbf
from ..triton_utils import rsqrt as _rsqrt
from ..triton_utils import sigmoid as _sigmoid
from ..triton_utils import silu as _silu

if os.environ.get("TRITON_INTERPRET", "0") != "1":
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _hc_down_part(H, NW, WD, WI, RSTD, PART, T, eps, inv_d, stride_h, pid_r, pid_k, n_split,
                  R: tl.constexpr, NI: tl.constexpr, D: tl.constexpr, NS: tl.constexpr, KC: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, NORM_BLOCK: tl.constexpr, HN_READY: tl.constexpr):
    """Stage A of one (row block, K chunk): normalise the chunk of H, multiply by the W_down (or W_inj) tile, store
    the fp32 split-K partials PART [T, n_split, R + NI] (and the streams' 1/RMS from the first row block).
    HN_READY: H holds the normalised streams already (``hc_inject_norm``): no norm here, RSTD is not written."""
    n_rb: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    NK: tl.constexpr = NS * D
    k0 = pid_k * KC
    s = k0 // D
    offs_k = k0 + tl.arange(0, KC)
    offs_r = tl.arange(0, BLOCK_R)
    # weights first: the only HBM traffic, issued before anything else
    if pid_r < n_rb:
        rows = pid_r * BLOCK_R + offs_r
        rmask = rows < R
        w = tl.load(WD + rows[:, None] * NK + offs_k[None, :], mask=rmask[:, None], other=0.0)
        out_col = rows
    else:
        rmask = offs_r < NI
        w = tl.load(WI + offs_r[:, None] * NK + offs_k[None, :], mask=rmask[:, None], other=0.0)
        out_col = R + offs_r
    offs_t = tl.arange(0, BLOCK_T)
    tmask = offs_t < T
    if HN_READY:
        hn = tl.load(H + offs_t[:, None] * stride_h + offs_k[None, :], mask=tmask[:, None], other=0.0)
    else:
        # this program's H chunk and norm weights (issued before the RMS reduction, so all loads overlap)
        hk = tl.load(H + offs_t[:, None] * stride_h + offs_k[None, :], mask=tmask[:, None],
                     other=0.0).to(tl.float32)
        nw = tl.load(NW + offs_k).to(tl.float32)
        # RMS of stream s for every token
        ss = tl.zeros([BLOCK_T], dtype=tl.float32)
        offs_n = tl.arange(0, NORM_BLOCK)
        for j in tl.static_range(0, D, NORM_BLOCK):  # unrolled: all loads in flight together
            cols = s * D + j + offs_n
            hv = tl.load(H + offs_t[:, None] * stride_h + cols[None, :],
                         mask=tmask[:, None] & ((j + offs_n) < D)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(hv * hv, axis=1)
        rstd = _rsqrt(ss * inv_d + eps)
        if (pid_r == 0) & (k0 % D == 0):
            tl.store(RSTD + offs_t * NS + s, rstd, mask=tmask)
        hn = ((hk * rstd[:, None]) * (1.0 + nw)[None, :]).to(tl.bfloat16)
    acc = _dot(hn, tl.trans(w))  # [BLOCK_T, BLOCK_R] fp32
    RT: tl.constexpr = R + NI
    tl.store(PART + offs_t[:, None] * (n_split * RT) + pid_k * RT + out_col[None, :], acc,
             mask=tmask[:, None] & rmask[None, :])


# T (the step's token count) is not specialised: Triton would compile a variant per T % 16 == 0 or not within each
# BLOCK_T bucket, and serving reaches counts the start-up's captures did not (e.g. 7 requests x 4 MTP queries = 28:
# FN-24L's JIT monitor named both kernels mid-serving). T only bounds masks.
@triton.jit
def _hc_down_ticket_finish(PART, A, C, T, inv_n, pid_r, n_split, R: tl.constexpr, NI: tl.constexpr,
                           BLOCK_R: tl.constexpr, NSPLIT_P: tl.constexpr, TT: tl.constexpr):
    """Run by the last program of row block pid_r to store its partials (the ticket): the sum over the n_split
    partials of this block's columns, TT tokens at a time, as the finish kernel rounds it:
    a = bf16(silu(bf16(bf16(d) / n))) into A [T, R] (a W_down block), c = 2 * bf16(sigmoid(bf16(bf16(z) / n)))
    into C [T, NI] (the W_inj block). The partials of the other programs are read through L2 (.cg: this SM's L1
    never held them, and is not coherent)."""
    n_rb: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    RT: tl.constexpr = R + NI
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, NSPLIT_P)
    kmask = offs_k < n_split
    if pid_r < n_rb:
        cols = pid_r * BLOCK_R + offs_r
        cmask = cols < R
        part_col = cols
    else:
        cols = offs_r
        cmask = offs_r < NI
        part_col = R + offs_r
    offs_tt = tl.arange(0, TT)
    for t0 in range(0, T, TT):
        tok = t0 + offs_tt
        tmask = tok < T
        blk = tl.load(PART + tok[:, None, None] * (n_split * RT) + offs_k[None, :, None] * RT
                      + part_col[None, None, :],
                      mask=tmask[:, None, None] & kmask[None, :, None] & cmask[None, None, :], other=0.0,
                      cache_modifier=".cg")
        d = tl.sum(blk, axis=1)  # [TT, BLOCK_R]
        omask = tmask[:, None] & cmask[None, :]
        if pid_r < n_rb:
            tl.store(A + tok[:, None] * R + cols[None, :], _down_act(d, inv_n), mask=omask)
        else:
            tl.store(C + tok[:, None] * NI + cols[None, :], _inj_weight(d, inv_n), mask=omask)


@triton.jit(do_not_specialize=['T'])
def _hc_down_kernel(
    H, NW, WD, WI, RSTD, PART, A, C, CNT,
    T, eps, inv_d, inv_n,
    stride_h,
    R: tl.constexpr, NI: tl.constexpr, D: tl.constexpr, NS: tl.constexpr,
    KC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, NORM_BLOCK: tl.constexpr,
    PDL: tl.constexpr, HN_READY: tl.constexpr, TICKET: tl.constexpr, NSPLIT_P: tl.constexpr, TT: tl.constexpr,
):
    """TICKET (QWEN4EXP_HC_DECODE=fused-ticket): the last of the n_split programs of a row block to store its
    partials finishes that block (``_hc_down_ticket_finish``): a [T, R] into A, c [T, NI] into C, for kernel B's
    A_READY path. CNT: one int32 counter per row block, zero before the launch and zeroed again by the last
    arriver (so the launch replays in a CUDA graph). Ordering: every thread's partial stores, a CTA barrier, then
    one acq_rel atomic at GPU scope (release: this program's stores; acquire: the earlier arrivers' released
    ones). Kernel B's gdc_wait waits for the whole grid, the finishing programs included."""
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_split = tl.num_programs(1)
    if PDL:  # let kernel B start now: it loads W_up while this kernel runs, then waits for the partials
        gdc_launch_dependents()
    _hc_down_part(H, NW, WD, WI, RSTD, PART, T, eps, inv_d, stride_h, pid_r, pid_k, n_split,
                  R, NI, D, NS, KC, BLOCK_R, BLOCK_T, NORM_BLOCK, HN_READY)
    if TICKET:
        tl.debug_barrier()  # all of this program's partial stores issued before its ticket
        ticket = tl.atomic_add(CNT + pid_r, 1, sem="acq_rel", scope="gpu")
        if ticket == n_split - 1:  # the last arriver of this row block
            tl.atomic_xchg(CNT + pid_r, 0, sem="relaxed", scope="gpu")  # ready for the next launch / replay
            _hc_down_ticket_finish(PART, A, C, T, inv_n, pid_r, n_split, R, NI, BLOCK_R, NSPLIT_P, TT)


@triton.jit
def _hc_up_load(H, NW, WU, T, stride_h, pid, R: tl.constexpr, D: tl.constexpr, NS: tl.constexpr,
                R_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, HN_READY: tl.constexpr):
    """Stage B's inputs that do not depend on stage A: the [n * BLOCK_D, r] slice of W_up for output columns
    pid * BLOCK_D.., the H columns (the Hn columns if HN_READY) and norm weights (combined (stream, column) index
    i -> row s*D + j0 + i % BLOCK_D of W_up / column of H)."""
    j0 = pid * BLOCK_D
    offs_i = tl.arange(0, NS * BLOCK_D)
    col = (offs_i // BLOCK_D) * D + j0 + offs_i % BLOCK_D
    cmask = (j0 + offs_i % BLOCK_D) < D
    offs_r = tl.arange(0, R_P)
    w = tl.load(WU + col[:, None] * R + offs_r[None, :], mask=cmask[:, None] & (offs_r < R)[None, :], other=0.0)
    offs_t = tl.arange(0, BLOCK_T)
    hk = tl.load(H + offs_t[:, None] * stride_h + col[None, :], mask=(offs_t < T)[:, None] & cmask[None, :],
                 other=0.0).to(tl.float32)
    if HN_READY:
        nw = hk  # (unused)
    else:
        nw = tl.load(NW + col, mask=cmask, other=0.0).to(tl.float32)
    return w, hk, nw


@triton.jit
def _down_act(d, inv_n):
    """a = bf16(silu(bf16(bf16(d) / n))) from d, the fp32 sum of a token's W_down partials (the reference:
    F.silu(F.linear(Hn, W_down) / n), each op rounded)."""
    q = _rbf(_rbf(d) * inv_n)
    return _silu(q).to(tl.bfloat16)


@triton.jit
def _inj_weight(z, inv_n):
    """c = 2 * bf16(sigmoid(bf16(bf16(z) / n))) from z, the fp32 sum of a token's W_inj partials."""
    z = _rbf(_rbf(z) * inv_n)
    return (2.0 * _rbf(_sigmoid(z))).to(tl.bfloat16)


@triton.jit
def _hc_up_finish(w, hk, nw, RSTD, PART, X, C, T, n_split, inv_n, stride_x, pid,
                  R: tl.constexpr, NI: tl.constexpr, D: tl.constexpr, NS: tl.constexpr, R_P: tl.constexpr,
                  NI_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, NSPLIT_P: tl.constexpr,
                  A_READY: tl.constexpr, C_IN_KERNEL: tl.constexpr, HN_READY: tl.constexpr):
    """Stage B after stage A: a from the partials, gamma = sigmoid(W_up a), the gated mean over the streams for
    output columns pid * BLOCK_D.. (PART and RSTD read through L2: another program of the same launch may have just
    written them)."""
    j0 = pid * BLOCK_D
    offs_i = tl.arange(0, NS * BLOCK_D)
    offs_r = tl.arange(0, R_P)
    offs_t = tl.arange(0, BLOCK_T)
    tmask = offs_t < T
    RT: tl.constexpr = R + NI
    offs_k = tl.arange(0, NSPLIT_P)
    kmask = offs_k < n_split
    rmask = offs_r < R
    if A_READY:  # a = bf16(silu(bf16(W_down Hn) / n)) already computed (many tokens): PART is a bf16 [T, R]
        a = tl.load(PART + offs_t[:, None] * R + offs_r[None, :], mask=tmask[:, None] & rmask[None, :], other=0.0)
    else:  # few tokens: sum the split-K partials PART [T, n_split, R + NI] of each real token row, then
        # a = bf16(silu(bf16(bf16(d) / n)))  (the reference: F.silu(F.linear(Hn, W_down) / n)); padded rows stay 0
        a = tl.zeros([BLOCK_T, R_P], dtype=tl.bfloat16)
        for t in range(0, T):
            blk = tl.load(PART + t * (n_split * RT) + offs_k[:, None] * RT + offs_r[None, :],
                          mask=kmask[:, None] & rmask[None, :], other=0.0, cache_modifier=".cg")
            a = tl.where(offs_t[:, None] == t, _down_act(tl.sum(blk, axis=0), inv_n)[None, :], a)
    g = _rbf(_dot(a, tl.trans(w)))  # [BLOCK_T, NS*BLOCK_D]
    gamma = _rbf(_sigmoid(g))
    if HN_READY:  # hk holds the Hn columns
        hn = hk
    else:  # Hn at these columns, exactly as stage A built it
        rstd = tl.load(RSTD + offs_t[:, None] * NS + (offs_i // BLOCK_D)[None, :], mask=tmask[:, None], other=0.0,
                       cache_modifier=".cg")
        hn = _rbf((hk * rstd) * (1.0 + nw)[None, :])
    prod = _rbf(gamma * hn)
    x = tl.sum(tl.reshape(prod, [BLOCK_T, NS, BLOCK_D]), axis=1) * inv_n
    offs_d = j0 + tl.arange(0, BLOCK_D)
    tl.store(X + offs_t[:, None] * stride_x + offs_d[None, :], x.to(tl.bfloat16),
             mask=tmask[:, None] & (offs_d < D)[None, :])
    if C_IN_KERNEL:
        if pid == 0:
            offs_c = tl.arange(0, NI_P)
            lmask = tmask[:, None] & (offs_c < NI)[None, :]
            lg = tl.zeros([BLOCK_T, NI_P], dtype=tl.float32)
            for t in range(0, T):
                blk = tl.load(PART + t * (n_split * RT) + offs_k[:, None] * RT + R + offs_c[None, :],
                              mask=kmask[:, None] & (offs_c < NI)[None, :], other=0.0, cache_modifier=".cg")
                lg = tl.where(offs_t[:, None] == t, tl.sum(blk, axis=0)[None, :], lg)
            tl.store(C + offs_t[:, None] * NI + offs_c[None, :], _inj_weight(lg, inv_n), mask=lmask)


@triton.jit(do_not_specialize=['T'])
def _hc_up_kernel(
    H, NW, WU, RSTD, PART, X, C,
    T, n_split, inv_n,
    stride_h, stride_x,
    R: tl.constexpr, NI: tl.constexpr, D: tl.constexpr, NS: tl.constexpr,
    R_P: tl.constexpr, NI_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, NSPLIT_P: tl.constexpr,
    PDL: tl.constexpr, A_READY: tl.constexpr, C_IN_KERNEL: tl.constexpr, HN_READY: tl.constexpr,
):
    pid = tl.program_id(0)
    w, hk, nw = _hc_up_load(H, NW, WU, T, stride_h, pid, R, D, NS, R_P, BLOCK_D, BLOCK_T, HN_READY)
    if PDL:  # launched early (programmatic dependent launch): wait for kernel A's results
        gdc_wait()
    _hc_up_finish(w, hk, nw, RSTD, PART, X, C, T, n_split, inv_n, stride_x, pid, R, NI, D, NS, R_P, NI_P, BLOCK_D,
                  BLOCK_T, NSPLIT_P, A_READY, C_IN_KERNEL, HN_READY)


@triton.jit
def _hc_finish_kernel(PART, A, C, n_split, stride_t, stride_s, inv_n, R: tl.constexpr, NI: tl.constexpr,
                      R_P: tl.constexpr, NI_P: tl.constexpr, NSPLIT_P: tl.constexpr, PDL: tl.constexpr):
    """Between stages A and B past IN_KERNEL_SILU_MAX_T tokens: one program per token sums its split-K partials
    PART [T, n_split, >= R + NI] (fp32; or n_split = 1 and bf16: the many-token path's one GEMM of W_down | W_inj,
    whose rows may carry padding columns past R + NI)
    once and writes a = bf16(silu(bf16(bf16(d) / n))) [T, R] for kernel B (A_READY) and
    c = 2 * bf16(sigmoid(bf16(bf16(W_inj Hn) / n))) [T, NI] -- the reference's rounding points, as kernel B does
    per program for few tokens (there, each of its programs re-reading every token's partials costs more than this
    launch once the tokens are many). With PDL it lets kernel B start at once (B loads W_up, then waits for this
    kernel), and waits for kernel A itself."""
    t = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs_k = tl.arange(0, NSPLIT_P)
    kmask = offs_k < n_split
    offs_r = tl.arange(0, R_P)
    rmask = offs_r < R
    blk = tl.load(PART + t * stride_t + offs_k[:, None] * stride_s + offs_r[None, :],
                  mask=kmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
    tl.store(A + t * R + offs_r, _down_act(tl.sum(blk, axis=0), inv_n), mask=rmask)
    if NI > 0:
        offs_c = tl.arange(0, NI_P)
        cmask = offs_c < NI
        blk = tl.load(PART + t * stride_t + offs_k[:, None] * stride_s + R + offs_c[None, :],
                      mask=kmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        tl.store(C + t * NI + offs_c, _inj_weight(tl.sum(blk, axis=0), inv_n), mask=cmask)


@triton.jit
def _hc_inject_kernel(H, Cc, Y, O, NS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NS * D
    s = offs // D
    h = tl.load(H + t * (NS * D) + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + t * D + offs % D, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(Cc + t * NS + s, mask=mask, other=0.0).to(tl.float32)
    cy = _rbf(y * c)
    tl.store(O + t * (NS * D) + offs, (h + cy).to(tl.bfloat16), mask=mask)


@triton.jit
def _hc_inject_norm_kernel(H, Cc, Y, NW, O, HN, eps, inv_d, NS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (token, stream): O = H + bf16(c_s * y) as ``_hc_inject_kernel``, then the grouped norm of the
    new stream (the bf16 values just stored) as ``_rms_norm_kernel``: HN = bf16((o * rstd) * (1 + w))."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    row = t * (NS * D) + s * D
    h = tl.load(H + row + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + t * D + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(NW + s * D + offs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(Cc + t * NS + s).to(tl.float32)
    o = _rbf(h + _rbf(y * c))
    tl.store(O + row + offs, o.to(tl.bfloat16), mask=mask)
    rstd = _rsqrt(tl.sum(o * o, axis=0) * inv_d + eps)
    tl.store(HN + row + offs, _rbf((o * rstd) * (1.0 + w)).to(tl.bfloat16), mask=mask)


@triton.jit
def _hc_gate_mean_kernel(G, HN, X, D, stride_g, stride_hn, stride_x, inv_n, NS: tl.constexpr, BLOCK: tl.constexpr):
    """x[t, j] = bf16(mean_s bf16(bf16(sigmoid(g[t, s*D + j])) * Hn[t, s*D + j])): the reference's sigmoid, product
    and stream mean (three passes over [T, nD]) in one pass, the same rounding points (as kernel B)."""
    t = tl.program_id(0).to(tl.int64)  # tokens on grid axis 0 (no 65,535 limit)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(NS):
        g = tl.load(G + t * stride_g + s * D + offs, mask=mask, other=0.0).to(tl.float32)
        hn = tl.load(HN + t * stride_hn + s * D + offs, mask=mask, other=0.0).to(tl.float32)
        gamma = _rbf(_sigmoid(g))
        acc += _rbf(gamma * hn)
    tl.store(X + t * stride_x + offs, _rbf(acc * inv_n).to(tl.bfloat16), mask=mask)


_ON_GPU = os.environ.get("TRITON_INTERPRET", "0") != "1"
USE_PDL = _ON_GPU  # programmatic dependent launch (Hopper+; the CPU interpreter has none): kernel B (and the finish
# kernel) start while the kernel before runs, B loading its W_up tile, then wait for its results
# launch shapes (chosen at the real widths, T = 1, by ``benchmarks/bench_ops.py --tune``; see docs/performance.md)
A_BLOCK_R = 64  # W_down rows per program of kernel A
A_WARPS = 8
A_KC_HN = 512  # kernel A's K chunk with Hn handed in (no norm loop: registers for the wider chunk)
B_BLOCK_D = 32  # output columns per program of kernel B ([n * B_BLOCK_D, r] W_up tile), up to IN_KERNEL_SILU_MAX_T
B_BLOCK_D_MANY = 32  # tokens, and past them (each program then reads the finished activations)
B_WARPS = 8
IN_KERNEL_SILU_MAX_T = 1  # up to this many tokens every program of kernel B finishes the down projection itself
# (sums the split-K partials, SiLU); past it the finish kernel does it once per token, between kernels A and B
# (chosen by bench_ops' hc_step cases; the figures: docs/performance.md, run 31)
GATE_MEAN_BLOCK = 1024  # columns per program of the many-token path's gate-mean kernel


def ticket_finish() -> bool:
    """QWEN4EXP_HC_DECODE=fused-ticket: kernel A finishes the down projection at every token count."""
    return envs.QWEN4EXP_HC_DECODE == "fused-ticket"


def silu_in_kernel_max_t() -> int:
    """Up to how many tokens kernel B's programs finish the down projection themselves (IN_KERNEL_SILU_MAX_T; 0 under
    QWEN4EXP_HC_DECODE=fused-ticket: kernel A finishes it)."""
    return 0 if ticket_finish() else IN_KERNEL_SILU_MAX_T


TICKET_TT = 4  # tokens per step of kernel A's ticket finish ([TT, n_split, BLOCK_R] fp32 partials a load)
_TICKETS: dict = {}  # device -> int32 counters of kernel A's ticket finish (zero between launches)


def _ticket_counters(dev, n: int):
    """The per-device counters of the ticket finish (one per row block of kernel A; always zero between
    launches: the last arriver of each block zeroes its own). Allocated on the first call outside a CUDA graph
    capture (a capture would own the memory); None inside a capture that finds none (the caller then takes the
    finish kernel). One buffer per device: launches on two streams at once would share it, which the decode path
    does not do (one stream, each kernel A launched after the previous mixer's kernels completed)."""
    buf = _TICKETS.get(dev)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_available() and dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _TICKETS[dev] = torch.zeros(max(n, 64), dtype=torch.int32, device=dev)
    return buf


def _split_for(D: int, NK: int, T: int = 1, hn_ready: bool = False) -> int:
    """K chunk (power of two dividing D): 512 for the real D = 2560 (256 past 16 tokens, for registers, unless Hn
    is handed in: A_KC_HN)."""
    top = A_KC_HN if hn_ready else (512 if T <= 16 else 256)
    for kc in (512, 256, 128, 64, 32, 16):
        if kc > top:
            continue
        if D % kc == 0:
            return kc
    return 0


LAUNCHED = Launches()  # the last launch of each kernel, under _registry.record() (registers / spills)


def hc_mix_triton(H, norm_weight, down, up, inj, n: int, eps: float, Hn=None, _stop_after_down: bool = False):
    """(x [..., D], c [..., n] or an empty [..., 0] when inj is None). ``Hn``: the streams' norm, when the caller
    has it (the kernels then read it in place of H and skip the norm)."""
    NK = H.shape[-1]
    D = NK // n
    R = down.shape[0]
    lead = H.shape[:-1]
    hn_ready = Hn is not None
    H2 = (H if Hn is None else Hn).reshape(-1, NK)  # what the kernels read: the streams, or their norm
    if H2.stride(-1) != 1:
        H2 = H2.contiguous()
    T = H2.shape[0]
    down, up, nw = down.contiguous(), up.contiguous(), norm_weight.contiguous()
    NI = 0 if inj is None else n
    wi = down if inj is None else inj.contiguous()
    KC = _split_for(D, NK, T, hn_ready)
    n_split = NK // KC
    BLOCK_T = max(16, triton.next_power_of_2(T))
    BLOCK_R = A_BLOCK_R
    dev = H.device
    part = torch.empty(T, n_split, R + NI, dtype=torch.float32, device=dev)
    rstd = part if hn_ready else torch.empty(T, n, dtype=torch.float32, device=dev)  # (with Hn: not touched)
    grid = (triton.cdiv(R, BLOCK_R) + (1 if NI else 0), n_split)
    # compile-time shapes: of both stages, of stage A, of stage B
    shapes = dict(R=R, NI=NI, D=D, NS=n, BLOCK_T=BLOCK_T)
    a_meta = dict(KC=KC, BLOCK_R=BLOCK_R, NORM_BLOCK=512 if T <= 16 else 256)
    b_meta = dict(R_P=triton.next_power_of_2(R), NI_P=max(2, triton.next_power_of_2(max(NI, 1))),
                  NSPLIT_P=triton.next_power_of_2(n_split))
    max_t = silu_in_kernel_max_t()
    a_ready = T > max_t  # the down projection finished before stage B: by kernel A (ticket) or the finish kernel
    cnt = _ticket_counters(dev, grid[0]) if ticket_finish() and not _stop_after_down else None
    ticket = cnt is not None
    x = torch.empty(T, D, dtype=H.dtype, device=dev)
    c_buf = x if a_ready else torch.empty(max(T * NI, 1), dtype=H.dtype, device=dev)  # never a null pointer
    c = None if a_ready else c_buf[: T * NI].view(T, NI)  # (a_ready: the finish kernel's, or kernel A's)
    a_buf = part  # (not written unless ticket)
    if ticket:
        a_buf = torch.empty(T, R, dtype=H.dtype, device=dev)
        c = torch.empty(T, NI, dtype=H.dtype, device=dev)
    LAUNCHED.keep("hc_down", _hc_down_kernel[grid](
        H2, nw, down, wi, rstd, part, a_buf, c if ticket and NI else a_buf, part if cnt is None else cnt,
        T, float(eps), 1.0 / D, 1.0 / n, H2.stride(0), **shapes, **a_meta,
        PDL=USE_PDL and not _stop_after_down, HN_READY=hn_ready, TICKET=ticket, NSPLIT_P=b_meta["NSPLIT_P"],
        TT=TICKET_TT, num_warps=A_WARPS))
    if _stop_after_down:  # (benchmark breakdown)
        return rstd, part
    if ticket:  # kernel A finished the down projection: stage B reads a [T, R]
        part = a_buf
    elif a_ready:  # finish the down projection once per token, in one launch
        part, c = hc_finish_triton(part, R, n, pdl=USE_PDL)
    BLOCK_D = B_BLOCK_D_MANY if T > IN_KERNEL_SILU_MAX_T or (a_ready and not ticket) else B_BLOCK_D
    LAUNCHED.keep("hc_up", _hc_up_kernel[(triton.cdiv(D, BLOCK_D),)](
        H2, nw, up, rstd, part, x, c_buf, T, n_split, 1.0 / n, H2.stride(0), x.stride(0), **shapes, **b_meta,
        BLOCK_D=BLOCK_D, PDL=USE_PDL, A_READY=a_ready, C_IN_KERNEL=(NI > 0) and not a_ready, HN_READY=hn_ready,
        num_warps=B_WARPS, launch_pdl=USE_PDL))
    return x.view(*lead, D), c.reshape(*lead, NI)


def hc_gate_mean_triton(g, Hn, n: int):
    """[T, n*D] gate pre-activations and normalised streams -> x [T, D] (``_hc_gate_mean_kernel``)."""
    T, NK = g.shape
    D = NK // n
    g, Hn = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, Hn))
    x = torch.empty(T, D, dtype=torch.bfloat16, device=g.device)
    if T:
        _hc_gate_mean_kernel[(T, triton.cdiv(D, GATE_MEAN_BLOCK))](
            g, Hn, x, D, g.stride(0), Hn.stride(0), x.stride(0), 1.0 / n, NS=n, BLOCK=GATE_MEAN_BLOCK, num_warps=4)
    return x


def hc_finish_triton(part, R: int, n: int, pdl: bool = False, ni: int | None = None):
    """``_hc_finish_kernel``, one program per token: split-K partials [T, n_split, R + NI] (fp32, kernel A's), or
    the many-token path's [T, R + NI (+ padding)] = bf16(Hn @ [W_down | W_inj (| pad)]^T) as one split (``ni``:
    NI when the rows are padded; default: all columns past R) ->
    a = bf16(silu(bf16(d[:, :R] / n))) [T, R], c = 2 * bf16(sigmoid(bf16(d[:, R:] / n))) [T, NI] (the reference's
    ops and rounding). ``pdl``: chained between kernels A and B by programmatic dependent launch."""
    if part.dim() == 2:
        part = part.unsqueeze(1)
    T, n_split, RT = part.shape
    NI = RT - R if ni is None else ni
    assert 0 <= NI <= RT - R, f"hc_finish: {NI} injection columns past R={R} in rows of {RT}"
    part = part if part.stride(-1) == 1 else part.contiguous()
    a = torch.empty(T, R, dtype=torch.bfloat16, device=part.device)
    c = torch.empty(T, NI, dtype=torch.bfloat16, device=part.device)
    if T:
        LAUNCHED.keep("hc_finish", _hc_finish_kernel[(T,)](
            part, a, c if NI else a, n_split, part.stride(0), part.stride(1), 1.0 / n, R=R, NI=NI,
            R_P=triton.next_power_of_2(R), NI_P=max(2, triton.next_power_of_2(max(NI, 1))),
            NSPLIT_P=triton.next_power_of_2(n_split), PDL=pdl, num_warps=8 if n_split > 1 else 4, launch_pdl=pdl))
    return a, c


def hc_inject_norm_triton(H, c, y, norm_weight, n: int, eps: float):
    """``_hc_inject_norm_kernel``: (H + c (x) y, its grouped norm), one program per (token, stream)."""
    D = y.shape[-1]
    H2, c2, y2 = H.reshape(-1, n * D).contiguous(), c.reshape(-1, n).contiguous(), y.reshape(-1, D).contiguous()
    T = H2.shape[0]
    out, hn = torch.empty_like(H2), torch.empty_like(H2)
    if T:
        BLOCK = triton.next_power_of_2(D)
        _hc_inject_norm_kernel[(T, n)](H2, c2, y2, norm_weight.contiguous(), out, hn, float(eps), 1.0 / D, NS=n, D=D,
                                       BLOCK=BLOCK, num_warps=min(8, max(1, BLOCK // 512)))
    return out.view(H.shape), hn.view(H.shape)


def hc_inject_triton(H, c, y):
    n, D = c.shape[-1], y.shape[-1]
    H2, c2, y2 = H.reshape(-1, n * D).contiguous(), c.reshape(-1, n).contiguous(), y.reshape(-1, D).contiguous()
    T = H2.shape[0]
    out = torch.empty_like(H2)
    if T:
        BLOCK = 2048  # elements of one token's streams per program
        _hc_inject_kernel[(triton.cdiv(n * D, BLOCK), T)](H2, c2, y2, out, NS=n, D=D, BLOCK=BLOCK, num_warps=4)
    return out.view(H.shape)
