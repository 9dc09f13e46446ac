"""Triton kernels for PLE: the n-gram row gather with fused FP8 -> bf16 dequantisation, and the decode-time mix
into the streams. Imported only on the CUDA path.

The table may live in GPU memory or in page-locked (pinned) host memory: pinned host memory is mapped into the GPU's
unified address space, so the kernel reads the rows straight over the bus (UVA) without a staging copy; only the
T * G rows it needs cross it.  One program per (token, group of heads); each head row is d_g contiguous elements.
Rounding as the reference: bf16(float(row) * float(scale)); without a scale the rows are copied (cast to
``out_dtype`` if given).

The mix (``reference.ple_mix`` for one token per sequence): query norm, key dot product, gate, value scaling, conv
norm, the dilated depthwise conv against the carried state, SiLU and the sum, with the new state, in ONE launch; the
reference is ~35 torch launches at decode sizes.

What each kernel covers: ``host``; the custom operators and wrappers: ``cuda``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..triton_utils import round_bf16 as _rbf
from ..triton_utils import rsqrt as _rsqrt
from ..triton_utils import sigmoid as _sigmoid
from ..triton_utils import silu as _silu
from .host import out_dtype_of


@triton.jit
def _gather_rows(TAB, row, hmask, offs_h, SCALE, scale_val, OUT_T, stride_tab, SCALE_MODE: tl.constexpr,
                 DG: tl.constexpr, DG_P: tl.constexpr):
    """Table rows ``row`` [HB] -> OUT_T[h * DG ..] (one token's output row), dequantised by the scale."""
    offs_d = tl.arange(0, DG_P)
    m2 = hmask[:, None] & (offs_d < DG)[None, :]
    x = tl.load(TAB + row[:, None] * stride_tab + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
    if SCALE_MODE == 1:  # scale tensor on the GPU
        x = x * tl.load(SCALE).to(tl.float32)
    elif SCALE_MODE == 2:  # scale held on the host: passed by value
        x = x * scale_val
    tl.store(OUT_T + offs_h[:, None] * DG + offs_d[None, :], x.to(OUT_T.dtype.element_ty), mask=m2)


@triton.jit
def _ple_gather_kernel(TAB, ROWS, SCALE, scale_val, OUT, n_heads, stride_tab, stride_rows_t, stride_out_t,
                       SCALE_MODE: tl.constexpr, DG: tl.constexpr, DG_P: tl.constexpr, HB: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    offs_h = hb * HB + tl.arange(0, HB)
    hmask = offs_h < n_heads
    row = tl.load(ROWS + t * stride_rows_t + offs_h, mask=hmask, other=0).to(tl.int64)
    _gather_rows(TAB, row, hmask, offs_h, SCALE, scale_val, OUT + t * stride_out_t, stride_tab, SCALE_MODE, DG, DG_P)


@triton.jit
def _ngram_gather_decode_kernel(IDS, PREV, MUL, HSZ, HOFF, TAB, SCALE, scale_val, OUT, NEXT, eos, n_heads,
                                stride_prev, stride_next, stride_tab, stride_out_t, C: tl.constexpr,
                                C_P: tl.constexpr, HPN: tl.constexpr, SCALE_MODE: tl.constexpr, DG: tl.constexpr,
                                DG_P: tl.constexpr, HB: tl.constexpr):
    """Decode, one program per (token, block of HB heads): the token's n-gram context (``ngram_context_decode``:
    T_k = the id k back unless an EOS sits among the k ids back, then EOS), the hashed rows of its heads
    (``ngram_ids``: m_o = XOR_{k<o} T_k mu_k, row = m_o mod size_g + offset_g) and their gather; block 0 also
    writes the next context (prev shifted by one, the id last)."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cur = tl.load(IDS + t).to(tl.int64)
    offs_c = tl.arange(0, C_P)  # context columns, oldest first: column j is the id C - j back
    cm = offs_c < C
    prev = tl.load(PREV + t * stride_prev + offs_c, mask=cm, other=0).to(tl.int64)
    last_eos = tl.max(tl.where(cm & (prev == eos), offs_c, -1), axis=0)
    ctx = tl.where(last_eos >= offs_c, eos, prev)  # an EOS at or after column j cuts column j off
    offs_h = hb * HB + tl.arange(0, HB)
    hmask = offs_h < n_heads
    mixed = cur * tl.load(MUL).to(tl.int64)
    mix_h = tl.zeros([HB], dtype=tl.int64)
    for k in tl.static_range(1, C + 1):  # order k + 1
        tk = tl.sum(tl.where(offs_c == C - k, ctx, 0), axis=0)
        mixed = mixed ^ (tk * tl.load(MUL + k).to(tl.int64))
        mix_h = tl.where(offs_h // HPN == k - 1, mixed, mix_h)
    size = tl.load(HSZ + offs_h, mask=hmask, other=1).to(tl.int64)
    row = mix_h % size + tl.load(HOFF + offs_h, mask=hmask, other=0).to(tl.int64)
    row = tl.where(row < 0, row + size, row)  # (a floor remainder, as torch.remainder; m_o >= 0 in practice)
    _gather_rows(TAB, row, hmask, offs_h, SCALE, scale_val, OUT + t * stride_out_t, stride_tab, SCALE_MODE, DG, DG_P)
    if hb == 0:
        nxt = tl.load(PREV + t * stride_prev + offs_c + 1, mask=offs_c < C - 1, other=0).to(tl.int64)
        nxt = tl.where(offs_c == C - 1, cur, nxt)
        tl.store(NEXT + t * stride_next + offs_c, nxt.to(NEXT.dtype.element_ty), mask=cm)


def _scale_args(scale, dummy):
    """(SCALE_MODE, scale pointer, scale value): none, a GPU tensor, or a host scalar passed by value (read here:
    no device sync)."""
    if scale is None:
        return 0, dummy, 1.0
    if scale.is_cuda:
        return 1, scale.reshape(1), 1.0
    return 2, dummy, float(scale.float().reshape(()))


def ngram_lookup_decode_triton(ids, prev, eos, multipliers, head_sizes, head_offsets, heads_per_ngram, table,
                               scale=None, out_dtype=None):
    """``reference.ngram_lookup_decode`` in one launch -> (embeddings [N, G * d_g], next context [N, n-1])."""
    N, C = prev.shape
    G = head_sizes.numel()
    if G != C * heads_per_ngram or multipliers.numel() != C + 1:
        raise ValueError(f"ngram_lookup_decode: {G} heads, {multipliers.numel()} multipliers for a context of {C} "
                         f"ids and {heads_per_ngram} heads per n-gram")
    dt = out_dtype_of(table, scale, out_dtype)
    DG = table.shape[1]
    out = torch.empty(N, G * DG, dtype=dt, device=ids.device)
    nxt = torch.empty_like(prev)
    mode, sc, sval = _scale_args(scale, out)
    if N and G:
        HB = min(16, triton.next_power_of_2(G))
        _ngram_gather_decode_kernel[(N, triton.cdiv(G, HB))](
            ids, prev, multipliers, head_sizes, head_offsets, table, sc, sval, out, nxt, int(eos), G, prev.stride(0),
            nxt.stride(0), table.stride(0), out.stride(0), C=C, C_P=triton.next_power_of_2(C), HPN=heads_per_ngram,
            SCALE_MODE=mode, DG=DG, DG_P=triton.next_power_of_2(DG), HB=HB, num_warps=4)
    return out, nxt


def ple_lookup_triton(table, rows, scale=None, out_dtype=None):
    """[..., G] row ids -> [..., G * d_g]; ``table`` on the GPU or pinned on the host (read through UVA)."""
    dt = out_dtype_of(table, scale, out_dtype)
    G = rows.shape[-1]
    DG = table.shape[1]
    rows2 = rows.reshape(-1, G)
    if rows2.stride(-1) != 1:
        rows2 = rows2.contiguous()
    T = rows2.shape[0]
    out = torch.empty(T, G * DG, dtype=dt, device=rows.device)
    mode, sc, sval = _scale_args(scale, out)
    if T and G:
        HB = min(16, triton.next_power_of_2(G))
        _ple_gather_kernel[(T, triton.cdiv(G, HB))](
            table, rows2, sc, sval, out, G, table.stride(0), rows2.stride(0), out.stride(0),
            SCALE_MODE=mode, DG=DG, DG_P=triton.next_power_of_2(DG), HB=HB, num_warps=4)
    return out.view(*rows.shape[:-1], G * DG)


# ------------------------------------------------------------------------------------------------- the decode mix
# Launch settings (the chosen values: the fastest of the shapes swept at the real widths, 1 and 32 tokens;
# docs/performance.md has the measurements)
MIX_BLOCK_C = 128  # channels of one stream per block (the conv state block is [MIX_BLOCK_C, S] in registers)
MIX_BLOCK_R = 1024  # columns per step of the reductions over a stream's D
MIX_WARPS = 4
MIX_PROGRAMS = 264  # about this many programs (at least one per (token, stream), at most one per channel block)


@triton.jit(do_not_specialize=['CPP'])
def _ple_mix_decode_kernel(H, KEY, VAL, QW, CW, WC, STATE, OUT, NEW,
                           stride_h, stride_k, stride_v, stride_sn, stride_sc, stride_o, stride_nn, stride_nc,
                           eps, inv_d, sqrt_d, CPP,
                           D: tl.constexpr, KS: tl.constexpr, S: tl.constexpr, S_P: tl.constexpr,
                           DIL: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program per (token, stream, range of CPP blocks of BLOCK_C channels). Every program of a (token, stream)
    computes the stream's three reductions (query RMS, key dot product, RMS of the gated values) BLOCK_R columns at
    a time, reading its 4 rows of D through L2, then loops over its channel blocks' conv. (Run 10: a first version
    holding whole rows in registers, 4 warps: 255 registers + 136 B spilled, 36 us for 32 tokens. Run 11: one
    channel block a program, 170 registers, no spills, still 33 us in the engine at 32 tokens: 640 programs of 8
    warps, one resident an SM, five waves of the serial reductions, each redone by 5 programs of a (token, stream).
    Now the launcher sizes the channel ranges so that about ``MIX_PROGRAMS`` programs run.)
    The reference's rounding points: each torch op rounds to bf16."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    cb = tl.program_id(2)
    offs = tl.arange(0, BLOCK_R)
    Hs = H + t * stride_h + s * D
    ss = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in tl.range(0, D, BLOCK_R):
        h = tl.load(Hs + c0 + offs, mask=c0 + offs < D, other=0.0).to(tl.float32)
        ss += h * h
    rstd = _rsqrt(tl.sum(ss, axis=0) * inv_d + eps)
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in tl.range(0, D, BLOCK_R):
        m = c0 + offs < D
        h = tl.load(Hs + c0 + offs, mask=m, other=0.0).to(tl.float32)
        qw = tl.load(QW + s * D + c0 + offs, mask=m, other=0.0).to(tl.float32)
        k = tl.load(KEY + t * stride_k + s * D + c0 + offs, mask=m, other=0.0).to(tl.float32)
        dot += _rbf(k * _rbf((h * rstd) * (1.0 + qw)))
    d = _rbf(tl.div_rn(_rbf(tl.sum(dot, axis=0)), sqrt_d))
    a = _rbf(tl.sqrt_rn(tl.maximum(tl.abs(d), 1e-6)))
    d = tl.where(d > 0, a, tl.where(d < 0, -a, 0.0))
    g = _rbf(_sigmoid(d))
    ssu = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in tl.range(0, D, BLOCK_R):
        u = _rbf(g * tl.load(VAL + t * stride_v + c0 + offs, mask=c0 + offs < D, other=0.0).to(tl.float32))
        ssu += u * u
    rstd_u = _rsqrt(tl.sum(ssu, axis=0) * inv_d + eps)
    for cbi in range(cb * CPP, cb * CPP + CPP):  # this program's channel blocks
        _ple_mix_channels(VAL, CW, WC, STATE, OUT, NEW, t, s, cbi, g, rstd_u, stride_v, stride_sn, stride_sc,
                          stride_o, stride_nn, stride_nc, D, KS, S, S_P, DIL, BLOCK_C)


@triton.jit
def _ple_mix_channels(VAL, CW, WC, STATE, OUT, NEW, t, s, cb, g, rstd_u, stride_v, stride_sn, stride_sc, stride_o,
                      stride_nn, stride_nc, D: tl.constexpr, KS: tl.constexpr, S: tl.constexpr, S_P: tl.constexpr,
                      DIL: tl.constexpr, BLOCK_C: tl.constexpr):
    """Channels cb * BLOCK_C .. of stream s of token t: the normed gated value, its dilated conv over the state,
    SiLU, the output and the shifted state (blocks past D: all masked)."""
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offs_c < D
    ch = s * D + offs_c
    uc = _rbf(g * tl.load(VAL + t * stride_v + offs_c, mask=mc, other=0.0).to(tl.float32))
    un = _rbf((uc * rstd_u) * (1.0 + tl.load(CW + ch, mask=mc, other=0.0).to(tl.float32)))
    offs_j = tl.arange(0, S_P)
    st_ptr = STATE + t * stride_sn + ch[:, None] * stride_sc + offs_j[None, :]
    hist = tl.load(st_ptr, mask=mc[:, None] & (offs_j < S)[None, :], other=0.0)
    hist = hist.to(WC.dtype.element_ty).to(tl.float32)  # (the reference casts the state to the weight's dtype)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KS):  # tap j reads history sample j * DIL: the state's, or (the last tap) the new input
        w = tl.load(WC + ch * KS + j, mask=mc, other=0.0).to(tl.float32)
        if j * DIL < S:
            x = tl.sum(tl.where(offs_j[None, :] == j * DIL, hist, 0.0), axis=1)
        else:
            x = un
        acc += x * w
    y = _rbf(acc)
    z = _rbf(_silu(y))
    tl.store(OUT + t * stride_o + ch, _rbf(uc + z).to(OUT.dtype.element_ty), mask=mc)
    # the new state: the history shifted by one, the new input last
    nxt = tl.load(st_ptr + 1, mask=mc[:, None] & (offs_j < S - 1)[None, :], other=0.0)
    nxt = tl.where(offs_j[None, :] == S - 1, un[:, None], nxt.to(WC.dtype.element_ty).to(tl.float32))
    tl.store(NEW + t * stride_nn + ch[:, None] * stride_nc + offs_j[None, :], nxt.to(NEW.dtype.element_ty),
             mask=mc[:, None] & (offs_j < S)[None, :])


def ple_mix_decode_triton(H, k, v, qw, cw, wc, state, n: int, eps: float, dilation: int):
    """``reference.ple_mix`` for one token per sequence -> (PLE(H) [T, nD], new conv state [T, nD, S] in the conv
    weight's dtype)."""
    T, nD = H.shape
    D, KS, S = nD // n, wc.shape[1], state.shape[2]
    if S != (KS - 1) * dilation:
        raise ValueError(f"ple_mix: conv state holds {S} samples, kernel {KS} x dilation {dilation} needs "
                         f"{(KS - 1) * dilation}")
    out = torch.empty(T, nD, dtype=H.dtype, device=H.device)
    new = torch.empty(T, nD, S, dtype=wc.dtype, device=H.device)
    if T:
        BLOCK_C = min(MIX_BLOCK_C, triton.next_power_of_2(D))
        n_cb = triton.cdiv(D, BLOCK_C)
        cpp = triton.cdiv(n_cb, min(n_cb, max(1, triton.cdiv(MIX_PROGRAMS, T * n))))  # channel blocks a program
        _ple_mix_decode_kernel[(T, n, triton.cdiv(n_cb, cpp))](
            H, k, v, qw, cw, wc, state, out, new, H.stride(0), k.stride(0), v.stride(0), state.stride(0),
            state.stride(1), out.stride(0), new.stride(0), new.stride(1), float(eps), 1.0 / D, math.sqrt(D), cpp,
            D=D, KS=KS, S=S, S_P=triton.next_power_of_2(S), DIL=dilation, BLOCK_C=BLOCK_C,
            BLOCK_R=min(MIX_BLOCK_R, triton.next_power_of_2(D)), num_warps=MIX_WARPS)
    return out, new
