"""The Triton kernels checked without a GPU (run by ``tests/test_triton_offline.py`` in CI, where no GPU exists):

  TRITON_INTERPRET=1 python tests/triton_offline.py run LAUNCHES.json
      each kernel wrapper (``*_triton``) against its torch reference on small random inputs, and the HC mixer and
      the QSA decode / prefill ops once at the real model widths, under Triton's CPU interpreter (every program of
      every grid, sequentially); the kernels' launches (argument types, compile-time constants, warps) are written
      to LAUNCHES.json
  python tests/triton_offline.py compile LAUNCHES.json
      every distinct recorded launch compiled ahead of time for Hopper (sm_90: Triton's front end, its GPU passes,
      LLVM and ptxas to a cubin), the GPU build of each kernel (libdevice math, bf16 dots), not the interpreter's;
      each within Hopper's shared memory per program; QSA kernels not specialised on row-view alignment.

Needs Triton importable (``make test`` installs the GPU image's version, 3.6.0, beside the venv, which keeps vLLM's
CPU build free of Triton). The interpreter rounds fp32 -> bf16 stores by truncation; the kernels round explicitly
where it matters (``ops/triton_utils.round_bf16``), so the tolerances are the GPU tests' (``test_gpu_kernels.py``).
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BF = torch.bfloat16
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
         torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
         torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
OPTIONS = ("num_warps", "num_stages")
SMEM_MAX = 232448  # shared memory one program may use on Hopper (227 KiB): more fails at launch, not at compile


def close(got, want, atol, what, rtol=0.0):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    err = (got.float() - want.float()).abs()
    bad = err > atol + rtol * want.float().abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max abs err {err.max().item()}"


# ------------------------------------------------------------------------------------------------------ checks
def check_qsa_topk():
    from qwen4exp.ops.qsa import reference as ref, triton_kernel as tk
    torch.manual_seed(0)
    m = 16
    saved = tk.TOPK_SMALL, tk.TOPK_SMALL_BITS, tk.TOPK_SPLIT, tk.TOPK_SPLIT_BITS
    cases = ((10, 3, False), (17, 2, True), (300, 4, False), (300, 4, True), (2049, 2, True),
             (300, 3, "narrow"), (300, 3, "bf16"), (300, 3, "equal"), (40, 2, "none"),
             (5000, 1, False), (9000, 1, "bf16"))  # (the 4096 / 8192 / 16384-key variants too)
    for Nb, Tq, ties in cases:
        sc = torch.randn(Tq, Nb)
        if ties is True:
            sc = sc.round().clamp(min=0)  # many exact ties (zeros and small integers)
        elif ties == "narrow":  # all in [1, 2): sign and exponent bits shared (the search starts past them)
            sc = torch.rand(Tq, Nb) + 1.0
        elif ties == "bf16":  # bf16 values: the low 16 bits shared by every key (the search stops above them)
            sc = (torch.rand(Tq, Nb) * 3).to(torch.bfloat16).float()
        elif ties == "equal":  # every key the same score: the ids decide
            sc = torch.full((Tq, Nb), 0.75)
        nc = torch.randint(0, Nb + 1, (Tq,))
        nc[0] = Nb
        if ties == "none":  # no visible block at all (nothing selected)
            nc[:] = 0
        keys = ref._order_keys(sc, torch.arange(Nb)[None] < nc[:, None])
        want = ref.select_blocks(sc, nc, m)
        # the split select (TOPK_SPLIT: chunks of keys, then their candidates) at a small chunk too (many chunks)
        for (small, bits), split in [(v, 0) for v in tk.TOPK_SELECTS] + [((True, 0), 256), ((True, 0), 4096),
                                                                         ((True, 2), 256), ((True, 8), 512)]:
            tk.TOPK_SMALL, tk.TOPK_SMALL_BITS, tk.TOPK_SPLIT, tk.TOPK_SPLIT_BITS = small, bits, split, bits
            got = tk.top_ids(keys, m)
            for t in range(Tq):
                a = [x for x in got[t].tolist() if x >= 0]
                b = sorted(x for x in want[t].tolist() if x >= 0)
                assert a == b and (got[t] >= 0).sum() == (want[t] >= 0).sum(), (Nb, ties, small, bits, split, t)
    tk.TOPK_SMALL, tk.TOPK_SMALL_BITS, tk.TOPK_SPLIT, tk.TOPK_SPLIT_BITS = saved


def _paged(lens, seed, shared_table):
    from test_ops import paged_qsa_case, qsa_inputs
    seqs = [[t.to(BF) for t in qsa_inputs(L, Hq=6, Hkv=2, d=64, hi=4, di=32, seed=seed + i)]
            for i, L in enumerate(lens)]
    return seqs, paged_qsa_case(seqs, lens, 4, 16, 16 if shared_table else 64, shared_table=shared_table)


def check_qsa_decode():
    from qwen4exp.ops.qsa import reference as ref, triton_kernel as tk
    r, budget = 4, 32
    lens = [1, 9, 37, 150, 203]
    seqs, (kv, bt, ikv, ibt) = _paged(lens, 700, False)
    pos = torch.tensor(lens) - 1
    q, iq = torch.stack([s[0][-1] for s in seqs]), torch.stack([s[3][-1] for s in seqs])
    want = ref.qsa_decode_paged(q, pos, iq, kv, bt, ikv, ibt, 60, r, budget, 0.3, 0.4)
    names = ("ATTN_SLOT_BLOCK", "ATTN_PROGRAMS", "ATTN_PREFETCH", "ATTN_PREFETCH_MANY", "ATTN_MANY_QUERIES",
             "ATTN_SLOT_BLOCK_MANY", "ATTN_K_T", "ATTN_K_T_MANY")
    saved = {k: getattr(tk, k) for k in names}
    try:  # slot ranges of one chunk, of all 3 chunks, of 2 + 1 (an uneven last range); rows looked up ahead or not;
        # the few-query and the many-query settings; K loaded transposed or not
        n4 = 4 * len(lens)
        for sb, programs, prefetch, many, kt in ((64, 512, True, 99, False), (16, 10 ** 6, True, 99, False),
                                                 (16, 1, True, 99, True), (16, n4, True, 99, False),
                                                 (16, n4, False, 99, True), (16, 10 ** 6, False, 99, False),
                                                 (64, n4, True, 1, False), (16, n4, True, 1, True)):
            tk.ATTN_SLOT_BLOCK = tk.ATTN_SLOT_BLOCK_MANY = sb
            tk.ATTN_PROGRAMS, tk.ATTN_MANY_QUERIES = programs, many
            tk.ATTN_PREFETCH = tk.ATTN_PREFETCH_MANY = prefetch
            tk.ATTN_K_T = tk.ATTN_K_T_MANY = kt
            got = tk.qsa_decode_paged_triton(q, pos, iq, kv, bt, ikv, ibt, 60, r, budget, 0.3, 0.4)
            close(got, want, 0.05, f"decode paged SB={sb} programs={programs} prefetch={prefetch} many>={many} "
                                   f"kt={kt}")
    finally:
        for k, v in saved.items():
            setattr(tk, k, v)
    # the scores as fp32 logits (what vLLM's select reads) are the sort keys' scores; the same launch writes each
    # query's visible block count (n_complete, capped at the table's blocks: 60 here, 51 for the longest)
    for nb in (60, 40):
        keys = tk.paged_score_keys(pos, iq, ikv, ibt, nb, r, 0.4)
        lg, vis = tk.paged_score_keys(pos, iq, ikv, ibt, nb, r, 0.4, logits=True)
        want_vis = torch.clamp((pos + 1) // r, max=nb).to(torch.int32)
        assert torch.equal(vis, want_vis), (nb, vis, want_vis)
        seen = torch.arange(nb)[None] < want_vis[:, None].long()
        bits = lg.contiguous().view(torch.int32).long()  # the fp32 bits as signed integers
        order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        assert torch.equal(torch.where(seen, order, 0), torch.where(seen, keys >> 32, 0)), f"logits vs keys, nb={nb}"
    # the op's two halves on their own (MTP drafts sharing a selection): the select's block sets, the attention
    # over a given selection with holes
    sel = tk.qsa_select_paged_triton(pos, iq, ikv, ibt, 60, r, budget, 0.4)
    want_sel = ref.qsa_select_paged(pos, iq, ikv, ibt, 60, r, budget, 0.4)
    assert torch.equal(sel.long().sort(dim=1).values, want_sel.sort(dim=1).values), (sel, want_sel)
    holed = want_sel.clone()
    holed[:, ::3] = -1
    close(tk.qsa_attend_paged_triton(q, pos, kv, bt, holed, r, 0.3),
          ref.qsa_attend_paged(q, pos, kv, bt, holed, r, budget, 0.3), 0.05, "attend paged, a given selection")
    L = 150
    qq, k, v, iqq, bk = seqs[3]
    p = torch.arange(L - 5, L)  # unpaged, five queries of one sequence
    got = tk.qsa_attention_triton(qq[-5:], k, v, p, iqq[-5:], bk[: L // r], r, budget, 0.3, 0.4)
    close(got, ref.qsa_attention(qq[-5:], k, v, p, iqq[-5:], bk, r, budget, 0.3, 0.4), 0.05, "unpaged")


def check_qsa_prefill():
    from qwen4exp.ops.qsa import reference as ref, triton_kernel as tk
    r, budget = 4, 32
    lens = [9, 150, 203]
    seqs, (kv, bt, ikv, _) = _paged(lens, 500, True)
    saved = tk.LOOP_MIN_QUERIES, tk.PREFILL_KEYS_BYTES, tk.PREFILL_MAX_QUERIES, tk.LOOP_PREFETCH, tk.LOOP_SLOT_BLOCK
    # split attention / looping attention (its rows looked up ahead or not, 32-slot steps); one query chunk / chunks
    # by the keys' bytes / by the query cap
    for loop_min, keys_bytes, max_q, pf in ((1, 1 << 30, 1 << 14, True), (10 ** 9, 8 * 7 * 50, 1 << 14, True),
                                            (5, 1 << 30, 7, True), (1, 1 << 30, 1 << 14, False)):
        tk.LOOP_MIN_QUERIES, tk.PREFILL_KEYS_BYTES, tk.PREFILL_MAX_QUERIES, tk.LOOP_PREFETCH = (loop_min, keys_bytes,
                                                                                                max_q, pf)
        tk.LOOP_SLOT_BLOCK = 128 if pf else 32
        for b, (L, (q, k, v, iq, bk)) in enumerate(zip(lens, seqs)):
            for n in (1, min(L, 40)):
                pos = torch.arange(L - n, L)
                got = tk.qsa_prefill_paged_triton(q[-n:], pos, iq[-n:], kv, bt[b], ikv, L, r, budget, 0.3, 0.4)
                want = ref.qsa_prefill_paged(q[-n:], pos, iq[-n:], kv, bt[b], ikv, L, r, budget, 0.3, 0.4)
                close(got, want, 0.05, f"prefill L={L} n={n} loop_min={loop_min} keys_bytes={keys_bytes}")
    tk.LOOP_MIN_QUERIES, tk.PREFILL_KEYS_BYTES, tk.PREFILL_MAX_QUERIES, tk.LOOP_PREFETCH, tk.LOOP_SLOT_BLOCK = saved


def check_qsa_fp8_caches():
    from qwen4exp.ops.qsa import reference as ref, triton_kernel as tk
    r, budget = 4, 32
    lens = [9, 150, 203]
    seqs, (kv, bt, ikv, _) = _paged(lens, 900, True)
    pos = torch.tensor(lens) - 1
    q, iq = torch.stack([s[0][-1] for s in seqs]), torch.stack([s[3][-1] for s in seqs])
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        k8, i8 = kv.clamp(-400, 400).to(dt), ikv.clamp(-400, 400).to(dt)
        got = tk.qsa_decode_paged_triton(q, pos, iq, k8, bt, i8, bt, 60, r, budget, 0.3, 0.4)
        close(got, ref.qsa_decode_paged(q, pos, iq, k8, bt, i8, bt, 60, r, budget, 0.3, 0.4), 0.05, f"{dt} decode")
        n = 30
        got = tk.qsa_prefill_paged_triton(seqs[2][0][-n:], pos[2:] - torch.arange(n - 1, -1, -1), seqs[2][3][-n:],
                                          k8, bt[2], i8, lens[2], r, budget, 0.3, 0.4)
        want = ref.qsa_prefill_paged(seqs[2][0][-n:], pos[2:] - torch.arange(n - 1, -1, -1), seqs[2][3][-n:], k8,
                                     bt[2], i8, lens[2], r, budget, 0.3, 0.4)
        close(got, want, 0.05, f"{dt} prefill")


def check_qsa_cache_writes():
    from qwen4exp.ops.qsa import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(11)
    for blocks, H, bs, d, N in ((12, 2, 16, 64, 9), (4, 1, 64, 32, 5)):  # main K|V cache, index cache shapes
        kv = torch.randn(blocks, H, bs, 2 * d, generator=g).to(BF)
        kv2 = kv.clone()
        slots = torch.randperm(blocks * bs, generator=g)[:N]
        slots[::3] = -1  # padding rows store nothing
        k = torch.randn(N, H, 2 * d, generator=g).to(BF)[..., :d]  # strided rows
        v = torch.randn(N, H, d, generator=g).to(BF)
        tk.write_paged_triton(kv, slots, k, v)
        ref.write_paged(kv2, slots, k, v)
        assert torch.equal(kv, kv2), "write_paged"
    B, di, RD, ibs, nb, r = 9, 64, 32, 16, 60, 4
    ikv = (torch.randn(nb, 1, ibs, 2 * di, generator=g) * 2).to(BF)
    bt = (torch.randperm(nb - 1, generator=g)[: B * 6] + 1).view(B, 6).int()
    pos = torch.tensor([0, 1, 2, 3, 4, 7, 11, 63, 90])
    slots = bt.gather(1, (pos // ibs).unsqueeze(1)).squeeze(1).long() * ibs + pos % ibs
    slots[-1] = -1
    raw = (torch.randn(B, di + 16, generator=g) * 2).to(BF)[:, :di]
    w = (torch.randn(di, generator=g) * 0.2).to(BF)
    ang = torch.randn(B, RD // 2, generator=g) * 30
    cos, sin = torch.cat([ang, ang], -1).cos().to(BF), torch.cat([ang, ang], -1).sin().to(BF)
    a, b = ikv.clone(), ikv.clone()
    tk.index_update_triton(a, slots, bt, pos, slots >= 0, raw, w, 1e-6, cos, sin, r)
    ref.index_update_decode(b, slots, bt, pos, slots >= 0, raw, w, 1e-6, cos, sin, r)
    close(a, b, 1e-3, "index_update_decode", rtol=2 ** -7)


def hc_mix_both_ways(args, what):
    """hc_mix_triton(*args) in two launches and in one launch with a grid barrier (the interpreter runs its two
    phases as two launches) against the reference; each way with the norm in the kernels and with Hn handed in."""
    from qwen4exp.ops.hyper_connection import reference as ref, triton_kernel as tk
    from qwen4exp.ops.norm.reference import grouped_rms_norm
    xr, cr = ref.hc_mix(*args)
    H, nw, n, eps = args[0], args[1], args[5], args[6]
    hn = grouped_rms_norm(H, nw, H.shape[-1] // n, eps)
    T, inj = args[0].shape[0], args[4] is not None
    ways = [(False, True), (True, True)]  # (FUSED, FINISH_KERNEL)
    if T > tk.IN_KERNEL_SILU_MAX_T:  # (many tokens: no single launch; the finish kernel or torch between A and B)
        ways = [(False, True), (False, False)]
    saved = tk.FUSED, tk.FINISH_KERNEL
    try:
        for (tk.FUSED, tk.FINISH_KERNEL), Hn in itertools.product(ways, (None, hn)):
            x, c = tk.hc_mix_triton(*args, Hn=Hn)
            way = f"fused={tk.FUSED} finish={tk.FINISH_KERNEL} hn_ready={Hn is not None}"
            close(x, xr, 0.07, f"hc_mix {what} {way}")
            if inj:
                close(c, cr, 0.02, f"hc_mix c {what} {way}")
            else:
                assert c.shape == (T, 0)
    finally:
        tk.FUSED, tk.FINISH_KERNEL = saved


def check_hc():
    from qwen4exp.ops.hyper_connection import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(3)
    for T, n, D, R, inj in ((1, 4, 256, 40, True), (3, 4, 256, 40, False), (6, 2, 384, 20, True),
                            (9, 4, 256, 40, False)):
        H = (torch.randn(T, n * D, generator=g) * 2).to(BF)
        nw = (torch.randn(n * D, generator=g) * 0.1).to(BF)
        Wd = (torch.randn(R, n * D, generator=g) / (n * D) ** 0.5).to(BF)
        Wu = (torch.randn(n * D, R, generator=g) / R ** 0.5).to(BF)
        Wi = (torch.randn(n, n * D, generator=g) / (n * D) ** 0.5).to(BF) if inj else None
        hc_mix_both_ways((H, nw, Wd, Wu, Wi, n, 1e-6), f"T={T}")
        y = torch.randn(T, D, generator=g).to(BF)
        cc = (torch.rand(T, n, generator=g) * 2).to(BF)
        close(tk.hc_inject_triton(H, cc, y), ref.hc_inject(H, cc, y), 0.0, "hc_inject", rtol=2 ** -7)  # 1 unit
        # (the interpreter truncates the final fp32 -> bf16 store; on the GPU it is bit-exact)
        Ho, Hno = tk.hc_inject_norm_triton(H, cc, y, nw, n, 1e-6)
        Hr, Hnr = ref.hc_inject_norm(H, cc, y, nw, n, 1e-6)
        close(Ho, Hr, 0.0, "hc_inject_norm H", rtol=2 ** -7)
        close(Hno, Hnr, 0.05, "hc_inject_norm Hn")
        d = (torch.randn(T, R + n, generator=g) * 4).to(BF)  # the many-token path's activation step
        a, c = tk.hc_finish_triton(d, R, n)
        close(a, F.silu(d[:, :R] / n), 0.0, "hc_finish a", rtol=2 ** -7)
        close(c, 2 * torch.sigmoid(d[:, R:] / n), 0.0, "hc_finish c", rtol=2 ** -7)
        dp = torch.cat([d, torch.full((T, 4), float("nan"), dtype=BF)], 1)  # rows padded past R + n: not read
        a, c = tk.hc_finish_triton(dp, R, n, ni=n)
        close(a, F.silu(d[:, :R] / n), 0.0, "hc_finish a (padded)", rtol=2 ** -7)
        close(c, 2 * torch.sigmoid(d[:, R:] / n), 0.0, "hc_finish c (padded)", rtol=2 ** -7)
        a, c = tk.hc_finish_triton(d[:, :R], R, n)  # (no injection: the final mixer; rows strided)
        close(a, F.silu(d[:, :R] / n), 0.0, "hc_finish a (no c)", rtol=2 ** -7)
        assert c.shape == (T, 0)
        gg = (torch.randn(T, n * D, generator=g) * 3).to(BF)
        want = (torch.sigmoid(gg).unflatten(-1, (n, D)) * H.unflatten(-1, (n, D))).mean(-2)
        close(tk.hc_gate_mean_triton(gg, H, n), want, 0.02, "hc_gate_mean")


def check_norm_rope_ple():
    from qwen4exp.ops.norm import reference as nref, triton_kernel as ntk
    from qwen4exp.ops.ple import reference as pref, triton_kernel as ptk
    from qwen4exp.ops.rope import reference as rref, triton_kernel as rtk
    g = torch.Generator().manual_seed(5)
    for shape, group in (((3, 4, 128), 128), ((2, 1280), 640)):
        x = (torch.randn(shape, generator=g) * 3).to(BF)
        w = (torch.randn(shape[-1], generator=g) * 0.1).to(BF)
        close(ntk.rms_norm_triton(x, w, group, 1e-6), nref.grouped_rms_norm(x, w, group, 1e-6), 0.05, "rms_norm")
    wide = (torch.randn(3, 1000, generator=g) * 3).to(BF)  # heads of a slice of a wider projection output
    for xs in (wide[:, 100:612].view(3, 4, 128), wide[:, 8:264].view(3, 2, 128), wide[:, :128].view(3, 1, 128),
               wide[:, :768].view(3, 2, 3, 128)[:, 1]):
        w = (torch.randn(128, generator=g) * 0.1).to(BF)
        close(ntk.rms_norm_triton(xs, w, 128, 1e-6), nref.grouped_rms_norm(xs, w, 128, 1e-6), 0.05,
              f"rms_norm strided {tuple(xs.shape)} {xs.stride()}")
    x = torch.randn(3, 2, 2 * 128, generator=g).to(BF)[..., :128]  # strided, as q out of [q | gate]
    ang = torch.randn(3, 16, generator=g) * 50
    cos, sin = torch.cat([ang, ang], -1).cos().to(BF), torch.cat([ang, ang], -1).sin().to(BF)
    close(rtk.apply_rope_triton(x, cos, sin), rref.apply_rope(x, cos, sin), 0.02, "apply_rope")
    for dt in (BF, torch.float32):  # the QSA query / key preparation: norm + RoPE of strided heads in one kernel
        xs = (torch.randn(3, 4 * 2 * 128, generator=g) * 3).to(dt).view(3, 4, 256)[..., :128]
        w = (torch.randn(128, generator=g) * 0.1).to(dt)
        close(rtk.norm_rope_triton(xs, w, 1e-6, cos.to(dt), sin.to(dt)),
              rref.norm_rope(xs, w, 1e-6, cos.to(dt), sin.to(dt)), 0.02, f"norm_rope {dt}")
    table = (torch.randn(1001, 32, generator=g) * 120).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows = torch.randint(0, 1001, (5, 4), generator=g)
    scale = torch.tensor(0.0173)
    close(ptk.ple_lookup_triton(table, rows, scale), pref.ple_lookup(table, rows, scale), 0.0, "ple", rtol=2 ** -7)


def check_ngram_lookup_decode():
    """Decode's n-gram context + hashing + gather in one launch against ``reference.ngram_lookup_decode``: contexts
    with EOS at every position (fresh sequences: all EOS), an fp8 table with a scale and a bf16 one without."""
    from qwen4exp.ops.ple import hash_multipliers, head_table_sizes, reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(17)
    eos = 5
    for n, hpn, sdt in ((3, 8, torch.float8_e4m3fn), (4, 2, BF), (2, 3, BF)):
        C, G = n - 1, (n - 1) * hpn
        sizes = head_table_sizes(1000, G, 1)
        offs = [sum(sizes[:i]) for i in range(G)]
        mult = torch.tensor(hash_multipliers(248320, n, 1, 0), dtype=torch.long)
        hsz, hoff = torch.tensor(sizes), torch.tensor(offs)
        table = torch.randn(sum(sizes), 24, generator=g).to(sdt)
        scale = torch.tensor(0.05) if sdt != BF else None
        N = 4 * (C + 1)
        prev = torch.randint(0, 248320, (N, C), generator=g)
        for i in range(C):  # an EOS in each column for some rows, all-EOS rows
            prev[i::C + 1, i] = eos
        prev[C::C + 1] = eos
        ids = torch.randint(0, 248320, (N,), generator=g)
        ids[::3] = eos
        assert tk.ngram_lookup_decode_covers(ids, prev)
        want, want_next = ref.ngram_lookup_decode(ids, prev, eos, mult, hsz, hoff, hpn, table, scale, None)
        got, got_next = tk.ngram_lookup_decode_triton(ids, prev, eos, mult, hsz, hoff, hpn, table, scale, None)
        assert torch.equal(got_next, want_next), f"n={n}: next context"
        close(got, want, 0.0, f"ngram_lookup_decode n={n}", rtol=2 ** -7)  # (the interpreter truncates the cast)


def check_ple_mix():
    """The decode-time PLE mix (one launch) against ``reference.ple_mix`` with one token per sequence: streams,
    keys and values strided as the vLLM model passes them (views into one keys|values buffer), a bf16 and an fp32
    conv state, a width that is not a power of two, and the real widths."""
    from qwen4exp.ops.ple import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(13)
    for T, n, D, K, dil, sdt in ((3, 4, 256, 4, 3, BF), (2, 2, 384, 3, 2, torch.float32), (1, 4, 2560, 4, 3, BF)):
        nD, S = n * D, (K - 1) * dil
        H = (torch.randn(T, nD, generator=g) * 2).to(BF)
        kv = torch.randn(T, nD + D, generator=g).to(BF)
        k, v = kv[:, :nD], kv[:, nD:]
        qw, cw = ((torch.randn(nD, generator=g) * 0.2).to(BF) for _ in range(2))
        wc = (torch.randn(nD, K, generator=g) * 0.5).to(BF)
        state = torch.randn(T, nD, S, generator=g).to(sdt)
        want, want_st = ref.ple_mix(H, k, v, qw, cw, wc, None, state, n, 1e-6, dil)
        assert tk.ple_mix_decode_covers(H, k, v, qw, cw, wc, None, state, n)
        got, got_st = tk.ple_mix_decode_triton(H, k, v, qw, cw, wc, state, n, 1e-6, dil)
        # (fp32 sums in another order: a norm or the gate can move by one bf16 unit, and what follows it)
        close(got, want, 0.03, f"ple_mix T={T} D={D}", rtol=2 ** -6)
        assert got_st.dtype == want_st.dtype
        close(got_st, want_st, 0.03, f"ple_mix state T={T} D={D}", rtol=2 ** -6)
        assert torch.equal(got_st[..., :-1], want_st[..., :-1].to(got_st.dtype)) or sdt != BF  # shifted as is
    assert not tk.ple_mix_decode_covers(H, k, v, qw, cw, wc, torch.tensor([0, 1]), state, 4)  # prefill: ref


def check_moe_combine():
    from qwen4exp.ops.moe_combine import reference as ref, triton_kernel as tk
    g = torch.Generator().manual_seed(9)
    for T, D, dt in ((1, 2560, BF), (3, 640, BF), (4, 100, torch.float32)):
        x, s, r = (torch.randn(T, D, generator=g).to(dt) for _ in range(3))
        w = (torch.randn(1, D, generator=g) * D ** -0.5).to(dt)
        want = ref.shared_gate_combine(x, w, s, r)
        # bf16: one unit of the gate (2^-8 relative) times |shared| can move an element by a unit or two
        close(tk.shared_gate_combine_triton(x, w, s, r), want, 0.02 if dt == BF else 1e-5, "shared_gate_combine",
              rtol=2 ** -7 if dt == BF else 0.0)


def check_real_widths():
    """Qwen3.8-Flash-Next's widths (HC: 4 x 2560 streams, rank 320; QSA: 24 / 2 heads x 256, indexer 4 x 128,
    budget 2048 in blocks of 4, a 1,568-token page as vLLM picked on the H200) on a context past the budget, so the
    compile step also builds (and checks the shared memory of) the variants the GPU runs."""
    from qwen4exp.ops.qsa import reference as ref, triton_kernel as tk
    from test_ops import paged_qsa_case, qsa_inputs
    g = torch.Generator().manual_seed(7)
    n, D, R = 4, 2560, 320
    H = (torch.randn(1, n * D, generator=g) * 3).to(BF)
    nw = (torch.randn(n * D, generator=g) * 0.2).to(BF)
    Wd = (torch.randn(R, n * D, generator=g) * (n * D) ** -0.5 * 4).to(BF)
    Wu = (torch.randn(n * D, R, generator=g) * R ** -0.5 * 2).to(BF)
    Wi = (torch.randn(n, n * D, generator=g) * (n * D) ** -0.5 * 4).to(BF)
    hc_mix_both_ways((H, nw, Wd, Wu, Wi, n, 1e-6), "real widths")
    H32 = (torch.randn(32, n * D, generator=g) * 3).to(BF)  # batch-32 decode: Hn handed in (hc_inject_norm)
    hc_mix_both_ways((H32, nw, Wd, Wu, Wi, n, 1e-6), "real widths T=32")
    y, cc = torch.randn(32, D, generator=g).to(BF), (torch.rand(32, n, generator=g) * 2).to(BF)
    from qwen4exp.ops.hyper_connection import reference as hc_ref, triton_kernel as hc_tk
    close(hc_tk.hc_inject_norm_triton(H32, cc, y, nw, n, 1e-6)[1], hc_ref.hc_inject_norm(H32, cc, y, nw, n, 1e-6)[1],
          0.05, "hc_inject_norm real widths")
    r, budget, L, bs = 4, 2048, 2100, 1568
    seq = [t.to(BF) for t in qsa_inputs(L, Hq=24, Hkv=2, d=256, hi=4, di=128, seed=3)]
    kv, bt, ikv, _ = paged_qsa_case([seq], [L], r, bs, bs, shared_table=True)
    q, k, v, iq, bk = seq
    pos = torch.tensor([L - 1])
    want = ref.qsa_decode_paged(q[-1:], pos, iq[-1:], kv, bt, ikv, bt, L // r, r, budget, 0.0625, 0.1)
    saved = tk.ATTN_MANY_QUERIES
    for many in (saved, 1):  # the few- and the many-query (batch-32) launch settings of the decode attention
        tk.ATTN_MANY_QUERIES = many
        got = tk.qsa_decode_paged_triton(q[-1:], pos, iq[-1:], kv, bt, ikv, bt, L // r, r, budget, 0.0625, 0.1)
        close(got, want, 0.05, f"decode real widths ATTN_MANY_QUERIES={many}")
    tk.ATTN_MANY_QUERIES = saved
    saved = tk.LOOP_MIN_QUERIES
    for loop_min in (1, 10 ** 9):  # looping / split attention
        tk.LOOP_MIN_QUERIES = loop_min
        p = torch.arange(L - 2, L)
        got = tk.qsa_prefill_paged_triton(q[-2:], p, iq[-2:], kv, bt[0], ikv, L, r, budget, 0.0625, 0.1)
        want = ref.qsa_prefill_paged(q[-2:], p, iq[-2:], kv, bt[0], ikv, L, r, budget, 0.0625, 0.1)
        close(got, want, 0.05, f"prefill real widths loop_min={loop_min}")
    tk.LOOP_MIN_QUERIES = saved


def check_op_registration():
    """The CUDA custom operators (``qwen4exp.ops.cuda``): defined straight in a torch.library fragment (no
    torch.library.custom_op wrapper, whose per-call Python work the eager steps would pay), each with its schema
    (in-place ones marked mutable) and a fake implementation that gives the kernels' output shapes to
    torch.compile / CUDA-graph tracing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qwen4exp.ops import cuda
    ops = {k: v for k, v in vars(cuda).items() if isinstance(v, cuda._CustomOp)}
    assert len(ops) == 21, sorted(ops)
    for name, op in ops.items():
        schema = str(getattr(torch.ops.qwen4exp, op.name).default._schema)
        assert ("(a0!)" in schema) == (op.name in ("qsa_write_paged", "qsa_index_update_decode")), (name, schema)
    with FakeTensorMode():
        def t(*shape, dtype=BF):
            return torch.empty(*shape, dtype=dtype, device="cuda")
        x, c = cuda.hc_mix_op(t(3, 256), t(256), t(16, 256), t(256, 16), t(4, 256), 4, 1e-6)
        assert x.shape == (3, 64) and c.shape == (3, 4) and x.device.type == "cuda"
        x, c = cuda.hc_mix_op(t(3, 256), t(256), t(16, 256), t(256, 16), None, 4, 1e-6)
        assert c.shape == (3, 0)
        assert cuda.hc_gate_mean_op(t(5, 256), t(5, 256), 4).shape == (5, 64)
        a, c = cuda.hc_finish_op(t(5, 24), 16, 4, 4)
        assert a.shape == (5, 16) and c.shape == (5, 4)
        assert cuda.hc_inject_op(t(2, 256), t(2, 4), t(2, 64)).shape == (2, 256)
        Ho, Hn = cuda.hc_inject_norm_op(t(2, 256), t(2, 4), t(2, 64), t(256), 4, 1e-6)
        assert Ho.shape == Hn.shape == (2, 256)
        x, c = cuda.hc_mix_op(t(3, 256), t(256), t(16, 256), t(256, 16), t(4, 256), 4, 1e-6, t(3, 256))
        assert x.shape == (3, 64) and c.shape == (3, 4)
        assert cuda.rms_norm_op(t(2, 24, 256), t(256), 256, 1e-6).shape == (2, 24, 256)
        assert cuda.apply_rope_op(t(2, 24, 64), t(2, 64), t(2, 64)).shape == (2, 24, 64)
        assert cuda.norm_rope_op(t(2, 24, 64), t(64), 1e-6, t(2, 32), t(2, 32)).shape == (2, 24, 64)
        assert cuda.shared_gate_combine_op(t(2, 64), t(1, 64), t(2, 64), t(2, 64)).shape == (2, 64)
        out, st = cuda.ple_mix_decode_op(t(3, 256), t(3, 256), t(3, 64), t(256), t(256), t(256, 4), t(3, 256, 9),
                                         4, 1e-6, 3)
        assert out.shape == (3, 256) and st.shape == (3, 256, 9) and st.dtype == BF
        i64 = dict(dtype=torch.int64)
        emb, nxt = cuda.ngram_lookup_decode_op(t(3, **i64), t(3, 2, **i64), 7, t(3, **i64), t(16, **i64),
                                               t(16, **i64), 8, t(100, 160, dtype=torch.float8_e4m3fn),
                                               t(1, dtype=torch.float32), BF)
        assert emb.shape == (3, 16 * 160) and emb.dtype == BF and nxt.shape == (3, 2)
        rows = torch.empty(3, 16, dtype=torch.int64, device="cuda")
        out = cuda.ple_lookup_op(t(100, 8, dtype=torch.float8_e4m3fn), rows, None, BF)
        assert out.shape == (3, 128) and out.dtype == BF
        i64 = dict(dtype=torch.int64)
        ids = cuda.qsa_select_paged_op(t(3, **i64), t(3, 4, 32), t(9, 1, 16, 64), t(3, 5, dtype=torch.int32), 40, 4,
                                       32, 0.4)
        assert ids.shape == (3, 8) and ids.dtype == torch.int64
        assert cuda.qsa_attend_paged_op(t(3, 6, 64), t(3, **i64), t(9, 2, 16, 128), t(3, 5, dtype=torch.int32), ids,
                                        4, 0.3).shape == (3, 6, 64)
        kv = t(4, 2, 16, 64)
        assert cuda.write_paged_op(kv, torch.empty(3, dtype=torch.int64, device="cuda"), t(3, 2, 64),
                                   t(3, 2, 64)) is None
        o, st = cuda.gdn_chunk_op(t(7, 2, 32), t(7, 2, 32), t(7, 4, 16), t(7, 4, dtype=torch.float32), t(7, 4),
                                  torch.empty(3, dtype=torch.int32, device="cuda"), None, None, True)
        assert o.shape == (7, 4, 16) and st.shape == (2, 4, 32, 16) and st.dtype == torch.float32


CHECKS = [check_op_registration, check_qsa_topk, check_qsa_decode, check_qsa_prefill, check_qsa_fp8_caches,
          check_qsa_cache_writes, check_hc, check_norm_rope_ple, check_ple_mix, check_ngram_lookup_decode,
          check_moe_combine, check_real_widths]


# ------------------------------------------------------------------------------------------ record / compile
def _describe(fn, args, kwargs):
    """One launch -> {module, name, signature, constexprs, options} (JSON-able)."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    sig, const = {}, {}
    for name, p in params.items():
        v = bound.get(name, p.default)
        if "constexpr" in str(p.annotation):
            sig[name], const[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
    return dict(module=fn.__module__, name=fn.__name__, signature=sig, constexprs=const,
                options={k: kwargs[k] for k in OPTIONS if k in kwargs})


def run(path):
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    from triton.runtime.interpreter import InterpretedFunction
    launches = {}
    orig = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        d = _describe(self.fn, args, kwargs)
        launches[json.dumps(d, sort_keys=True)] = d
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    for check in CHECKS:
        check()
        print(f"ok {check.__name__}", flush=True)
    with open(path, "w") as f:
        json.dump(list(launches.values()), f)
    print(f"{len(launches)} distinct launches recorded")


def compile_all(path):
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compile without TRITON_INTERPRET"
    target = GPUTarget("cuda", 90, 32)
    with open(path) as f:
        launches = json.load(f)
    # the interpreter runs the HC kernels without programmatic dependent launch (no such thing on a CPU): compile
    # those launches with it too, as the GPU runs them
    launches += [dict(d, constexprs=dict(d["constexprs"], PDL=True)) for d in launches
                 if d["constexprs"].get("PDL") is False]
    # nor the single-launch HC mixer's grid barrier (it runs the two phases as two launches): compile PHASE 3 too
    launches += [dict(d, constexprs=dict(d["constexprs"], PHASE=3)) for d in launches
                 if d["constexprs"].get("PHASE") == 2]
    names = set()
    for d in launches:
        fn = getattr(importlib.import_module(d["module"]), d["name"])
        src = ASTSource(fn, d["signature"], constexprs=d["constexprs"])
        try:
            k = triton.compile(src, target=target, options=d["options"])
        except Exception as e:  # noqa: BLE001  (name the kernel and its constants)
            raise RuntimeError(f"{d['name']} {d['constexprs']} {d['options']}: {type(e).__name__}: {e}") from e
        assert k.asm.get("cubin"), d["name"]
        assert k.metadata.shared <= SMEM_MAX, f"{d['name']} {d['constexprs']}: {k.metadata.shared} B of shared memory"
        names.add(d["name"])
        at = NO_SPILL_AT.get(d["name"])
        if d["name"] in NO_SPILL or (at and all(d["constexprs"].get(k) == v for k, v in at.items())):
            regs, spill = ptxas_resources(k.asm["ptx"], k.metadata.target.arch)
            print(f"resources {d['name']} {d['constexprs']} warps {d['options'].get('num_warps')}: {regs} registers, "
                  f"{spill} bytes spilled")
            assert spill == 0, f"{d['name']} {d['constexprs']} {d['options']}: {spill} bytes of register spills"
    print(f"compiled {len(launches)} launches of {len(names)} kernels for sm_90: {', '.join(sorted(names))}")
    row_views_not_specialised(target)


# decode-path kernels that must not spill registers (run 10: the first PLE mix kernel held whole rows in registers,
# 255 registers + 136 B of spills, and took 36 us for 32 tokens)
NO_SPILL = {"_ple_mix_decode_kernel", "_ngram_gather_decode_kernel", "_ple_gather_kernel", "_hc_finish_kernel",
            "_hc_inject_kernel", "_hc_inject_norm_kernel", "_hc_gate_mean_kernel", "_rms_norm_kernel",
            "_shared_gate_combine_kernel", "_norm_rope_kernel", "_rope_kernel"}
NO_SPILL_AT = {"_qsa_attn_kernel": {"HD": 256}}  # these at the real widths (test widths compile to other layouts)


def ptxas_resources(ptx: str, arch: int) -> tuple[int, int]:
    """Registers per thread and bytes of spill stores of a kernel's PTX, from ``ptxas -v`` (Triton's own ptxas)."""
    import re
    import subprocess
    import tempfile

    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        p = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    info = p.stdout + p.stderr
    assert p.returncode == 0, info[-2000:]
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    return regs, spill


def row_views_not_specialised(target):
    """Positions and block-table rows arrive as views whose start may or may not be 16-byte aligned (where the
    request sits in the step): no QSA kernel may compile a variant per alignment of them (a JIT stall mid-serving).
    Every such parameter is marked, and the launch key of the prefill score kernel is the same for an aligned and a
    misaligned view."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from qwen4exp.ops.qsa import triton_kernel as tk
    marked = 0
    for name, fn in vars(tk).items():
        if isinstance(fn, JITFunction) and name.endswith("_kernel"):  # (launched; helpers take what they get)
            for p in fn.params:
                if p.name in tk._ROW_VIEWS:
                    assert p.do_not_specialize_on_alignment, f"{name}: {p.name} specialised on alignment"
                    marked += 1
    k = tk._qsa_score_prefill_kernel
    binder = create_function_from_signature(k.signature, k.params, CUDABackend(target))
    pos, bt = torch.arange(10), torch.zeros(4, 7, dtype=torch.int32)

    def key(p, row):
        args = (torch.zeros(8, 4, 128, dtype=BF), torch.zeros(2, 1, 16, 256, dtype=BF), row, p,
                torch.zeros(8, 64, dtype=torch.int64), 8, 64, 4, 0.5, 7, 512, 128, 8192, 256, 64)
        return str(binder(*args, HI=4, DI=128, IBS=16, BLOCK_M=64, BLOCK_N=64, debug=False)[1])

    assert key(pos[0:8], bt[0]) == key(pos[1:9], bt[1]), "prefill score kernel: a new variant per alignment"
    print(f"row views: {marked} parameters not specialised on alignment")


if __name__ == "__main__":
    {"run": run, "compile": compile_all}[sys.argv[1]](sys.argv[2])
