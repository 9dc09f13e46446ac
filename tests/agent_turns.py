"""Multi-turn sessions through one in-process vLLM engine (CPU, tiny-coder, float32), driven step by step through
``LLMEngine.add_request(..., session_id=...)``; prints one JSON object. Used by tests/test_vllm_scheduler.py:

    python tests/agent_turns.py SCHEDULER_CLS|default OUT.json [MTP_DRAFTS [async|priority]]

(``async``: asynchronous scheduling forced on, on CPU too; ``priority``: ``--scheduling-policy priority``, then only
``turns`` and ``priority``, a next turn behind first turns of its class and one of a higher class.)

Scenarios: ``turns`` (a 3-turn session: cached tokens per turn, outputs, the same prompts with a cache miss forced),
``pressure`` (a session's turn, then other traffic that fills the KV cache, then the session's next turn; then one
request larger than what is free while a pin is held), ``admission`` (a session's next turn behind more first
turns than ``max_num_seqs``: when it gets its first token), ``chunk`` (a session's next turn arriving during a long
first turn's chunked prefill: when each gets its first token), ``pause`` (a long first turn's step sizes while a
session is in a tool pause and after its release), ``ends`` (a turn with ``session_close``, an aborted turn),
and the block pool's free count before and after (leaks). With MTP_DRAFTS > 0 the engine drafts with our MTP head
and only ``turns`` runs (the others' block counts are sized without the draft's cache)."""

import contextlib
import json
import os
import random
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

BLOCKS = 48  # KV cache blocks in all: small enough that other traffic evicts a session's turn between its turns
P, OUT, NEW = 970, 120, 20


def main(sched: str, out_path: str, mtp: int = 0, mode: str = "") -> None:
    if mode == "async":
        async_on_cpu()
    res = scenarios(sched, mtp, "priority" if mode == "priority" else "fcfs")
    with open(out_path, "w") as f:
        json.dump(res, f)


def async_on_cpu() -> None:
    """Schedule asynchronously (vLLM's ``AsyncScheduler``, one step planned ahead of the one running, as on GPUs)
    on CPU too, where vLLM turns it off as not needed: so the CPU suite covers the variant GPUs run."""
    from vllm.platforms import cpu

    update = cpu.CpuPlatform.check_and_update_config.__func__

    def with_async(cls, vllm_config):
        update(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    cpu.CpuPlatform.check_and_update_config = classmethod(with_async)


def scenarios(sched: str, mtp: int, policy: str = "fcfs") -> dict:
    from qwen4exp.serve import cpu_env

    cpu_env()
    from vllm import LLM, SamplingParams

    from qwen4exp import envs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    eng = dict(dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=2048, max_num_seqs=4,
               enable_prefix_caching=True, num_gpu_blocks_override=BLOCKS)
    if sched != "default":
        eng["scheduler_cls"] = sched
    if policy != "fcfs":
        eng["scheduling_policy"] = policy
    if mtp:
        # the draft layer's cache shares the pool: BLOCKS no longer holds one max_model_len request on CUDA; only
        # ``turns`` runs, which needs room rather than pressure, so vLLM sizes the cache
        eng["speculative_config"] = {"method": "mtp", "num_speculative_tokens": mtp}
        del eng["num_gpu_blocks_override"]
    sys.path.insert(0, os.path.join(root, "tools"))
    from vllm_offline import shared_engine  # (the GPU suite's parts sharing one GPU)

    llm = LLM(model=os.path.join(root, "qwen4exp", "assets", "tiny-coder"), **shared_engine(eng))
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    res = {"scheduler": type(scheduler).__name__, "free_at_start": pool.get_num_free_blocks(),
           "block_size": int(scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)}
    rng = random.Random(0)
    counter = iter(range(10**6))
    first_token_step: dict[str, int] = {}

    def ids(n):
        return [rng.randrange(3, 2000) for _ in range(n)]

    def add(prompt, n, sid, extra):
        rid = f"r{next(counter)}"
        extra = dict(extra or {})
        priority = extra.pop("priority", 0)
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra or None)
        p = {"prompt_token_ids": prompt}
        if extra.get("cache_salt"):
            p["cache_salt"] = extra["cache_salt"]
        engine.add_request(rid, p, sp, session_id=sid, priority=priority)
        return rid

    @contextlib.contextmanager
    def each_schedule(after, before=lambda: None):
        """Inside the block, every ``scheduler.schedule`` call is followed by ``after(its output, what before()
        returned just ahead of it)``."""
        schedule = scheduler.schedule

        def noted(*a, **k):
            b = before()
            out = schedule(*a, **k)
            after(out, b)
            return out

        scheduler.schedule = noted
        try:
            yield
        finally:
            del scheduler.schedule

    def run(reqs, abort_after=None, after_first_step=()):
        """reqs: [(prompt ids, max_tokens, session_id, extra)]; all at once (``after_first_step``: more of them, added
        once the engine has run one step); -> [(cached, output ids)] in that order."""
        rids = [add(*r) for r in reqs]
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            steps += 1
            for o in engine.step():
                if o.outputs and o.outputs[0].token_ids:
                    first_token_step.setdefault(o.request_id, steps)
                if o.finished:
                    done[o.request_id] = (o.num_cached_tokens, list(o.outputs[0].token_ids))
            if steps == 1:
                rids += [add(*r) for r in after_first_step]
            if abort_after is not None and steps == abort_after:
                engine.abort_request([rids[-1]])
        return [done.get(r, (None, None)) for r in rids]

    # turns: prompt N+1 = prompt N + output N + new tokens
    prompt, turns = ids(P), []
    for t in range(3):
        (cached, out), = run([(prompt, OUT, "s-turns", None)])
        (_, miss), = run([(prompt, OUT, None, {"cache_salt": f"miss-{t}"})])
        turns.append({"prompt": len(prompt), "cached": cached, "output": out, "output_on_a_miss": miss})
        prompt = prompt + out + ids(NEW)
    res["turns"] = turns
    if policy == "priority":
        # a session's next turn arrives behind as many first turns of a higher class (a lower number) as the engine
        # runs at once, and behind more first turns of its own class than that: the step in which each is first
        # scheduled
        sess = ids(200)
        (_, so), = run([(sess, 8, "s-prio", None)])
        n0, first_scheduled, calls = next(counter), {}, iter(range(1, 10**6))

        def note(out, _):
            step = next(calls)
            for key in out.num_scheduled_tokens:
                first_scheduled.setdefault(key.split("-")[0], step)

        with each_schedule(note):
            run([(ids(200), 8, None, {"priority": -1}) for _ in range(4)]
                + [(ids(200), 8, None, None) for _ in range(6)] + [(sess + so + ids(NEW), 8, "s-prio", None)])
        steps = [first_scheduled[f"r{n0 + 1 + i}"] for i in range(11)]
        res["priority"] = {"higher_class": steps[:4], "first_turns": steps[4:10], "next_turn": steps[10]}
        snap = getattr(scheduler, "sessions", None)
        if snap:
            snap.release_all()
        res["free_at_end"] = pool.get_num_free_blocks()
        return res
    if mtp:
        res["prefix_caching"] = bool(scheduler.cache_config.enable_prefix_caching)
        res["exact_resumes"] = getattr(scheduler, "exact_resumes", 0)
        return res

    # pressure: other traffic between a session's turns
    first = ids(P)
    (c1, o1), = run([(first, OUT, "s-pressure", None)])
    for _ in range(6):
        run([(ids(P), 8, None, None)])
    (c2, o2), = run([(first + o1 + ids(NEW), 16, "s-pressure", None)])
    res["pressure"] = {"first": c1, "next_turn_cached": c2}
    snap = getattr(scheduler, "sessions", None)
    res["pinned_before_big"] = snap.pinned_blocks() if snap else 0
    (cb, ob), = run([(ids(1990), 8, None, None)])  # needs more than is free while a turn is pinned
    res["big_request_output_tokens"] = len(ob or [])

    # admission: a pinned session's next turn arrives behind more first turns than the engine runs at once
    sess = ids(200)
    (_, so), = run([(sess, 8, "s-admit", None)])
    n0 = next(counter)
    run([(ids(200), 8, None, None) for _ in range(6)] + [(sess + so + ids(NEW), 8, "s-admit", None)])
    order = sorted(range(7), key=lambda i: first_token_step[f"r{n0 + 1 + i}"])
    res["admission"] = {"continuation_first_token_rank": order.index(6),
                        "continuation_first_token_step": first_token_step[f"r{n0 + 7}"]}

    # chunk: a session's next turn arrives while a long first turn is in the middle of its chunked prefill (a step
    # budget of two blocks here; AgentScheduler's cap for such steps one block): vLLM schedules the running prefill
    # first, so the default serves the next turn only once that prefill is done
    B = res["block_size"]
    os.environ["QWEN4EXP_CONTINUATION_CHUNK"] = str(B)
    envs.reset()
    budget, scheduler.max_num_scheduled_tokens = scheduler.max_num_scheduled_tokens, 2 * B
    # the previous turn ends 10 tokens short of a block boundary, so the next turn's new tokens straddle it: vLLM
    # ends a chunk that starts mid-block at the boundary, and the rest of the turn's prefill is then a running
    # request's, scheduled after the running first turn's
    sess = ids(3 * B - 17)
    (_, so), = run([(sess, 8, "s-chunk", None)])
    capped, continued = getattr(scheduler, "capped_steps", 0), getattr(scheduler, "continued_steps", 0)
    long_prompt = ids(2048 - 16)
    n0 = next(counter)
    trace = []  # per schedule call: tokens scheduled per request, the cap in force, the session's state, pins held

    def traced(out, capped_before):
        sessions = getattr(scheduler, "sessions", None)
        trace.append({"t": round(time.monotonic() - t0, 3), "scheduled": dict(out.num_scheduled_tokens),
                      "capped": getattr(scheduler, "capped_steps", 0) - capped_before,
                      "waiting": [r.request_id for r in scheduler.waiting],
                      "session": sessions.state("s-chunk").value if sessions else None,
                      "pinned_blocks": sessions.pinned_blocks() if sessions else 0,
                      "free_blocks": pool.get_num_free_blocks()})

    t0 = time.monotonic()
    with each_schedule(traced, lambda: getattr(scheduler, "capped_steps", 0)):
        (_, long_out), (_, next_out) = run([(long_prompt, 8, None, None)],
                                           after_first_step=[(sess + so + ids(NEW), 8, "s-chunk", None)])
    scheduler.max_num_scheduled_tokens = budget
    del os.environ["QWEN4EXP_CONTINUATION_CHUNK"]
    envs.reset()
    # first-token steps counted from the next turn's arrival (after the run's first step)
    res["chunk"] = {"long_prompt": len(long_prompt), "step_budget": 2 * B,
                    "next_turn_first_token_step": first_token_step[f"r{n0 + 2}"] - 1,
                    "long_first_token_step": first_token_step[f"r{n0 + 1}"] - 1, "long_output": long_out,
                    "next_turn_output": next_out, "capped_steps": getattr(scheduler, "capped_steps", 0) - capped,
                    "continued_steps": getattr(scheduler, "continued_steps", 0) - continued,
                    "ids": [f"r{n0 + 1}", f"r{n0 + 2}"], "trace": trace}

    # ends: a turn that closes its session, an aborted turn
    (cc, oc), = run([(ids(300), 8, "s-close", {"session_close": True})])
    res["pinned_after_close"] = snap.pinned_blocks() if snap else 0
    run([(ids(300), 64, "s-abort", None)], abort_after=3)
    res["sessions"] = snap.snapshot() if snap else None
    res["exact_resumes"] = getattr(scheduler, "exact_resumes", 0)
    res["states"] = {sid: s.state.value for sid, s in snap.sessions.items()} if snap else {}
    pinned = snap.pinned_blocks() if snap else 0
    res["free_at_end"], res["pinned_at_end"] = pool.get_num_free_blocks(), pinned
    if snap:
        snap.release_all()
    res["free_after_release"] = pool.get_num_free_blocks()

    # pause: a long first turn prefilled while a session is in a tool pause (its turn held), then again with no
    # session held (a cache salt forces the miss): AgentScheduler keeps the first to steps of QWEN4EXP_PAUSE_CHUNK
    # prefill tokens (one block here, against a step budget of three), the second runs at the full budget
    os.environ["QWEN4EXP_PAUSE_CHUNK"] = str(B)
    envs.reset()
    budget, scheduler.max_num_scheduled_tokens = scheduler.max_num_scheduled_tokens, 3 * B
    paused = getattr(scheduler, "paused_steps", 0)
    run([(ids(200), 8, "s-pause", None)])
    held = snap.pinned_blocks() if snap else 0
    long_prompt, parts = ids(2048 - 16), {}
    for part, salt in (("held", None), ("released", {"cache_salt": "pause-miss"})):
        if part == "released" and snap:
            snap.release_all()
        steps = []
        with each_schedule(lambda out, _: steps.append(out.total_num_scheduled_tokens)):
            (_, out), = run([(long_prompt, 8, None, salt)])
        parts[part] = {"step_tokens": steps, "output": out}
    scheduler.max_num_scheduled_tokens = budget
    del os.environ["QWEN4EXP_PAUSE_CHUNK"]
    envs.reset()
    res["pause"] = {"held_blocks": held, "step_budget": 3 * B, **parts,
                    "paused_steps": getattr(scheduler, "paused_steps", 0) - paused}
    res["free_after_pause"] = pool.get_num_free_blocks()
    return res


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0,
         sys.argv[4] if len(sys.argv) > 4 else "")
