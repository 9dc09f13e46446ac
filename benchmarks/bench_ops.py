"""Time the Triton kernels (each op folder's registration: ``qwen4exp.ops.<op>.cuda``) against the torch references
and torch.compile of them.

    python benchmarks/bench_ops.py --csv bench_out/bench_ops.csv [--no-compile] [--only hc_mix,qsa_decode_paged]

For each op at the real widths (batch 1 and 32; QSA: context 50,000; the paged decode op reads shuffled paged caches
as the vLLM plugin does; RMSNorm / RoPE at the QSA projections' sizes): the median time per call, the bytes it must
move (each input read once, each output written once) and FLOPs, the achieved fraction of the HBM bandwidth
measured in the same run (a device-to-device copy, bytes read + written), and the speed-up over the reference and
over torch.compile of the reference. The MoE decode kernels (``--only moe_router,moe_experts,moe_decode``; issue 50
item 3, QWEN4EXP_MOE_DECODE turned on for this run): M = 1..4 tokens, 512 experts, top-10, hidden 2560,
intermediate 640, NVFP4; bytes = the distinct selected experts' weights and scales (27.6 MB at M = 1), plus a sweep
of the expert kernels' launch settings.

Timing: CUDA events around CUDA-graph replays of one call per input set, several input sets in rotation so the
weights and caches are re-read from HBM rather than L2 (the inputs of all sets together are > 3x the L2); the
median of the replays, divided by the calls per replay.  Where a version cannot be captured (the QSA reference
synchronises with the host) it is timed eagerly the same way ('eager' in the table).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qwen4exp.ops import _registry  # noqa: E402
from qwen4exp.ops.cuda_graph import capture  # noqa: E402
from qwen4exp.ops.hyper_connection import reference as hc_ref  # noqa: E402
from qwen4exp.ops.moe_combine import reference as moe_ref  # noqa: E402
from qwen4exp.ops.norm import reference as norm_ref  # noqa: E402
from qwen4exp.ops.ple import reference as ple_ref  # noqa: E402
from qwen4exp.ops.qsa import reference as qsa_ref  # noqa: E402
from qwen4exp.ops.rope import reference as rope_ref  # noqa: E402

BF = torch.bfloat16
L2_BYTES = 60 << 20


def events_median(run, reps):
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)  # us
    return statistics.median(ts)


def time_calls(fn, sets, reps=30, graph=True):
    """Median microseconds per call of fn(*s) over the input sets; (time, 'graph'|'eager')."""
    def all_sets():
        for s in sets:
            fn(*s)

    all_sets()  # warm up (compilation, autotuning, allocator)
    torch.cuda.synchronize()
    if graph:
        try:
            g, _ = capture(all_sets)
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            return events_median(g.replay, reps) / len(sets), "graph"
        except Exception as e:  # noqa: BLE001  (a host sync inside: time it eagerly)
            torch.cuda.synchronize()
            print(f"   (no graph: {type(e).__name__}: {str(e).splitlines()[0][:90]})", flush=True)
    all_sets()
    torch.cuda.synchronize()
    return events_median(all_sets, max(5, reps // 3)) / len(sets), "eager"


def measure_bandwidth():
    n = 1 << 29  # 1 GiB of bf16
    src = torch.randn(n, device="cuda").to(BF)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    t = events_median(lambda: dst.copy_(src), 20)
    return 2 * n * 2 / (t * 1e-6)  # bytes / s, read + write


def n_sets(bytes_per_set, lo=2, hi=64):
    return max(lo, min(hi, math.ceil(3 * L2_BYTES / max(bytes_per_set, 1))))


# --------------------------------------------------------------------------------------------------------- cases
def hc_mix_case(T, n=4, D=2560, R=320):
    NK = n * D
    w_bytes = (R * NK + NK * R + n * NK) * 2 + NK * 2
    by = w_bytes + T * NK * 2 + T * D * 2 + T * n * 2
    fl = 2 * T * NK * (R + n) + 2 * T * R * NK
    sets = []
    for i in range(n_sets(by)):
        sets.append((torch.randn(T, NK, device="cuda").to(BF) * 3, (torch.randn(NK, device="cuda") * 0.2).to(BF),
                     (torch.randn(R, NK, device="cuda") * NK ** -0.5 * 4).to(BF),
                     (torch.randn(NK, R, device="cuda") * R ** -0.5 * 2).to(BF),
                     (torch.randn(n, NK, device="cuda") * NK ** -0.5 * 4).to(BF), n, 1e-6))
    return sets, by, fl


def hc_step_case(T, n=4, D=2560, R=320):
    """One HC transition as the layers run it: the previous block's write-back, then the next mixer (the norm
    inside it, or handed over by ``hc_inject_norm``): (H, c, y, norm w, W_down, W_up, W_inj, n, eps)."""
    sets, by, fl = hc_mix_case(T, n, D, R)
    out = []
    for H, nw, Wd, Wu, Wi, n_, eps in sets:
        # the vLLM layout: W_down and W_inj as row ranges of one buffer padded to 8 rows (the many-token GEMM)
        buf = torch.cat([Wd, Wi, Wd.new_zeros(-(-(R + n) // 8) * 8 - R - n, Wd.shape[1])])
        out.append((H, (torch.rand(T, n, device="cuda") * 2).to(BF), torch.randn(T, D, device="cuda").to(BF), nw,
                    buf[:R], Wu, buf[R:R + n], n_, eps))
    return out, by + T * n * D * 2 * 2 + T * D * 2, fl


def hc_step_before(H, c, y, nw, Wd, Wu, Wi, n, eps, many=False):
    from qwen4exp.ops.hyper_connection import cuda as hc_cuda
    H = hc_cuda.hc_inject(H, c, y)
    return (hc_cuda.mix_many_tokens if many else hc_cuda.hc_mix)(H, nw, Wd, Wu, Wi, n, eps)


def hc_step_fused_norm(H, c, y, nw, Wd, Wu, Wi, n, eps, many=False):
    from qwen4exp.ops.hyper_connection import cuda as hc_cuda
    H, Hn = hc_cuda.hc_inject_norm(H, c, y, nw, n, eps)
    return (hc_cuda.mix_many_tokens if many else hc_cuda.hc_mix)(H, nw, Wd, Wu, Wi, n, eps, Hn)


def hc_step_ref(H, c, y, nw, Wd, Wu, Wi, n, eps):
    H, Hn = hc_ref.hc_inject_norm(H, c, y, nw, n, eps)
    return hc_ref.hc_mix(H, nw, Wd, Wu, Wi, n, eps, Hn)


def with_knobs(fn, mod, **knobs):
    """fn with module settings changed for the call (and for the CUDA graph captured around it)."""
    def run(*a):
        saved = {k: getattr(mod, k) for k in knobs}
        for k, v in knobs.items():
            setattr(mod, k, v)
        try:
            return fn(*a)
        finally:
            for k, v in saved.items():
                setattr(mod, k, v)
    return run


def with_env(fn, **env):
    """fn with ``qwen4exp.envs`` switches set for the call (and for the CUDA graph captured around it)."""
    from qwen4exp import envs

    def run(*a):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        envs.reset()
        try:
            return fn(*a)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            envs.reset()
    return run


def hc_inject_case(T, n=4, D=2560):
    by = T * n * D * 2 * 2 + T * D * 2 + T * n * 2
    sets = [(torch.randn(T, n * D, device="cuda").to(BF), torch.rand(T, n, device="cuda").to(BF),
             torch.randn(T, D, device="cuda").to(BF)) for _ in range(n_sets(by, hi=256))]
    return sets, by, 2 * T * n * D


def qsa_case(Tq, L=50_000, Hq=24, Hkv=2, d=256, hi=4, di=128, r=4, budget=2048):
    Nb = L // r
    sel = budget + r - 1
    by = Nb * di * 2 + Tq * (Hq * d * 2 * 2 + hi * di * 2) + min(Tq * sel, L) * Hkv * d * 2 * 2
    fl = 2 * Tq * Nb * hi * di + 2 * 2 * Tq * Hq * sel * d
    sets = []
    for i in range(n_sets(by, lo=4, hi=8)):
        sets.append((torch.randn(Tq, Hq, d, device="cuda").to(BF), torch.randn(L, Hkv, d, device="cuda").to(BF),
                     torch.randn(L, Hkv, d, device="cuda").to(BF), torch.arange(L - Tq, L, device="cuda"),
                     torch.randn(Tq, hi, di, device="cuda").to(BF), torch.randn(Nb, di, device="cuda").to(BF),
                     r, budget, d ** -0.5, di ** -0.5))
    return sets, by, fl


def paged_qsa_case(B, L=50_000, Hq=24, Hkv=2, d=256, hi=4, di=128, r=4, budget=2048, bs=16, ibs=64):
    """B decode queries, each at the end of its own L-token sequence, caches paged (shuffled blocks)."""
    Nb = L // r
    sel = budget + r - 1
    by = B * (Nb * di * 2 + sel * Hkv * d * 2 * 2 + Hq * d * 2 * 2 + hi * di * 2)  # block keys + selected K/V + q/out
    fl = B * (2 * Nb * hi * di + 2 * 2 * Hq * sel * d)
    nbt, nbti = -(-L // bs), -(-L // ibs)
    sets = []
    for i in range(n_sets(by, lo=2, hi=4)):
        kv = torch.randn(B * nbt + 1, Hkv, bs, 2 * d, device="cuda").to(BF)
        ikv = torch.randn(B * nbti + 1, 1, ibs, 2 * di, device="cuda").to(BF)
        bt = (torch.randperm(B * nbt, device="cuda") + 1).view(B, nbt).int()
        ibt = (torch.randperm(B * nbti, device="cuda") + 1).view(B, nbti).int()
        sets.append((torch.randn(B, Hq, d, device="cuda").to(BF), torch.full((B,), L - 1, device="cuda"),
                     torch.randn(B, hi, di, device="cuda").to(BF), kv, bt, ikv, ibt, Nb + 8, r, budget, d ** -0.5,
                     di ** -0.5))
    return sets, by, fl


def prefill_qsa_case(Tq, L=50_000, Hq=24, Hkv=2, d=256, hi=4, di=128, r=4, budget=2048, bs=784):
    """A prefill chunk: the last Tq queries of one L-token sequence, K/V and index rows in ONE paged cache layout
    (one block table, vLLM's), shuffled blocks. Bytes: block keys + every token's K/V once (the union of the
    selections), queries and output; FLOPs: scores of every visible block + attention over budget + r - 1 tokens."""
    Nb = L // r
    sel = budget + r - 1
    by = Nb * di * 2 + L * Hkv * d * 2 * 2 + Tq * (Hq * d * 2 * 2 + hi * di * 2)
    fl = 2 * Tq * Nb * hi * di + 2 * 2 * Tq * Hq * sel * d
    nbt = -(-L // bs)
    sets = []
    for i in range(2):
        kv = torch.randn(nbt + 1, Hkv, bs, 2 * d, device="cuda").to(BF)
        ikv = torch.randn(nbt + 1, 1, bs, 2 * di, device="cuda").to(BF)
        row = (torch.randperm(nbt, device="cuda") + 1).int()
        sets.append((torch.randn(Tq, Hq, d, device="cuda").to(BF), torch.arange(L - Tq, L, device="cuda"),
                     torch.randn(Tq, hi, di, device="cuda").to(BF), kv, row, ikv, L, r, budget, d ** -0.5,
                     di ** -0.5))
    return sets, by, fl


def rms_norm_case(shape, group):
    n = math.prod(shape)
    by = n * 2 * 2 + shape[-1] * 2
    sets = [(torch.randn(*shape, device="cuda").to(BF), (torch.randn(shape[-1], device="cuda") * 0.1).to(BF), group,
             1e-6) for _ in range(n_sets(by, hi=256))]
    return sets, by, 4 * n


def moe_combine_case(T, D=2560):
    """routed + sigmoid(x . w_gate) * shared: reads x, shared, routed [T, D] and w_gate [1, D], writes [T, D]."""
    by = T * D * 2 * 4 + D * 2
    sets = [tuple(torch.randn(T, D, device="cuda").to(BF) for _ in range(3)) for _ in range(n_sets(by, hi=256))]
    sets = [(x, (torch.randn(1, D, device="cuda") * D ** -0.5).to(BF), s, r) for x, s, r in sets]
    return sets, by, T * D * 5


def rope_case(T, H=24, d=256, R=64):
    by = T * H * d * 2 * 2 + T * R * 2 * 2
    sets = []
    for _ in range(n_sets(by, hi=256)):
        ang = torch.randn(T, R // 2, device="cuda") * 100
        sets.append((torch.randn(T, H, d, device="cuda").to(BF), torch.cat([ang, ang], -1).cos().to(BF),
                     torch.cat([ang, ang], -1).sin().to(BF)))
    return sets, by, 6 * T * H * R


def norm_rope_case(T, H=24, d=256, R=64):
    """The QSA query preparation: (x, norm weight, eps, cos, sin); x strided as q out of [q | gate]."""
    sets, by, fl = rope_case(T, H, d, R)
    return [(torch.randn(T, H, 2 * d, device="cuda").to(BF)[..., :d], (torch.randn(d, device="cuda") * 0.1).to(BF),
             1e-6, c, s) for _, c, s in sets], by + d * 2, fl + 4 * T * H * d


def norm_then_rope(x, w, eps, cos, sin):
    from qwen4exp.ops.norm import cuda as norm_cuda
    from qwen4exp.ops.rope import cuda as rope_cuda
    return rope_cuda.apply_rope(norm_cuda.rms_norm(x, w, x.shape[-1], eps), cos, sin)


_TABLES = {}


def ple_case(T, where, R=2_000_000, dg=160, G=16):
    by = T * G * dg * 1 + T * G * dg * 2 + T * G * 8
    if where not in _TABLES:  # 320 MB of fp8 rows, random finite e4m3 values
        base = torch.randint(0, 120, (R, dg), dtype=torch.uint8).view(torch.float8_e4m3fn)
        _TABLES[where] = base.pin_memory() if where == "pinned" else base.cuda()
    table = _TABLES[where]
    scale = torch.tensor(0.0173, device="cuda")
    sets = [(table, torch.randint(0, R, (T, G), device="cuda"), scale, None) for _ in range(16)]
    return sets, by, T * G * dg


def ngram_lookup_case(T, where, R=2_000_000, dg=160, n=3, hpn=8):
    """Decode's n-gram context + hashing + gather (fp8 table with a scale): reads the ids, contexts and T * G rows,
    writes the bf16 embeddings and the next contexts."""
    from qwen4exp.ops.ple import hash_multipliers, head_table_sizes
    G = (n - 1) * hpn
    by = T * G * dg * 1 + T * G * dg * 2 + T * (2 * n) * 8
    if where not in _TABLES:
        base = torch.randint(0, 120, (R, dg), dtype=torch.uint8).view(torch.float8_e4m3fn)
        _TABLES[where] = base.pin_memory() if where == "pinned" else base.cuda()
    sizes = head_table_sizes(R // G, G, 1)
    mult = torch.tensor(hash_multipliers(248320, n, 1, 0), device="cuda")
    hsz = torch.tensor(sizes, device="cuda")
    hoff = torch.tensor([sum(sizes[:i]) for i in range(G)], device="cuda")
    scale = torch.tensor(0.0173, device="cuda")
    sets = [(torch.randint(0, 248320, (T,), device="cuda"), torch.randint(0, 248320, (T, n - 1), device="cuda"),
             248044, mult, hsz, hoff, hpn, _TABLES[where], scale, None) for _ in range(16)]
    return sets, by, T * G * dg


def ple_mix_case(T, n=4, D=2560, K=4, dil=3):
    """The decode-time PLE mix: reads H and keys [T, nD], values [T, D], the conv state [T, nD, S] and the weights
    ([nD] x 2, [nD, K]); writes the output [T, nD] and the new state."""
    nD, S = n * D, (K - 1) * dil
    by = T * (2 * nD + D + 2 * nD * S + nD) * 2 + nD * (2 + K) * 2
    w = [(torch.randn(nD, device="cuda") * 0.2).to(BF) for _ in range(2)] + [
        (torch.randn(nD, K, device="cuda") * 0.5).to(BF)]
    sets = []
    for _ in range(n_sets(by, hi=64)):
        kv = torch.randn(T, nD + D, device="cuda").to(BF)
        sets.append((torch.randn(T, nD, device="cuda").to(BF), kv[:, :nD], kv[:, nD:], *w, None,
                     torch.randn(T, nD, S, device="cuda").to(BF), n, 1e-6, dil))
    return sets, by, T * nD * (2 * K + 12)


def gdn_case(lens, hk=16, hv=48, d=128):
    """GDN at the real widths: packed sequences of ``lens`` tokens with carried fp32 states. Bytes: the states read
    and written, q / k / v / g / beta read and the output written."""
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    by = 2 * N * hv * d * d * 4 + T * (2 * hk * d + 2 * hv * d) * 2 + T * hv * 6
    sets = []
    for _ in range(4):  # drawn on the host: an aborted graph capture (a reference's host sync) upsets CUDA's RNG
        q, k = (torch.randn(T, hk, d).to("cuda", torch.bfloat16) for _ in range(2))
        v = torch.randn(T, hv, d).to("cuda", torch.bfloat16)
        g = -torch.nn.functional.softplus(torch.randn(T, hv)).cuda()
        beta = torch.sigmoid(torch.randn(T, hv)).to("cuda", torch.bfloat16)
        sets.append((q, k, v, g, beta, cu, (torch.randn(N, hv, d, d) * 0.1).cuda()))
    return sets, by, T * hv * d * d * 6


def ple_ref_host(table, rows, scale, out_dtype):
    """What the model does with a host table and no kernel: rows to the host, gather there, result back."""
    return ple_ref.ple_lookup(table, rows.cpu(), scale.cpu(), out_dtype).to(rows.device, non_blocking=True)


# ----------------------------------------------------------------------------------------------------- breakdown
def tune_and_breakdown():
    """Launch-shape sweeps of the multi-launch kernels at decode size (coordinate descent; each variant's output
    checked against the reference first), leaving the fastest correct settings in place for the main table; then
    the stage times; then registers / spills of the compiled kernels."""
    from qwen4exp.ops.hyper_connection import triton_kernel as hc_tk
    from qwen4exp.ops.qsa import launch as qsa_launch
    from qwen4exp.ops.qsa import triton_kernel as qsa_tk

    out = []

    def timed(op, case, stage, fn, sets, check=None):
        try:
            if check is not None and not check():
                print(f"   {op} {case} {stage}: WRONG OUTPUT, skipped", flush=True)
                return float("inf")
            t, _ = time_calls(fn, sets)
        except Exception as e:  # noqa: BLE001
            print(f"   {op} {case} {stage} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return float("inf")
        out.append((op, case, stage, t))
        return t

    def sweep(op, mod, sets, grid, fn, check):
        for knob, values in grid:
            best = None
            for val in values:
                setattr(mod, knob, val)
                others = ", ".join(f"{k}={getattr(mod, k)}" for k, _ in grid if k != knob)
                stage = f"sweep {knob}={val} ({others})"
                t = timed(op, "T=1" if op == "hc_mix" else "Tq=1", stage, fn, sets, check)
                if best is None or t < best[0]:
                    best = (t, val)
            setattr(mod, knob, best[1])
        print(f"   tuned {op}: " + ", ".join(f"{k}={getattr(mod, k)}" for k, _ in grid), flush=True)

    sets, _, _ = hc_mix_case(1)
    xr, cr = hc_ref.hc_mix(*sets[0])

    def hc_ok():
        x, c = hc_tk.hc_mix_triton(*sets[0])
        return bool((x.float() - xr.float()).abs().max() <= 0.07 and (c.float() - cr.float()).abs().max() <= 0.02)

    sweep("hc_mix", hc_tk, sets, [("A_BLOCK_R", (64, 32, 16)), ("A_WARPS", (8, 4)), ("B_BLOCK_D", (16, 8, 32)),
                                 ("B_WARPS", (8, 4)), ("USE_PDL", (True, False))],
          hc_tk.hc_mix_triton, hc_ok)
    a_only = lambda *a: hc_tk.hc_mix_triton(*a, _stop_after_down=True)  # noqa: E731
    timed("hc_mix", "T=1", "stage A alone (norm + down/inj)", a_only, sets)
    sets, _, _ = qsa_case(1)
    want = qsa_ref.qsa_attention(*sets[0])

    def qsa_ok():
        o = qsa_tk.qsa_attention_triton(*sets[0])
        return bool(((o.float() - want.float()).norm() / want.float().norm()) < 1e-2)

    # (the unpaged op selects with torch.topk of the sort keys: the Triton select's settings are swept by
    # --decode-breakdown, on the paged decode op that runs it)
    sweep("qsa", qsa_launch, sets, [("ATTN_SLOT_BLOCK", (64, 32)), ("ATTN_WARPS", (8, 4))],
          qsa_tk.qsa_attention_triton, qsa_ok)
    m = 2048 // 4
    for Tq in (1, 32):
        sets, by, _ = qsa_case(Tq)
        timed("qsa", f"Tq={Tq}", "stage: indexer scores (Triton)",
              lambda q, k, v, qp, iq, bk, r, b, sc, isc: qsa_tk.score_keys(qp, iq, bk, r, isc), sets)
        keys = [(qsa_tk.score_keys(s[3], s[4], s[5], s[6], s[9]),) for s in sets]
        timed("qsa", f"Tq={Tq}", "stage: top-512 (Triton select)", lambda kk: qsa_tk.top_ids(kk, m), keys)
        timed("qsa", f"Tq={Tq}", "stage: top-512 (torch.topk)", lambda kk: qsa_tk.top_keys(kk, m), keys)
        asets = [(s[0], s[1], s[2], s[3], qsa_tk.top_ids(kk[0], m), s[6], s[8], False) for s, kk in zip(sets, keys)]
        timed("qsa", f"Tq={Tq}", "stage: attention + merge", qsa_tk.sparse_attention_slots, asets)
        sets = keys = asets = None  # free before the next case
        torch.cuda.empty_cache()
    print("\nlaunch-shape sweeps and stage times (us per call, CUDA-graph replay)")
    for op, case, stage, t in out:
        print(f"| {op:<7} | {case:<6} | {stage:<70} | {t:>8.2f} |")
    for name, mod in (("hc", hc_tk), ("qsa", qsa_tk)):
        for kname, k in mod.LAUNCHED.items():
            print(f"   kernel {kname}: registers {getattr(k, 'n_regs', '?')}, spills {getattr(k, 'n_spills', '?')}, "
                  f"shared {getattr(getattr(k, 'metadata', None), 'shared', '?')} B")
    return out


def prefill_breakdown(Tq=4096):
    """qsa_prefill_paged at Tq queries, L=50,000, by stage (tiled scores, top-k, attention), the attention's launch
    shapes swept, and the attention once more with every query selecting the same blocks (the L2-friendly bound:
    real selections of neighbouring queries overlap, random test data's do not). -> rows (op, case, stage, us)."""
    from qwen4exp.ops.qsa import launch, triton_kernel as tk
    sets, _, _ = prefill_qsa_case(Tq)
    q, pos, iq, kv, row, ikv, L, r, budget, sc, isc = sets[0]
    HD, nb, m = q.shape[-1], L // r, budget // r
    bt = row.unsqueeze(0).expand(Tq, -1)
    out = []

    def timed(stage, fn):
        t, mode = time_calls(lambda: fn(), [()], reps=10)
        out.append(("qsa_prefill_paged", f"Tq={Tq}", stage, t))
        print(f"   {stage}: {t:.1f} us ({mode})", flush=True)

    saved_score = launch.SCORE_BLOCK_M, launch.SCORE_BLOCK_N, launch.SCORE_WARPS, launch.SCORE_STACK_HEADS
    # sort keys (our select) and fp32 logits (vLLM's, the default), each head's product or the heads stacked
    for logits in (False, True):
        for stack in (False, True):
            for bm, bn, w in ((64, 64, 4), (128, 64, 8), (64, 128, 4), (128, 128, 8), (32, 64, 4)):
                launch.SCORE_BLOCK_M, launch.SCORE_BLOCK_N, launch.SCORE_WARPS = bm, bn, w
                launch.SCORE_STACK_HEADS = stack
                label = f"scores{' logits' if logits else ''} BLOCK_M={bm} BLOCK_N={bn} warps={w}" + (
                    " stacked heads" if stack else "")
                try:
                    timed(label, lambda: tk.prefill_score_keys(pos, iq, ikv, row, nb, r, isc, logits=logits))
                except Exception as e:  # noqa: BLE001  (out of shared memory / registers)
                    print(f"   {label}: {type(e).__name__}", flush=True)
    launch.SCORE_BLOCK_M, launch.SCORE_BLOCK_N, launch.SCORE_WARPS, launch.SCORE_STACK_HEADS = saved_score
    keys = tk.prefill_score_keys(pos, iq, ikv, row, nb, r, isc)
    saved = launch.TOPK_SMALL_BITS, launch.TOPK_SMALL_MAX
    for way, bits, small_max in (("in-register select, 1 bit a step", 0, saved[1]),
                                 ("in-register select, 2 bits a step", 2, saved[1]),
                                 ("chunked radix select (past TOPK_SMALL_MAX blocks)", saved[0], 0)):
        launch.TOPK_SMALL_BITS, launch.TOPK_SMALL_MAX = bits, small_max
        timed(f"top-k ({way})", lambda: tk.top_ids(keys, m))
    launch.TOPK_SMALL_BITS, launch.TOPK_SMALL_MAX = saved
    sel = tk.top_ids(keys, m)
    same = sel[:1].expand(Tq, -1).contiguous()
    kc, vc = kv[..., :HD], kv[..., HD:]
    timed("attention split + merge", lambda: tk.sparse_attention_slots(q, kc, vc, pos, sel, r, sc, False, bt))
    best = None
    # (slots a loop step, warps): the tuned 128 x 4 and its neighbours, and few-warp programs (upstream's Hopper
    # prefill runs 32 slots on one warp: many small programs resident per SM hide the gathered loads' latency)
    shapes = ((16, 1), (32, 1), (32, 2), (64, 2), (32, 4), (64, 4), (128, 4), (64, 8), (128, 8))
    for pf in (False, True):
        for sb, w in shapes:
            for st in (1, 2, 3):
                launch.LOOP_SLOT_BLOCK, launch.LOOP_WARPS, launch.LOOP_STAGES, launch.LOOP_PREFETCH = sb, w, st, pf
                label = f"SB={sb} warps={w} stages={st}" + (" prefetch" if pf else "")
                try:
                    timed(f"attention loop {label}",
                          lambda: tk.sparse_attention_slots(q, kc, vc, pos, sel, r, sc, False, bt, loop=True))
                except Exception as e:  # noqa: BLE001  (out of shared memory / registers)
                    print(f"   {label}: {type(e).__name__}", flush=True)
                    continue
                if best is None or out[-1][3] < best[0]:
                    best = (out[-1][3], sb, w, st, pf)
    _, launch.LOOP_SLOT_BLOCK, launch.LOOP_WARPS, launch.LOOP_STAGES, launch.LOOP_PREFETCH = best
    timed(f"attention loop (best: SB={best[1]} warps={best[2]} stages={best[3]}{' prefetch' if best[4] else ''}), "
          "same blocks for every query",
          lambda: tk.sparse_attention_slots(q, kc, vc, pos, same, r, sc, False, bt, loop=True))
    timed("whole op (best attention)", lambda: tk.qsa_prefill_paged_triton(q, pos, iq, kv, row, ikv, L, r, budget,
                                                                          sc, isc))
    return out


def decode_breakdown(bw):
    """qsa_decode_paged at batch 1 and 32 (L=50,000, paged, shuffled blocks) by stage: the paged scores, the top-k
    select and the split attention + merge, each over its launch settings (every variant's ids / output checked
    against the default's first); bytes and the fraction of the measured bandwidth beside each. -> rows."""
    from qwen4exp.ops.qsa import host
    from qwen4exp.ops.qsa import launch, triton_kernel as tk
    host.load_vllm_kernels()  # vLLM's CUDA extension (its top-k kernel), where this runs inside the vLLM venv
    out = []

    def timed(B, stage, fn, sets, by=None):
        try:
            t, _ = time_calls(fn, sets)
        except Exception as e:  # noqa: BLE001  (out of registers / shared memory)
            print(f"   B={B} {stage}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            return float("inf")
        frac = f", {by / (t * 1e-6) / bw:.0%} of bandwidth" if by else ""
        out.append(("qsa_decode_paged", f"B={B}", stage, t))
        print(f"   B={B} {stage}: {t:.1f} us{frac}", flush=True)
        return t

    def knobs(mod=launch, **kw):
        saved = {k: getattr(mod, k) for k in kw}
        for k, v in kw.items():
            setattr(mod, k, v)
        return saved

    for B in (1, 32):
        sets, _, _ = paged_qsa_case(B)
        q, pos, iq, kv, bt, ikv, ibt, nb, r, budget, sc, isc = sets[0]
        HD, m, L = q.shape[-1], budget // r, int(pos[0]) + 1
        n_vis = L // r
        score_by = B * n_vis * iq.shape[-1] * 2
        attn_by = B * (budget + r - 1) * kv.shape[1] * HD * 2 * 2

        def score(s, logits=False):
            q, pos, iq, kv, bt, ikv, ibt, nb, r, budget, sc, isc = s
            return tk.paged_score_keys(pos, iq, ikv, ibt, nb, r, isc, logits)

        def score_logits(s):
            return score(s, logits=True)

        want_keys = score(sets[0])
        for bn, w in ((64, 4), (32, 2), (64, 2), (128, 4), (128, 8), (256, 8)):
            saved = knobs(SCORE_PAGED_BLOCK_N=bn, SCORE_PAGED_WARPS=w)
            ok = torch.equal(score(sets[0]), want_keys)
            timed(B, f"scores BLOCK_N={bn} warps={w}{'' if ok else ' WRONG'}", score, [(s,) for s in sets],
                  score_by)
            knobs(**saved)
        keys = [(score(s),) for s in sets]
        want = tk.top_ids(keys[0][0], m).sort(dim=1).values
        for split, w, bits in ((4096, 8, 0), (4096, 4, 0), (4096, 16, 0), (2048, 4, 0), (2048, 8, 0), (8192, 8, 0),
                               (8192, 16, 0), (4096, 8, 2), (2048, 4, 2), (0, 8, 0)):
            saved = knobs(TOPK_SPLIT=split, TOPK_SPLIT_WARPS=w, TOPK_SPLIT_BITS=bits, TOPK_SMALL_BITS=bits)
            ok = torch.equal(tk.top_ids(keys[0][0], m).sort(dim=1).values, want)
            timed(B, f"top-k split={split} warps={w} bits={bits}{'' if ok else ' WRONG'}",
                  lambda kk, m=m: tk.top_ids(kk, m), keys)
            knobs(**saved)
        timed(B, "top-k torch.topk", lambda kk, m=m: tk.top_keys(kk, m), keys)
        if host.vllm_topk_covers(B, m):  # vLLM's CUDA select (inside the vLLM venv): fp32 scores in, ids out
            timed(B, f"scores as fp32 logits BLOCK_N={launch.SCORE_PAGED_BLOCK_N}", score_logits,
                  [(s,) for s in sets],
                  score_by)
            lsets = [(*score_logits(s), s[1]) for s in sets]  # (logits, visible counts, positions)
            got = tk.vllm_top_ids(lsets[0][0], lsets[0][2], r, m, lsets[0][1]).sort(dim=1).values
            agree = (got == want).all(dim=1).float().mean().item()
            timed(B, f"top-k vLLM cooperative_topk (rows equal to the Triton select's: {agree:.0%})",
                  lambda lg, vis, p, r=r, m=m: tk.vllm_top_ids(lg, p, r, m, vis), lsets)
            saved = knobs(host, VLLM_TOPK=True)
            timed(B, "whole op (vLLM's select)", tk.qsa_decode_paged_triton, sets, score_by + attn_by)
            knobs(host, **saved)
            lsets = None
        else:
            print(f"   B={B}: vLLM's cooperative_topk not loaded (run inside the vLLM venv)", flush=True)
        saved = knobs(host, VLLM_TOPK=False)
        timed(B, "whole op (Triton select)", tk.qsa_decode_paged_triton, sets, score_by + attn_by)
        knobs(host, **saved)
        asets = [(s[0], s[3][..., :HD], s[3][..., HD:], s[1], tk.top_ids(kk[0], m), r, s[10], False, s[4])
                 for s, kk in zip(sets, keys)]
        ref = tk.sparse_attention_slots(*asets[0]).float()
        many = B >= launch.ATTN_MANY_QUERIES
        names = ("ATTN_SLOT_BLOCK_MANY", "ATTN_WARPS_MANY", "ATTN_PREFETCH_MANY") if many else (
            "ATTN_SLOT_BLOCK", "ATTN_WARPS", "ATTN_PREFETCH")
        # slots x warps x stages (x programs at batch 32, one-warp programs included) around the defaults
        shapes = ((16, 2), (16, 1), (32, 1), (32, 2)) if many else ((32, 8), (64, 8), (32, 4), (64, 4), (32, 2))
        for sb, w in shapes:
            for st in ((2, 3) if many else (1, 2)):
                for pf in ((True,) if many else (False,)):
                    for progs in ((512, 1024, 2048) if many else (512,)):
                        stage_knob = "ATTN_STAGES_MANY" if many else "ATTN_STAGES"
                        saved = knobs(**dict(zip(names, (sb, w, pf))), **{stage_knob: st}, ATTN_PROGRAMS=progs)
                        try:
                            o = tk.sparse_attention_slots(*asets[0]).float()
                            ok = bool(((o - ref).norm() / ref.norm()) < 1e-2)
                        except Exception as e:  # noqa: BLE001
                            print(f"   B={B} attention {sb}x{w} stages={st}: {type(e).__name__}", flush=True)
                            knobs(**saved)
                            continue
                        timed(B, f"attention+merge SB={sb} warps={w} stages={st} prefetch={pf} programs={progs}"
                              f"{'' if ok else ' WRONG'}", tk.sparse_attention_slots, asets, attn_by)
                        knobs(**saved)
        timed(B, "whole op (defaults)", tk.qsa_decode_paged_triton, sets, score_by + attn_by)
        sets = keys = asets = None
        torch.cuda.empty_cache()
    return out


def profile_once():
    """A few eager calls of each kernel at decode size, for a profiler (ncu) to catch."""
    from qwen4exp.ops.hyper_connection import cuda as hc_cuda
    from qwen4exp.ops.qsa import cuda as qsa_cuda

    for _ in range(2):
        s = hc_mix_case(1)[0][0]
        hc_cuda.hc_mix(*s)
        s = qsa_case(1)[0][0]
        qsa_cuda.qsa_attention(*s)
    torch.cuda.synchronize()


def moe_decode_weights(E=512, D=2560, I=640, device="cuda", gen=None, global_scale=1e-3):
    """Random NVFP4 experts at the model's sizes (the kernels' plain layout; codes and scales random, not from a
    quantizer: the timing does not depend on the values): (w13, w13_scale, w13_gs, w2, w2_scale, w2_gs). 1.4 GB at
    the model's sizes: one copy shared by every input set. Also the layer harness's experts."""
    u8, f8 = torch.uint8, torch.float8_e4m3fn

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=u8, device=device, generator=gen)

    def scales(*shape):
        return (torch.rand(*shape, device=device, generator=gen) + 0.5).to(f8)

    return (codes(E, 2 * I, D // 2), scales(E, 2 * I, D // 16), torch.full((E,), global_scale, device=device),
            codes(E, D, I // 2), scales(E, D, I // 16), torch.full((E,), global_scale, device=device))


def moe_decode_case(M, part, E=512, D=2560, I=640, k=10):
    """The routed MoE at M decode tokens (``part``: "router", "experts" or "both"): each set its own x and random
    top-k, over one copy of the experts (1.4 GB, so a set's experts come from HBM). Bytes: the router weight, the
    distinct selected experts' NVFP4 weights and scales (averaged over the sets), x and the output."""
    W = (torch.randn(E, D, device="cuda") * D ** -0.5).to(BF)
    experts = moe_decode_weights(E, D, I)
    per_expert = 2 * I * D // 2 + 2 * I * D // 16 + D * I // 2 + D * I // 16 + 8
    sets, distinct = [], []
    for _ in range(16):
        x = torch.randn(M, D, device="cuda").to(BF)
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(M)])
        w = torch.softmax(torch.randn(M, k, device="cuda"), -1).to(BF)
        distinct.append(len(set(ids.flatten().tolist())))
        sets.append((x, W, k, True) if part == "router" else (x, *experts, w, ids) if part == "experts" else
                    (x, W, k, *experts))
    by = M * D * 2 * 2 + (E * D * 2 + M * E * 2 if part != "experts" else 0)
    if part != "router":
        by += statistics.mean(distinct) * per_expert
    fl = 2 * M * E * D * (part != "experts") + 2 * M * k * 3 * I * D * (part != "router")
    return sets, by, fl


def moe_decode_both(cuda_mod, x, W, k, *experts):
    _, tw, ids = cuda_mod.router_topk(x, W, k, True)  # (the router's outputs feed the experts, as in the model)
    return cuda_mod.experts_nvfp4(x, *experts, tw, ids)


def moe_decode_both_ref(x, W, k, *experts):
    from qwen4exp.ops.moe_decode import reference as md_ref
    _, tw, ids = md_ref.router_topk(x, W, k, True)
    return md_ref.experts_nvfp4(x, *experts, tw, ids)


# ---------------------------------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="bench_out/bench_ops.csv")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-ref", action="store_true", help="time the kernels only (knob sweeps)")
    ap.add_argument("--attn-sweep", action="store_true", help="also the decode attention's launch-setting sweep")
    ap.add_argument("--only", default="")
    ap.add_argument("--tune", action="store_true",
                    help="first sweep the launch shapes of hc_mix and qsa (kept for the table), time their stages")
    ap.add_argument("--profile-once", action="store_true", help="only run each kernel twice (for ncu)")
    ap.add_argument("--decode-breakdown", action="store_true",
                    help="qsa_decode_paged by stage over launch settings, batch 1 and 32")
    ap.add_argument("--tune-prefill", action="store_true",
                    help="first time qsa_prefill_paged by stage and sweep its attention kernel's launch shapes")
    args = ap.parse_args()
    if args.profile_once:
        return profile_once()
    from qwen4exp.ops.hyper_connection import cuda as hc_cuda  # (each imports its Triton kernels)
    from qwen4exp.ops.moe_combine import cuda as moe_cuda
    from qwen4exp.ops.norm import cuda as norm_cuda
    from qwen4exp.ops.rope import cuda as rope_cuda

    dev = torch.cuda.get_device_name()
    bw = measure_bandwidth()
    print(f"device {dev}; measured HBM bandwidth (d2d copy, read+write) {bw / 1e12:.2f} TB/s", flush=True)
    with _registry.record():  # (the kernel modules keep their launches for the registers / spills lines)
        stages = tune_and_breakdown() if args.tune else []
    if args.tune_prefill:
        stages += prefill_breakdown()
    if args.decode_breakdown:
        stages += decode_breakdown(bw)
    only = set(filter(None, args.only.split(",")))
    cases = []
    for T in (1, 8, 16, 32, 16384):  # as dispatched (16384: a prefill chunk: cuBLAS projections + norm / gate-mean)
        cases.append(("hc_mix", f"T={T}", lambda T=T: hc_mix_case(T), hc_cuda.hc_mix, hc_ref.hc_mix))
    for T in (8, 16, 32):  # decode / verify sizes both ways: the two fused launches and the many-token path
        cases.append(("hc_mix", f"T={T},fused", lambda T=T: hc_mix_case(T), hc_cuda.hc_mix_op, hc_ref.hc_mix))
        cases.append(("hc_mix", f"T={T},gemm-path", lambda T=T: hc_mix_case(T), hc_cuda.mix_many_tokens,
                      hc_ref.hc_mix))
    for T in (1, 32):
        cases.append(("hc_inject", f"T={T}", lambda T=T: hc_inject_case(T), hc_cuda.hc_inject, hc_ref.hc_inject))
    from qwen4exp.ops.hyper_connection import host as hc_host, triton_kernel as hc_tk
    for T in (1, 2, 4, 8, 32):  # one HC transition (write-back + mixer) both ways, side by side
        mk = lambda T=T: hc_step_case(T)  # noqa: E731
        if T == 1:  # the finish kernel at one token too (3 launches), against B's programs summing the partials
            cases.append(("hc_step", f"T={T},inject_norm+mix,finish-kernel", mk,
                          with_knobs(hc_step_fused_norm, hc_tk, IN_KERNEL_SILU_MAX_T=0), hc_step_ref))
        if T in (2, 4):  # MTP verification sizes: the run-30 default (every B program sums the partials) and cuBLAS
            cases.append(("hc_step", f"T={T},inject_norm+mix,in-kernel-finish,BD16", mk,
                          with_knobs(hc_step_fused_norm, hc_tk, IN_KERNEL_SILU_MAX_T=4, B_BLOCK_D=16), None))
            cases.append(("hc_step", f"T={T},inject_norm+gemm-path", mk,
                          lambda *a: hc_step_fused_norm(*a, many=True), hc_step_ref))
        if T <= 8:  # kernel A's last program of each row block finishes the down projection (no finish kernel,
            # no partials re-read by B): QWEN4EXP_HC_DECODE=fused-ticket, B's tile as the default's and the other one
            ticket = with_env(hc_step_fused_norm, QWEN4EXP_HC_DECODE="fused-ticket")
            cases.append(("hc_step", f"T={T},inject_norm+mix,ticket", mk, ticket, hc_step_ref))
            cases.append(("hc_step", f"T={T},inject_norm+mix,ticket,BD16", mk,
                          with_knobs(ticket, hc_tk, B_BLOCK_D=16, B_BLOCK_D_MANY=16), None))
            cases.append(("hc_step", f"T={T},inject+mix(own norm),ticket", mk,
                          with_env(with_knobs(hc_step_before, hc_host, IN_KERNEL_NORM_MAX_T=1 << 30),
                                   QWEN4EXP_HC_DECODE="fused-ticket"), hc_step_ref))
        cases.append(("hc_step", f"T={T},inject+mix(own norm)", mk,
                      with_knobs(hc_step_before, hc_host, IN_KERNEL_NORM_MAX_T=1 << 30), hc_step_ref))
        cases.append(("hc_step", f"T={T},inject+mix", mk, hc_step_before, None))  # (norm kernel first past 4)
        cases.append(("hc_step", f"T={T},inject_norm+mix", mk, hc_step_fused_norm, hc_step_ref))
        if T == 32:
            cases.append(("hc_step", "T=32,inject+gemm-path", mk, lambda *a: hc_step_before(*a, many=True), None))
            cases.append(("hc_step", "T=32,inject_norm+gemm-path", mk,
                          lambda *a: hc_step_fused_norm(*a, many=True), None))
            cases.append(("hc_step", "T=32,inject_norm+mix,KC256", mk,
                          with_knobs(hc_step_fused_norm, hc_tk, A_KC_HN=256), None))
        for bd in (16, 32):
            cases.append(("hc_step", f"T={T},inject_norm+mix,BD{bd}", mk,
                          with_knobs(hc_step_fused_norm, hc_tk, B_BLOCK_D=bd, B_BLOCK_D_MANY=bd), None))
    from qwen4exp.ops.ple import cuda as ple_cuda
    from qwen4exp.ops.qsa import cuda as qsa_cuda
    for Tq in (1, 32):
        cases.append(("qsa_attention", f"Tq={Tq},L=50000", lambda Tq=Tq: qsa_case(Tq), qsa_cuda.qsa_attention,
                      qsa_ref.qsa_attention))
    for B in (1, 32):
        cases.append(("qsa_decode_paged", f"B={B},L=50000,paged", lambda B=B: paged_qsa_case(B),
                      qsa_cuda.qsa_decode_paged, qsa_ref.qsa_decode_paged))
    # a 10k-token context (the agentic benchmark's max_model_len: 2,560 blocks, the 4,096-key top-k variant)
    cases.append(("qsa_decode_paged", "B=1,L=10240,paged", lambda: paged_qsa_case(1, L=10_240),
                  qsa_cuda.qsa_decode_paged, qsa_ref.qsa_decode_paged))
    from qwen4exp.ops.qsa import launch as qsa_launch
    # the decode attention's launch settings side by side (the rest of the op is the same in every variant)
    sweep = [(1, dict(ATTN_PREFETCH=True)), (32, dict(ATTN_PREFETCH_MANY=False)),
             (1, dict(ATTN_SLOT_BLOCK=64)), (1, dict(ATTN_SLOT_BLOCK=16, ATTN_WARPS=4))]
    sweep += [(32, dict(ATTN_SLOT_BLOCK_MANY=sb, ATTN_WARPS_MANY=w, ATTN_PROGRAMS=p))
              for sb, w, p in ((16, 4, 1024), (16, 2, 512), (16, 1, 1024), (32, 2, 1024), (32, 4, 512),
                               (32, 8, 512), (64, 8, 512))]
    for B, knobs in sweep if args.attn_sweep else ():
        name = ",".join(f"{k.removeprefix('ATTN_').lower()}={v}" for k, v in knobs.items())
        cases.append(("qsa_decode_paged", f"B={B},L=50000,{name}", lambda B=B: paged_qsa_case(B),
                      with_knobs(qsa_cuda.qsa_decode_paged, qsa_launch, **knobs), None))  # (no reference timing again)
    for Tq in (4, 4096):
        cases.append(("qsa_prefill_paged", f"Tq={Tq},L=50000,paged", lambda Tq=Tq: prefill_qsa_case(Tq),
                      qsa_cuda.qsa_prefill_paged, qsa_ref.qsa_prefill_paged))
    for shape, group in (((1, 24, 256), 256), ((32, 24, 256), 256), ((32, 10240), 2560)):
        cases.append(("rms_norm", "x".join(map(str, shape)) + f"/{group}", lambda a=shape, g=group: rms_norm_case(a, g),
                      norm_cuda.rms_norm, norm_ref.grouped_rms_norm))
    for T in (1, 32):  # the fused norm + RoPE and the two kernels it replaces
        cases.append(("norm_rope", f"T={T},24x256,R=64", lambda T=T: norm_rope_case(T), rope_cuda.norm_rope,
                      rope_ref.norm_rope))
        cases.append(("norm_rope", f"T={T},24x256,R=64,two-kernels", lambda T=T: norm_rope_case(T), norm_then_rope,
                      None))
    for T in (1, 32):
        cases.append(("shared_gate_combine", f"T={T},D=2560", lambda T=T: moe_combine_case(T),
                      moe_cuda.shared_gate_combine, moe_ref.shared_gate_combine))
    # the MoE decode kernels (issue 50 item 3; QWEN4EXP_MOE_DECODE, off in serving, on for this run), M = 1..4
    os.environ["QWEN4EXP_MOE_DECODE"] = "1"
    from qwen4exp import envs
    envs.reset()
    from qwen4exp.ops.moe_decode import cuda as md_cuda, reference as md_ref, triton_kernel as md_tk
    for M in (1, 2, 3, 4):
        cases.append(("moe_router", f"M={M},512x2560,top10", lambda M=M: moe_decode_case(M, "router"),
                      md_cuda.router_topk, md_ref.router_topk))
        cases.append(("moe_experts", f"M={M},nvfp4,top10", lambda M=M: moe_decode_case(M, "experts"),
                      md_cuda.experts_nvfp4, md_ref.experts_nvfp4))
        cases.append(("moe_decode", f"M={M},router+experts", lambda M=M: moe_decode_case(M, "both"),
                      lambda *a: moe_decode_both(md_cuda, *a), moe_decode_both_ref))
    for M in (1, 4):  # launch settings of the expert kernels (rows a program; experts a down program)
        # DECODE=select: the first design's NVFP4 decode (run 31's 55 us at M = 1), for the A/B with shift's
        for knobs in (dict(DECODE="select"), dict(W13_BLOCK_N=4), dict(W13_BLOCK_N=16), dict(W13_BLOCK_K=256),
                      dict(W13_BLOCK_K=1024), dict(W13_BLOCK_K=1024, W13_WARPS=8),
                      dict(W13_BLOCK_N=4, W13_BLOCK_K=1024), dict(W2_EXPERTS=1), dict(W2_EXPERTS=5),
                      dict(W2_EXPERTS=10), dict(W2_BLOCK_N=16), dict(W2_BLOCK_N=64), dict(W2_BLOCK_K=256),
                      dict(W2_BLOCK_K=64), dict(W2_BLOCK_N=64, W2_BLOCK_K=256), dict(W13_WARPS=8, W2_WARPS=8),
                      dict(W13_WARPS=2, W2_WARPS=2)):
            name = ",".join(f"{a.lower()}={b}" for a, b in knobs.items())
            cases.append(("moe_experts", f"M={M},{name}", lambda M=M: moe_decode_case(M, "experts"),
                          with_knobs(md_cuda.experts_nvfp4, md_tk, **knobs), None))
        for knobs in (dict(ROUTER_BLOCK_E=2), dict(ROUTER_BLOCK_E=8), dict(ROUTER_BLOCK_D=256)):
            name = ",".join(f"{a.lower()}={b}" for a, b in knobs.items())
            cases.append(("moe_router", f"M={M},{name}", lambda M=M: moe_decode_case(M, "router"),
                          with_knobs(md_cuda.router_topk, md_tk, **knobs), None))
    for T in (1, 32):
        cases.append(("apply_rope", f"T={T},24x256,R=64", lambda T=T: rope_case(T), rope_cuda.apply_rope,
                      rope_ref.apply_rope))
    for T in (1, 32):
        cases.append(("ple_lookup", f"T={T},fp8,pinned-host", lambda T=T: ple_case(T, "pinned"),
                      ple_cuda.ple_lookup, ple_ref_host))
        cases.append(("ple_lookup", f"T={T},fp8,gpu", lambda T=T: ple_case(T, "gpu"), ple_cuda.ple_lookup,
                      ple_ref.ple_lookup))
    for T in (1, 32):
        cases.append(("ngram_lookup_decode", f"T={T},fp8,pinned-host", lambda T=T: ngram_lookup_case(T, "pinned"),
                      ple_cuda.ngram_lookup_decode, ple_ref.ngram_lookup_decode))
    from qwen4exp.ops.ple import triton_kernel as ple_tk
    for T in (1, 32):
        cases.append(("ple_mix", f"T={T},4x2560,K=4,dil=3", lambda T=T: ple_mix_case(T), ple_cuda.ple_mix,
                      ple_ref.ple_mix))
        # the decode kernel's launch settings: programs (1 << 20: one channel block a program),
        # channels a block, warps
        for progs, bc, w in ((1 << 20, 512, 8), (264, 512, 8), (132, 256, 8), (264, 256, 4), (528, 256, 4),
                             (132, 512, 4), (264, 128, 4)):
            cases.append(("ple_mix", f"T={T},4x2560,K=4,dil=3,programs={progs},block_c={bc},warps={w}",
                          lambda T=T: ple_mix_case(T),
                          with_knobs(ple_cuda.ple_mix, ple_tk, MIX_PROGRAMS=progs, MIX_BLOCK_C=bc, MIX_WARPS=w), None))
    from qwen4exp.ops import gated_delta_rule as gdn
    gdn_kernels = gdn.KERNELS.table("cuda")  # fla's (the HF path's kernels; vLLM has its own copy), where importable
    if gdn_kernels:
        for B in (1, 32):
            cases.append(("gdn_recurrent", f"B={B},16/48x128", lambda B=B: gdn_case([1] * B),
                          gdn_kernels["recurrent_gated_delta_rule"], gdn.reference.recurrent_gated_delta_rule))
        cases.append(("gdn_chunk", "T=16384,16/48x128", lambda: gdn_case([16384]),
                      gdn_kernels["chunk_gated_delta_rule"], gdn.reference.chunk_gated_delta_rule))
    rows = []
    for op, case, make, kern, ref in cases:
        if only and op not in only:
            continue
        print(f"-- {op} {case}", flush=True)
        sets, by, fl = make()
        tk, mk = time_calls(kern, sets)
        host_sync = op in ("qsa_attention", "qsa_prefill_paged", "gdn_chunk")  # these references sync with the host
        # (the NVFP4 reference builds its E2M1 table from a host list each call: no CUDA graph)
        ref_graph = not host_sync and "pinned" not in case and op not in ("moe_experts", "moe_decode")
        if args.no_ref:
            ref = None
        tr, mr = time_calls(ref, sets, graph=ref_graph) if ref is not None else (float("nan"), "-")
        tc, mc = float("nan"), "-"
        if (not args.no_compile and ref is not None and "pinned" not in case and "no-L2" not in case
                and op not in ("qsa_prefill_paged", "gdn_chunk", "moe_experts", "moe_decode")):
            try:
                comp = torch.compile(ref, dynamic=False)
                tc, mc = time_calls(comp, sets, graph=ref_graph)
            except Exception as e:  # noqa: BLE001
                print(f"   (torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:90]})", flush=True)
        row = dict(op=op, case=case, kernel_us=tk, kernel_mode=mk, ref_us=tr, ref_mode=mr, compile_us=tc,
                   compile_mode=mc, bytes=by, flops=fl, gbps=by / (tk * 1e-6) / 1e9,
                   frac_hbm=by / (tk * 1e-6) / bw, speedup_ref=tr / tk, speedup_compile=tc / tk)
        rows.append(row)
        print("   " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        del sets
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    if stages:
        with open(os.path.splitext(args.csv)[0] + "_stages.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["op", "case", "stage", "us"])
            w.writerows(stages)
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    print(f"\n{dev}, HBM copy bandwidth {bw / 1e12:.2f} TB/s; times in us per call (median; g = CUDA-graph replay, "
          f"e = eager)")
    hdr = (f"| {'op':<16} | {'case':<22} | {'kernel us':>10} | {'ref us':>10} | {'compile us':>10} | {'bytes':>10} | "
           f"{'GFLOP':>7} | {'GB/s':>7} | {'% HBM':>6} | {'x ref':>6} | {'x compile':>9} |")
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for r in rows:
        print(f"| {r['op']:<16} | {r['case']:<22} | {r['kernel_us']:>8.2f} {r['kernel_mode'][0]} | "
              f"{r['ref_us']:>8.2f} {r['ref_mode'][0]} | {r['compile_us']:>8.2f} {r['compile_mode'][0]} | "
              f"{r['bytes']:>10.3g} | {r['flops'] / 1e9:>7.3f} | {r['gbps']:>7.1f} | {100 * r['frac_hbm']:>5.1f}% | "
              f"{r['speedup_ref']:>6.2f} | {r['speedup_compile']:>9.2f} |")


if __name__ == "__main__":
    main()
