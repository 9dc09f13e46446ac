"""QSA cache writes on the GPU: K|V rows at vLLM's slot mapping (``write_paged_triton``), and a decode step's index
update (``index_update_triton``: each token's raw indexer key into its page's ring, and the key of the block it
completes, mean-pooled from the ring, normed and rotated, into the block's key row; layout: ``layout``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import round_bf16 as _rbf
from ..triton_utils import rsqrt as _rsqrt
from . import launch


@triton.jit
def _write_paged_kernel(KV, SLOTS, K, V, stride_kvb, stride_kvh, stride_kvl, stride_kt, stride_kh, stride_vt,
                        stride_vh, HD: tl.constexpr, BS: tl.constexpr, HD_P: tl.constexpr, FMAX: tl.constexpr,
                        SAT: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(SLOTS + i).to(tl.int64)
    o = tl.arange(0, HD_P)
    m = (o < HD) & (slot >= 0)  # padding (slot < 0): nothing stored
    slot = tl.maximum(slot, 0)
    row = KV + (slot // BS) * stride_kvb + h * stride_kvh + (slot % BS) * stride_kvl
    k = tl.load(K + i * stride_kt + h * stride_kh + o, mask=m, other=0.0).to(tl.float32)
    v = tl.load(V + i * stride_vt + h * stride_vh + o, mask=m, other=0.0).to(tl.float32)
    if SAT:
        k = tl.minimum(tl.maximum(k, -FMAX), FMAX)
        v = tl.minimum(tl.maximum(v, -FMAX), FMAX)
    tl.store(row + o, k.to(KV.dtype.element_ty), mask=m)
    tl.store(row + HD + o, v.to(KV.dtype.element_ty), mask=m)


def write_paged_triton(kv, slots, k, v) -> None:
    N, H, HD = k.shape
    if N:
        _write_paged_kernel[(N, H)](kv, slots, k, v, kv.stride(0), kv.stride(1), kv.stride(2), k.stride(0),
                                    k.stride(1), v.stride(0), v.stride(1), HD=HD, BS=kv.shape[2],
                                    HD_P=triton.next_power_of_2(HD), FMAX=0.0, SAT=False, num_warps=1)


@triton.jit
def _block_mean_seg(RING, RAW, b, pos, ok, offs, m, stride_raw, stride_rl, RR: tl.constexpr, R: tl.constexpr, Q):
    """fp32 mean of the raw keys of tokens pos-R+1 .. pos at columns ``offs`` (the last from RAW, the rest from
    the page's ring ``RING``: position p at row p % RR), rounded to bf16 (``block_mean``). Q queries a request
    (rows b - b % Q .. of one request at consecutive positions): a key of this step's earlier rows comes from RAW,
    rounded to the ring's dtype as the ring would hold it (no program sees another's ring write)."""
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    q_i = b % Q  # this row's query index in its request: the j <= q_i earlier keys are this step's
    for j in tl.static_range(R - 1, 0, -1):  # oldest first
        p = tl.maximum(pos - j, 0)
        mine = j <= q_i
        x_ring = tl.load(RING + (p % RR) * stride_rl + offs, mask=m & ok & (j > q_i), other=0.0)
        x_raw = tl.load(RAW + tl.maximum(b - j, 0) * stride_raw + offs, mask=m & ok & mine, other=0.0)
        x_raw = x_raw.to(RING.dtype.element_ty)
        acc += tl.where(mine, x_raw.to(tl.float32), x_ring.to(tl.float32))
    acc += tl.load(RAW + b * stride_raw + offs, mask=m, other=0.0).to(tl.float32)
    return _rbf(acc / R)


@triton.jit(do_not_specialize=['Q'], do_not_specialize_on_alignment=launch.ROW_VIEWS)  # (one variant for any Q)
def _index_update_kernel(IKV, RING, SLOTS, POS, VALID, RAW, NW, COS, SIN, eps,
                         stride_kvb, stride_kvl, stride_rb, stride_rl, stride_raw, stride_c,
                         KV, K, V, stride_mb, stride_mh, stride_ml, stride_kt, stride_kh, stride_vt, stride_vh,
                         DI: tl.constexpr, RD: tl.constexpr, R: tl.constexpr, IBS: tl.constexpr, RR: tl.constexpr,
                         H_P: tl.constexpr, P_P: tl.constexpr, KV_WRITE: tl.constexpr = False, HKV: tl.constexpr = 1,
                         HD: tl.constexpr = 1, HD_P: tl.constexpr = 1, Q=1):
    """One program per token: its raw key into its page's ring (row pos % RR); when it completes a block, the
    block's key (mean, zero-centred RMSNorm, RoPE on the first RD dims, each rounded to bf16 where the reference
    rounds) into the block's key row (row ``slot % IBS`` of the ``index_kv`` view, columns [DI, 2 DI)); nothing
    there otherwise (the view's other rows overlap other blocks' keys). The row is split into the two rotated
    halves and the pass-through part, so RoPE needs no shuffle. Q > 1: Q queries a request (MTP verification),
    its earlier rows' keys read from RAW (``_block_mean_seg``), so the ring needs no write before this launch."""
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + b).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int64)
    real = slot >= 0
    ok = real & (tl.load(VALID + b) != 0) & ((pos + 1) % R == 0)
    page = tl.maximum(slot, 0) // IBS
    ring = RING + page * stride_rb
    row = IKV + page * stride_kvb + (tl.maximum(slot, 0) % IBS) * stride_kvl
    HALF: tl.constexpr = RD // 2
    o1 = tl.arange(0, H_P)
    m1 = o1 < HALF
    o3 = RD + tl.arange(0, P_P)
    m3 = o3 < DI
    # block key (the ring's earlier rows: not this token's own row, written below)
    x1 = _block_mean_seg(ring, RAW, b, pos, ok, o1, m1, stride_raw, stride_rl, RR, R, Q)
    x2 = _block_mean_seg(ring, RAW, b, pos, ok, HALF + o1, m1, stride_raw, stride_rl, RR, R, Q)
    x3 = _block_mean_seg(ring, RAW, b, pos, ok, o3, m3, stride_raw, stride_rl, RR, R, Q)
    # raw key -> the ring
    own = ring + (pos % RR) * stride_rl
    tl.store(own + o1, tl.load(RAW + b * stride_raw + o1, mask=m1, other=0.0), mask=m1 & real)
    tl.store(own + HALF + o1, tl.load(RAW + b * stride_raw + HALF + o1, mask=m1, other=0.0), mask=m1 & real)
    tl.store(own + o3, tl.load(RAW + b * stride_raw + o3, mask=m3, other=0.0), mask=m3 & real)
    ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0) + tl.sum(x3 * x3, axis=0)
    rstd = _rsqrt(ss / DI + eps)
    y1 = _rbf((x1 * rstd) * (1.0 + tl.load(NW + o1, mask=m1, other=0.0).to(tl.float32)))
    y2 = _rbf((x2 * rstd) * (1.0 + tl.load(NW + HALF + o1, mask=m1, other=0.0).to(tl.float32)))
    y3 = _rbf((x3 * rstd) * (1.0 + tl.load(NW + o3, mask=m3, other=0.0).to(tl.float32)))
    c1 = tl.load(COS + b * stride_c + o1, mask=m1, other=0.0).to(tl.float32)
    c2 = tl.load(COS + b * stride_c + HALF + o1, mask=m1, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + b * stride_c + o1, mask=m1, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + b * stride_c + HALF + o1, mask=m1, other=0.0).to(tl.float32)
    k1 = _rbf(_rbf(y1 * c1) + _rbf(-y2 * s1))
    k2 = _rbf(_rbf(y2 * c2) + _rbf(y1 * s2))
    tl.store(row + DI + o1, k1.to(IKV.dtype.element_ty), mask=m1 & ok)
    tl.store(row + DI + HALF + o1, k2.to(IKV.dtype.element_ty), mask=m1 & ok)
    tl.store(row + DI + o3, y3.to(IKV.dtype.element_ty), mask=m3 & ok)
    if KV_WRITE:  # the token's K|V rows too (``write_paged``'s work for a decode step: one launch fewer)
        od = tl.arange(0, HD_P)
        md = (od < HD) & real
        kvrow = KV + page * stride_mb + (tl.maximum(slot, 0) % IBS) * stride_ml
        for h in tl.static_range(HKV):
            kk = tl.load(K + b * stride_kt + h * stride_kh + od, mask=md, other=0.0)
            vv = tl.load(V + b * stride_vt + h * stride_vh + od, mask=md, other=0.0)
            tl.store(kvrow + h * stride_mh + od, kk.to(KV.dtype.element_ty), mask=md)
            tl.store(kvrow + h * stride_mh + HD + od, vv.to(KV.dtype.element_ty), mask=md)


def index_update_triton(index_kv, ring, slots, pos, valid, raw, norm_weight, eps, cos, sin, r: int, kv=None, k=None,
                        v=None, nq: int = 1) -> None:
    """``kv``, ``k``, ``v`` (a decode step's K|V rows, ``write_paged``'s arguments): written by the same launch.
    ``nq`` > 1: rows are requests' ``nq`` consecutive tokens (an MTP verification), read from ``raw`` by the
    rows after them (without it the caller writes the ring first)."""
    B, di = raw.shape
    RD = cos.shape[-1]
    if B:
        if kv is None:
            kvw = (raw, raw, raw, 0, 0, 0, 0, 0, 0, 0)  # (not read: KV_WRITE off)
            extra = {}
        else:
            kvw = (kv, k, v, kv.stride(0), kv.stride(1), kv.stride(2), k.stride(0), k.stride(1), v.stride(0),
                   v.stride(1))
            extra = dict(KV_WRITE=True, HKV=k.shape[1], HD=k.shape[2], HD_P=triton.next_power_of_2(k.shape[2]))
        _index_update_kernel[(B,)](
            index_kv, ring, slots, pos, valid, raw, norm_weight, cos, sin, float(eps),
            index_kv.stride(0), index_kv.stride(2), ring.stride(0), ring.stride(2), raw.stride(0), cos.stride(0),
            *kvw, DI=di, RD=RD, R=r, IBS=index_kv.shape[2], RR=ring.shape[2], H_P=triton.next_power_of_2(RD // 2),
            P_P=triton.next_power_of_2(max(di - RD, 1)), Q=nq, **extra,
            num_warps=1 if di <= 256 and kv is None else 4)
