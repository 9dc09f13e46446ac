"""Ten requests at once through one in-process vLLM engine (CPU, tiny-coder, float32) with a KV cache too small for
all of them, so the scheduler preempts; prints one JSON object. Used by tests/test_vllm_scheduler.py:

    python tests/preempt_turns.py SCHEDULER_CLS|default BLOCKS OUT.json

Recorded: every preemption (request, computed tokens thrown away, whether it was still in its prefill), the greedy
output of every request, the engine steps."""

import json
import os
import random
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(sched: str, blocks: int, out_path: str) -> None:
    from qwen4exp.serve import cpu_env

    cpu_env()
    from vllm import LLM, SamplingParams

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    eng = dict(dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=2048, max_num_seqs=8,
               max_num_batched_tokens=512, enable_prefix_caching=True, num_gpu_blocks_override=blocks)
    if sched != "default":
        eng["scheduler_cls"] = sched
    sys.path.insert(0, os.path.join(root, "tools"))
    from vllm_offline import shared_engine  # (the GPU suite's parts sharing one GPU)

    engine = LLM(model=os.path.join(root, "qwen4exp", "assets", "tiny-coder"), **shared_engine(eng)).llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    events = []
    preempt = scheduler._preempt_request

    def recorded(request, *args, **kwargs):
        events.append((request.request_id.split("-")[0], request.num_computed_tokens,
                       request.num_computed_tokens < request.num_prompt_tokens))
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = recorded
    rng = random.Random(1)
    for i in range(10):
        prompt = [rng.randrange(3, 2000) for _ in range(rng.randrange(100, 700))]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=rng.randrange(50, 300), temperature=0, ignore_eos=True))
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            if o.finished:
                outputs[o.request_id.split("-")[0]] = list(o.outputs[0].token_ids)
    with open(out_path, "w") as f:
        json.dump({"scheduler": type(scheduler).__name__, "steps": steps, "preemptions": events,
                   "lost_tokens": sum(e[1] for e in events), "outputs": outputs,
                   "counted": getattr(scheduler, "preempted_tokens", None)}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
