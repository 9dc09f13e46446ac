"""Run an offline ``vllm.LLM`` over token-id prompts in a clean subprocess (tests, benchmarks).

    python tools/vllm_offline.py spec.json out.pt [--tensor-parallel-size N]
    from vllm_offline import run_offline   # (tools/ on sys.path) run_offline(spec, workdir) -> the out dict

spec: {"model": dir, "engine": {LLM kwargs}, "env": {extra environment} (run_offline only),
       "sampling": {SamplingParams kwargs}, "prompts": [[ids], ...],
       "batches": [[prompt indices], ...] (default: all at once), "full_prompt_logprobs": bool,
       "prompt_top1": bool (with sampling prompt_logprobs >= 1: the rank-1 token id at every prompt position),
       "tp_layout": bool (every worker's TP rank, layer partition sizes and parameter sums: ``tp_layout``),
       "params": [regex, ...] (copies of the parameters whose names match, per worker: ``param_dump``),
       "warmup": bool (untimed short generate first)}
out (torch.save): {"tokens": [[ids]...], "logprobs": [[{id: logprob} per generated token]] or None (sampling
       "logprobs": k), "prompt_logprobs": [tensor [L-1, V] or None],
       "prompt_top1": [[ids of positions 1..L-1]] or None, "tp_layout": [per rank] or None, "params": [per rank
       {name: tensor}] or None, "startup_s", "run_s",
       "metrics" (counters/gauges when disable_log_stats=False), "num_preemptions", "kv_cache_groups",
       "kv_cache_block_sizes"; run_offline adds "log": the subprocess's stdout + stderr}

Tensor parallelism (``--tensor-parallel-size`` or engine ``tensor_parallel_size``): one worker process per rank
(vLLM's "mp" executor). On CPU vLLM binds each rank's OpenMP threads to the cores of one NUMA node
(``VLLM_CPU_OMP_THREADS_BIND=auto``) and refuses more ranks than NUMA nodes ("Not enough allowed NUMA nodes"); there
``_main`` splits this process's allowed cores among the ranks (``qwen4exp.serve.cpu_threads_bind``, as
``qwen4exp-serve`` does) unless the variable is set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


# QWEN4EXP_TEST_GPU_SHARE=1 (tools/gpu_device.sh suite with SUITE_SHARE=1: the suite's parts at once on one GPU):
# every test engine on a CUDA GPU asks for a small share of the GPU and a fixed KV cache, so that vLLM skips its
# memory profiling (whose check fails when another process frees GPU memory meanwhile) and several engines fit.
SHARE_GPU_UTIL, SHARE_KV_BYTES = 0.2, 4 << 30


def gpu_share() -> bool:
    import torch

    return os.environ.get("QWEN4EXP_TEST_GPU_SHARE", "0") == "1" and torch.cuda.is_available()


def shared_engine(engine: dict) -> dict:
    """``engine`` (vLLM engine arguments) with the GPU-share settings when QWEN4EXP_TEST_GPU_SHARE=1 on CUDA."""
    if gpu_share():
        engine = dict(engine, gpu_memory_utilization=min(float(engine.get("gpu_memory_utilization", 0.9)),
                                                           SHARE_GPU_UTIL), kv_cache_memory_bytes=SHARE_KV_BYTES)
    return engine


def shared_serve_args(args: list[str]) -> list[str]:
    """``vllm serve`` arguments with the GPU-share settings (as ``shared_engine``)."""
    if gpu_share():
        args = [*args, "--gpu-memory-utilization", str(SHARE_GPU_UTIL), "--kv-cache-memory-bytes",
                str(SHARE_KV_BYTES)]
    return args


def run_offline(spec: dict, workdir: str, timeout: float = 600) -> dict:
    """Run ``spec`` in a subprocess (in-process engine, CPU defaults) and return its results."""
    import torch

    spec = dict(spec, engine=shared_engine(spec.get("engine", {})))
    os.makedirs(workdir, exist_ok=True)
    sp, out = os.path.join(workdir, "spec.json"), os.path.join(workdir, "out.pt")
    with open(sp, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, **spec.pop("env", {}))
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("QWEN4EXP_CACHE_DIR", os.path.join(workdir, "cache"))
    env.setdefault("TMPDIR", workdir)
    # GPUs: vLLM's FlashInfer top-k/top-p sampler is JIT-built on a fresh machine (~2 min per start-up); these runs
    # sample greedily or read logprobs, which the torch sampler serves
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # every eager QSA step on a GPU checks the host lengths it takes from vLLM's metadata against the device's
    env.setdefault("QWEN4EXP_QSA_HOST_LENGTHS", "check")
    here = os.path.dirname(os.path.abspath(__file__))  # (workers import ``tp_layout`` from here by name)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, os.path.join(here, "vllm_offline.py"), sp, out], env=env, timeout=timeout,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"offline engine failed (rc={p.returncode}):\n{p.stderr[-6000:]}")
    res = torch.load(out, weights_only=False)
    res["log"] = p.stdout + p.stderr  # (vLLM's and the plugin's log lines: what ran)
    return res


def _bind_cpu_ranks(engine: dict) -> None:
    """This process's CPU workers bound as ``qwen4exp-serve`` binds them (``qwen4exp.serve.bind_cpu_workers``)."""
    from qwen4exp.serve import bind_cpu_workers

    bind_cpu_workers(int(engine.get("tensor_parallel_size", 1)) * int(engine.get("pipeline_parallel_size", 1)),
                     os.environ)


_PARTITION_ATTRS = ("num_embeddings_per_partition", "output_size_per_partition", "input_size_per_partition",
                    "intermediate_size_per_partition", "local_num_experts")


def tp_layout(model) -> dict:
    """``LLM.apply_model`` target: how this worker's model is split. ``partitions``: the per-rank sizes vLLM's
    parallel layers record ("<module>.<attr>": int); ``sums``: the fp64 sum of every parameter (a rank's share of
    a sharded tensor; a kernel's zero padding or repacking leaves it unchanged, a weight the CPU linear kernel keeps
    packed elsewhere reads 0)."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    parts = {f"{n}.{a}": getattr(m, a) for n, m in model.named_modules() for a in _PARTITION_ATTRS
             if isinstance(getattr(m, a, None), int)}
    sums = {n: p.detach().sum(dtype=torch.float64).item() for n, p in model.named_parameters()}
    return {"tp_rank": get_tensor_model_parallel_rank(), "tp_size": get_tensor_model_parallel_world_size(),
            "partitions": parts, "sums": sums}


def param_dump(patterns, model) -> dict:
    """``LLM.apply_model`` target (with ``functools.partial``): CPU copies of the parameters whose names match one of
    the regexes ``patterns`` (as the worker holds them after loading and vLLM's weight processing)."""
    import re

    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()
            if any(re.search(pat, n) for pat in patterns)}


def _kv_cache_config(llm):
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    return getattr(getattr(core, "scheduler", None), "kv_cache_config", None)


def kv_cache_groups(llm) -> list[list[str]] | None:
    """The layer names of each KV cache group of an in-process engine (None where the engine core runs elsewhere)."""
    cfg = _kv_cache_config(llm)
    return None if cfg is None else [list(g.layer_names) for g in cfg.kv_cache_groups]


def kv_cache_block_sizes(llm) -> list[int] | None:
    """Tokens per block of each KV cache group (as ``kv_cache_groups``). vLLM derives them from the page size the
    hybrid groups share, which depends on the CPU attention kernels (e.g. 384-token QSA blocks with AVX-512, 256
    without)."""
    cfg = _kv_cache_config(llm)
    return None if cfg is None else [int(g.kv_cache_spec.block_size) for g in cfg.kv_cache_groups]


def _main(spec_path: str, out_path: str, tensor_parallel_size: int | None = None) -> None:
    from qwen4exp.serve import cpu_env

    cpu_env()
    import torch
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    if tensor_parallel_size is not None:
        spec.setdefault("engine", {})["tensor_parallel_size"] = tensor_parallel_size
    _bind_cpu_ranks(spec.get("engine", {}))
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **spec.get("engine", {}))
    startup = time.perf_counter() - t0
    prompts = spec["prompts"]
    batches = spec.get("batches") or [list(range(len(prompts)))]
    sampling = SamplingParams(**spec.get("sampling", {}))
    tokens: list = [None] * len(prompts)
    lps: list = [None] * len(prompts)
    plps: list = [None] * len(prompts)
    top1: list = [None] * len(prompts)
    full = spec.get("full_prompt_logprobs", False)
    want_top1 = spec.get("prompt_top1", False)
    if spec.get("warmup"):  # first calls pay one-off kernel / allocator set-up: keep them out of run_s
        for n in sorted({len(b) for b in batches}):
            llm.generate([{"prompt_token_ids": prompts[i][:16]} for i in range(n)],
                         SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
    t1 = time.perf_counter()
    for batch in batches:
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in batch], sampling, use_tqdm=False)
        for i, o in zip(batch, outs):
            tokens[i] = list(o.outputs[0].token_ids)
            if o.outputs[0].logprobs is not None:
                lps[i] = [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]
            if want_top1 and o.prompt_logprobs is not None:
                top1[i] = [next((t for t, lp in d.items() if lp.rank == 1), -1) for d in o.prompt_logprobs[1:]]
            if full and o.prompt_logprobs is not None:
                pl = o.prompt_logprobs
                V = max(len(d) for d in pl[1:]) if len(pl) > 1 else 0
                t = torch.full((len(pl) - 1, V), float("nan"))
                for j in range(1, len(pl)):
                    for tok, lp in pl[j].items():
                        if tok < V:
                            t[j - 1, tok] = lp.logprob
                plps[i] = t
    run = time.perf_counter() - t1
    metrics = {}
    try:  # needs disable_log_stats=False
        for m in llm.get_metrics():
            if hasattr(m, "value"):
                metrics[m.name] = metrics.get(m.name, 0) + m.value
    except Exception:
        pass
    layout = None
    if spec.get("tp_layout"):  # by its module name: run as a script this file is ``__main__``, which workers lack
        from vllm_offline import tp_layout as fn

        layout = llm.apply_model(fn)
    params = None
    if spec.get("params"):
        import functools

        from vllm_offline import param_dump

        params = llm.apply_model(functools.partial(param_dump, list(spec["params"])))
    torch.save({"tokens": tokens, "logprobs": lps, "prompt_logprobs": plps, "prompt_top1": top1, "startup_s": startup,
                "run_s": run, "metrics": metrics, "num_preemptions": metrics.get("vllm:num_preemptions"),
                "tp_layout": layout, "params": params, "kv_cache_groups": kv_cache_groups(llm),
                "kv_cache_block_sizes": kv_cache_block_sizes(llm)}, out_path)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("out")
    ap.add_argument("--tensor-parallel-size", type=int, default=None,
                    help="override the spec's engine tensor_parallel_size")
    a = ap.parse_args()
    _main(a.spec, a.out, a.tensor_parallel_size)
