"""Run an offline ``vllm.LLM`` over token-id prompts in a clean subprocess (tests, benchmarks).

    python -m qwen4exp.vllm.offline spec.json out.pt

spec: {"model": dir, "engine": {LLM kwargs}, "env": {extra environment} (run_offline only), "sampling": {SamplingParams kwargs}, "prompts": [[ids], ...],
       "batches": [[prompt indices], ...] (default: all at once), "full_prompt_logprobs": bool,
       "prompt_top1": bool (with sampling prompt_logprobs >= 1: the rank-1 token id at every prompt position),
       "warmup": bool (untimed short generate first)}
out (torch.save): {"tokens": [[ids]...], "prompt_logprobs": [tensor [L-1, V] or None],
       "prompt_top1": [[ids of positions 1..L-1]] or None, "startup_s", "run_s",
       "metrics" (counters/gauges when disable_log_stats=False), "num_preemptions"}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def run_offline(spec: dict, workdir: str, timeout: float = 600) -> dict:
    """Run ``spec`` in a subprocess (in-process engine, CPU defaults) and return its results."""
    import torch

    os.makedirs(workdir, exist_ok=True)
    sp, out = os.path.join(workdir, "spec.json"), os.path.join(workdir, "out.pt")
    with open(sp, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, **spec.pop("env", {}))
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("QWEN4EXP_CACHE_DIR", os.path.join(workdir, "cache"))
    env.setdefault("TMPDIR", workdir)
    p = subprocess.run([sys.executable, "-m", "qwen4exp.vllm.offline", sp, out], env=env, timeout=timeout,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"offline engine failed (rc={p.returncode}):\n{p.stderr[-6000:]}")
    return torch.load(out, weights_only=False)


def _main(spec_path: str, out_path: str) -> None:
    from ..serve import cpu_env

    cpu_env()
    import torch
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **spec.get("engine", {}))
    startup = time.perf_counter() - t0
    prompts = spec["prompts"]
    batches = spec.get("batches") or [list(range(len(prompts)))]
    sampling = SamplingParams(**spec.get("sampling", {}))
    tokens: list = [None] * len(prompts)
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
    torch.save({"tokens": tokens, "prompt_logprobs": plps, "prompt_top1": top1, "startup_s": startup, "run_s": run, "metrics": metrics,
                "num_preemptions": metrics.get("vllm:num_preemptions")}, out_path)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
