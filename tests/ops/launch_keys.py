"""Which compiled variants (Triton's own cache keys) the QSA serving path launches, against those its start-up
warm-up launches: on the CPU, with nothing compiled and nothing run.

Triton compiles a kernel once per key: the argument types, the constexprs, the launch options, and the value
specialisation of the other arguments (an integer equal to 1 becomes a constant, one divisible by 16 is marked so, a
pointer 16-byte aligned is marked so; unless the kernel's ``do_not_specialize`` / ``do_not_specialize_on_alignment``
name it). A launch whose key the warm-up did not produce compiles while serving (vLLM's JIT monitor: "Triton kernel
JIT compilation during inference"). Here every launch of our kernels is bound by Triton's own binder for an sm_90
target (``create_function_from_signature``, the code ``JITFunction.run`` uses) and keyed by ``compute_cache_key``;
the kernel itself is not launched (the host code runs on CPU tensors of the real shapes, strides and offsets).

The warm-up is ``QSAMixer._warm_up`` (``qwen4exp/vllm/qsa.py``): ``warm_up_prefill``, ``warm_up_decode`` and one
block-key norm + RoPE of 16 blocks. The serving calls follow the call sites of ``QSAMixer.eager_forward``: prefill
chunks of any length at any row of the step (``q[s:e]``, ``positions[s:e]``, ``block_table[b]``), the sharing MTP
draft layer's select of a chunk's last query, the decode rows of mixed steps (``_decode_batch``), uniform decode and
MTP verification batches run eagerly (``_decode_step``: ``q[:n]``, ``block_table[:B]``, rows repeated per query),
draft steps reusing a selection, and the block keys a step completes (any count). Pure-decode batches inside a
captured CUDA graph compile at the capture, at start-up, and are not part of this.

    PYTHONPATH=.cache/triton python tests/ops/launch_keys.py [--quick] [--json OUT]

exits 1 (and prints each key, parameter by parameter, in the form of vLLM's ``--jit-monitor-verbose`` details) when
a serving launch's key is not among the warm-up's. ``tests/ops/test_launch_keys.py`` runs it. On a GPU machine,
``python3 tests/ops/launch_keys.py --gpu [--quick]`` runs the same warm-up and calls for real (FN-24L widths) and
lists what Triton compiled after the warm-up (its post-compile hook, which vLLM's JIT monitor uses).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

BF = torch.bfloat16
TARGET = ("cuda", 90, 32)


# ------------------------------------------------------------------------------------------------- the recorder
@contextlib.contextmanager
def launch_keys():
    """``with launch_keys() as seen: ...``: every launch of a ``qwen4exp`` Triton kernel inside the block is recorded,
    not run: ``seen[kernel name][cache key] = readable key`` (Triton's key of the compiled variant it would use)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    backend = CUDABackend(GPUTarget(*TARGET))
    binders, seen = {}, {}
    orig = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not self.fn.__module__.startswith("qwen4exp."):
            return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        # (as JITFunction.run builds its options)
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = binders.get(self)
        if binder is None:
            binder = binders[self] = create_function_from_signature(self.signature, self.params, backend)
        _, spec, options = binder(*args, **kwargs)
        key = compute_cache_key({}, spec, options)
        if key not in seen.setdefault(self.fn.__name__, {}):
            names = [p.name for p in self.params]
            seen[self.fn.__name__][key] = (", ".join(f"{n}={s[0]}{'' if s[1] in (None, '') else ':' + str(s[1])}"
                                                     for n, s in zip(names, spec))
                                           + f" | {dict((k, v) for k, v in options.items() if k.startswith('num_'))}")
        return None

    JITFunction.run = run
    try:
        yield seen
    finally:
        JITFunction.run = orig


# ---------------------------------------------------------------------------------------------- model + engine
@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    Hq: int = 24  # FN-24L: 24 query heads, 2 KV heads of 256, indexer 4 x 128, r = 4, budget 2048
    Hkv: int = 2
    HD: int = 256
    HI: int = 4
    DI: int = 128
    RD: int = 64  # rotary dims of the index keys
    r: int = 4
    budget: int = 2048
    block_size: int = 1568  # vLLM's (hybrid: the attention block size that matches the state pages)
    page_pad: int = 4104  # elements past the layer's rows in each block's page (vLLM pads pages to one size)
    max_len: int = 50_320  # max_model_len (bench_vllm_gpu.py: ctx + 320)
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 16_384
    cache_dtype: torch.dtype = BF

    @property
    def max_rows(self):  # QSAMixer._max_rows
        return min(self.max_num_batched_tokens, 8 * self.max_num_seqs)


CONFIGS = (Config("FN-24L"),
           Config("FN-24L fp8 cache", cache_dtype=torch.float8_e4m3fn, block_size=784, page_pad=0),
           Config("FN-24L budget 4096, 4 KV heads", Hq=32, Hkv=4, budget=4096, block_size=1024, page_pad=0),
           Config("small", Hq=6, Hkv=1, HD=64, DI=32, RD=16, budget=64, block_size=16, page_pad=40, max_len=3000,
                  max_num_seqs=8, max_num_batched_tokens=2048))


def caches(cfg: Config, device="cpu"):
    """The layer's one vLLM cache [blocks, Hkv, bs, 2 HD], each block's page holding the index tail (block keys,
    raw-key ring: ``ops.qsa.layout``) and padded past it, and the index view the plugin's readers take
    (``QSAMixer.index_views``)."""
    from qwen4exp.ops.qsa import layout
    rr = layout.ring_rows(cfg.r, 8)
    kv = layout.paged_cache(3, cfg.Hkv, cfg.block_size, cfg.HD, cfg.DI, cfg.r, rr, dtype=cfg.cache_dtype,
                            device=device, pad=cfg.page_pad)
    return kv, layout.index_views(kv, cfg.DI, cfg.r, rr).index_kv


def block_keys(cfg: Config, raw: torch.Tensor):
    """``QSAAttention.block_keys(block_mean(raw, r), cos, sin)`` by the kernels its CUDA path runs (the index-key norm,
    then RoPE at each block's first position: table rows gathered, as ``RotaryEmbedding`` serves them)."""
    from qwen4exp.ops.norm import triton_kernel as ntk
    from qwen4exp.ops.qsa.reference import block_mean
    from qwen4exp.ops.rope import triton_kernel as rtk
    pooled = block_mean(raw, cfg.r)
    nb, dev = pooled.shape[0], raw.device
    table = torch.zeros(cfg.max_len, cfg.RD, dtype=BF, device=dev)
    first = torch.arange(0, nb * cfg.r, cfg.r, device=dev) % cfg.max_len
    cos, sin = table[first], table[first]
    return rtk.apply_rope_triton(ntk.rms_norm_triton(pooled, torch.zeros(cfg.DI, dtype=BF, device=dev), cfg.DI, 1e-6)
                                 .unsqueeze(1), cos, sin).squeeze(1)


def warm_up(cfg: Config, kv, ikv):
    """What ``QSAMixer._warm_up`` launches."""
    from qwen4exp.ops.qsa import triton_kernel as tk
    sc, isc = cfg.HD ** -0.5, cfg.DI ** -0.5
    cases = tk.warm_up_prefill(kv, ikv, cfg.Hq, cfg.HI, cfg.max_len, cfg.r, cfg.budget, sc, isc, BF)
    cases += tk.warm_up_decode(kv, ikv, cfg.Hq, cfg.HI, cfg.max_len, cfg.max_rows, cfg.r, cfg.budget, sc, isc, BF)
    assert cases, f"{cfg.name}: the warm-up ran nothing"
    block_keys(cfg, torch.zeros(16 * cfg.r, cfg.DI, dtype=BF, device=kv.device))


class Step:
    """One engine step's tensors as vLLM hands them to ``QSAMixer.eager_forward``: the projections of n tokens
    (the norm + RoPE kernels' outputs: dense), the persistent positions buffer, the block table of every request
    slot, each row's slice views taken at the request's offset."""

    def __init__(self, cfg: Config, n: int, device="cpu"):
        new = torch.empty if str(device) == "cpu" else torch.zeros  # (values unused on the CPU: nothing runs)
        self.q = new(n, cfg.Hq, cfg.HD, dtype=BF, device=device)
        self.iq = new(n, cfg.HI, cfg.DI, dtype=BF, device=device)
        self.positions = torch.zeros(cfg.max_num_batched_tokens + 16, dtype=torch.long, device=device)[:n]
        self.block_table = torch.zeros(cfg.max_num_seqs, -(-cfg.max_len // cfg.block_size), dtype=torch.int32,
                                       device=device)


def serve(cfg: Config, kv, ikv, quick: bool):
    """The QSA launches of serving steps (``QSAMixer.eager_forward``'s call sites), over lengths, row counts and
    offsets that reach every launch setting: see the module docstring."""
    from qwen4exp.ops.qsa import launch, reference as ref, triton_kernel as tk
    rng = random.Random(0)
    dev = kv.device
    r, budget, m = cfg.r, cfg.budget, cfg.budget // cfg.r
    sc, isc = cfg.HD ** -0.5, cfg.DI ** -0.5
    max_blocks = cfg.max_len // r
    # block counts on both sides of every point where a launch changes, and a spread between
    edges = {1, m - 1, m, m + 1, 2 * m, launch.TOPK_SMALL_MIN, launch.TOPK_SPLIT, launch.TOPK_SMALL_MAX, max_blocks}
    edges |= {e + d for e in list(edges) for d in (-1, 1)} | {1 << k for k in range(1, 18)}
    lens = sorted({max(1, min(cfg.max_len, nb * r + t)) for nb in edges for t in (0, r - 1)}
                  | {rng.randint(1, cfg.max_len) for _ in range(10 if quick else 40)})
    rows = sorted({*range(1, 34), 63, 64, 65, 127, 128, 129, 255, 256, 257, 4 * cfg.max_num_seqs,
                   cfg.max_rows} - {0})
    rows = [b for b in rows if b <= cfg.max_rows]
    tqs = sorted({*range(9, 20), 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 2689, 3617,
                  cfg.max_num_batched_tokens})
    # 1. prefill chunks (longer than BATCHED_MAX_QUERIES), at the request's offset in the step
    for L in lens:
        for Tq in rng.sample(tqs, 4 if quick else 8):
            Tq = min(Tq, L, cfg.max_num_batched_tokens)
            s = rng.choice((0, 1, 3, 8, rng.randint(0, cfg.max_num_batched_tokens - Tq)))
            st = Step(cfg, s + Tq, dev)
            st.positions[s:] = torch.arange(L - Tq, L, device=dev)
            b = rng.randrange(cfg.max_num_seqs)
            tk.qsa_prefill_paged_triton(st.q[s:], st.positions[s:], st.iq[s:], kv, st.block_table[b], ikv, L, r,
                                        budget, sc, isc)
            # the sharing MTP draft layer: the chunk's last query's selection
            tk.qsa_select_paged_triton(st.positions[-1:], st.iq[-1:], ikv, st.block_table[b:b + 1],
                                       max(1, L // r), r, budget, isc)
    # 2. single-query rows: mixed steps' decode rows (gathered), uniform decode / MTP verification run eagerly
    #    (leading rows of the step, block-table rows repeated per query), draft steps reusing a selection
    for B in rows:
        for L in rng.sample(lens, 3 if quick else 6):
            n_blocks = max(1, L // r)
            st = Step(cfg, B + 5, dev)
            idx = torch.randperm(B + 5, device=dev)[:B]
            owner = torch.randint(0, cfg.max_num_seqs, (B,), device=dev)
            pos = torch.full((B,), L - 1, device=dev)
            tk.qsa_decode_paged_triton(st.q[idx], pos, st.iq[idx], kv, st.block_table[owner], ikv,
                                       st.block_table[owner], n_blocks, r, budget, sc, isc)
            for nq in {1, 2, 4, 8} & {d for d in range(1, 9) if B % d == 0}:
                nr = B // nq
                if nr > cfg.max_num_seqs:
                    continue
                bt = st.block_table[:nr] if nq == 1 else st.block_table[:nr].repeat_interleave(nq, 0)
                tk.qsa_decode_paged_triton(st.q[:B], pos, st.iq[:B], kv, bt, ikv, bt, n_blocks, r, budget, sc,
                                           isc)
            kept = torch.full((B, m), -1, dtype=torch.int32, device=dev)
            ids = ref.reused_block_ids(kept, pos, r)
            tk.qsa_attend_paged_triton(st.q[:B], pos, kv, st.block_table[owner], ids, r, sc)
    # 3. the block keys a step completes (one per r tokens of its prompts, one for a decode row ending a block)
    for nb in sorted({*range(1, 40), 63, 64, 65, 100, 1023, 1024, 4096, 4097}):
        block_keys(cfg, torch.zeros(nb * r, cfg.DI, dtype=BF, device=dev))


def compare(cfg: Config, vllm_select: bool, quick: bool) -> dict:
    """{kernel: {"warm": n keys, "serve": n keys, "missing": [readable keys]}} for one config (vLLM's select loaded
    or not: which select a few-row decode runs)."""
    from qwen4exp.ops.qsa import host, triton_kernel as tk
    loaded, vllm_ids = host.vllm_topk_loaded, tk.vllm_top_ids
    host.vllm_topk_loaded = lambda: vllm_select
    tk.vllm_top_ids = lambda lg, q_pos, r, m, visible=None: torch.full((lg.shape[0], m), -1, dtype=torch.int32,
                                                                      device=lg.device)
    try:
        kv, ikv = caches(cfg)
        with launch_keys() as warm:
            warm_up(cfg, kv, ikv)
        with launch_keys() as served:
            serve(cfg, kv, ikv, quick)
    finally:
        host.vllm_topk_loaded, tk.vllm_top_ids = loaded, vllm_ids
    out = {}
    for name in sorted(set(warm) | set(served)):
        w, s = warm.get(name, {}), served.get(name, {})
        out[name] = dict(warm=len(w), serve=len(s), missing=[s[k] for k in s if k not in w])
    return out


CAPTURE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)  # vLLM's default CUDA-graph capture sizes (max_num_seqs 32: up to 128)


def hc_compare() -> dict:
    """The hyper-connection mixer's decode launches (``hc_mix_triton``, with and without the injection weights and
    the norm handed in) at the real widths (n 4, D 2560, rank 320): the start-up runs the step at vLLM's capture
    sizes (dummy runs and graph captures), serving at every token count its decode path takes (MTP: a multiple of
    4 for any number of requests, mixed steps: anything)."""
    from qwen4exp.ops.hyper_connection import host as hc_host, triton_kernel as hc_tk
    n, D, R = 4, 2560, 320
    NK = n * D
    down, up, inj = torch.zeros(R, NK, dtype=BF), torch.zeros(NK, R, dtype=BF), torch.zeros(n, NK, dtype=BF)
    nw = torch.zeros(NK, dtype=BF)

    def launches(counts):
        for T in counts:
            H = torch.zeros(T, NK, dtype=BF)
            for wi in (inj, None):
                for Hn in (None, H):
                    if hc_host.decode_covers(H, nw, down, up, wi, n, Hn):
                        hc_tk.hc_mix_triton(H, nw, down, up, wi, n, 1e-6, Hn)

    with launch_keys() as warm:
        launches(CAPTURE_TOKENS)
    with launch_keys() as served:
        launches(range(1, max(CAPTURE_TOKENS) + 1))
    return {name: dict(warm=len(warm.get(name, {})), serve=len(k),
                       missing=[k[x] for x in k if x not in warm.get(name, {})]) for name, k in served.items()}


def on_gpu(quick: bool) -> int:
    """The same warm-up and serving calls run for real on a CUDA GPU (FN-24L, bf16 cache, our select): the kernels
    Triton compiles after the warm-up (its post-compile hook, as vLLM's JIT monitor uses it)."""
    import triton
    cfg, compiled = CONFIGS[0], []
    kv, ikv = caches(cfg, "cuda")
    warm_up(cfg, kv, ikv)
    torch.cuda.synchronize()
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    serve(cfg, kv, ikv, quick)
    torch.cuda.synchronize()
    triton.knobs.runtime.jit_post_compile_hook = None
    print(f"{'FAIL' if compiled else 'OK'}: {len(compiled)} kernel variants compiled after the warm-up on the GPU"
          f"{': ' + ', '.join(sorted(compiled)) if compiled else ''}")
    return 1 if compiled else 0


def sensitivity() -> None:
    """The recorder tells variants apart (a pointer's alignment, an integer's divisibility) and keeps one key for
    what is not specialised: else an empty 'missing' would prove nothing."""
    from qwen4exp.ops.norm import triton_kernel as ntk
    from qwen4exp.ops.qsa import triton_kernel as tk
    w = torch.zeros(128, dtype=BF)
    x = torch.zeros(4 * 128 + 1, dtype=BF)
    with launch_keys() as a:
        ntk.rms_norm_triton(x[:512].view(4, 128), w, 128, 1e-6)
    with launch_keys() as b:
        ntk.rms_norm_triton(x[1:].view(4, 128), w, 128, 1e-6)  # 2-byte offset: not 16-byte aligned
    assert set(a["_rms_norm_kernel"]) != set(b["_rms_norm_kernel"]), "the recorder ignores pointer alignment"
    keys = torch.zeros(2, 64, dtype=torch.int64)
    with launch_keys() as c:
        tk.top_ids(keys[:, :33], 8)
        tk.top_ids(keys[:, :48], 8)  # Nb 33 / 48: not specialised (one key)
    assert len(c["_qsa_topk_small_kernel"]) == 1, c


def report(label: str, res: dict) -> int:
    """Print one comparison's per-kernel counts and missing keys; their number."""
    bad = 0
    for name, r in res.items():
        print(f"{label}: {name}: {r['warm']} warm-up keys, {r['serve']} serving keys, {len(r['missing'])} missing",
              flush=True)
        for k in r["missing"]:
            print(f"    MISSING {name}({k})")
        bad += len(r["missing"])
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer lengths per row count")
    ap.add_argument("--json", help="write the per-config results here")
    ap.add_argument("--gpu", action="store_true", help="run the calls on a CUDA GPU and count real compiles")
    args = ap.parse_args(argv)
    if args.gpu:
        return on_gpu(args.quick)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("launch_keys: run without TRITON_INTERPRET (it binds for sm_90, as a GPU run does)")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    sensitivity()
    results, bad = {}, 0
    for cfg in CONFIGS:
        for vllm_select in (False, True):
            label = f"{cfg.name}, vLLM select {'loaded' if vllm_select else 'not loaded'}"
            bad += report(label, results.setdefault(label, compare(cfg, vllm_select, args.quick)))
    bad += report("hyper-connection mixer", results.setdefault("hyper-connection mixer, FN widths", hc_compare()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"{'FAIL' if bad else 'OK'}: {bad} serving launch keys the warm-up does not compile")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
