"""Upstream vLLM's in-tree qwen4_exp vs the qwen4exp plugin, side by side in one run (FN-12L, dummy weights).

    python benchmarks/bench_vllm_gpu.py --out bench_out/vllm_gpu              # both implementations, full sizes
    python benchmarks/bench_vllm_gpu.py --impls ours --ctx 2048 --bs32-ctx 512 # a quick look
    python benchmarks/bench_vllm_gpu.py --impls prev,ours --ours-at prev=../prev   # A/B: another checkout's package

Each implementation runs in its own subprocess (``QWEN4EXP_VLLM=0`` for upstream, so vLLM's in-tree classes serve)
with the same engine arguments as the upstream anchor (``load_format="dummy"``, bf16, ``max_model_len`` ctx + 320,
``max_num_seqs`` 32, ``max_num_batched_tokens`` 16384, prefix caching off, random prompt ids, greedy,
``ignore_eos``). Measured per implementation, by driving ``LLMEngine.step()`` and timing every step:

* engine start-up (``LLM(...)`` wall time) and GPU memory (weights, and all the engine holds after start-up);
* batch 1, ``--ctx``-token prompt: time to the first token (prefill), then ``--out-tokens`` tokens: TPOT as the
  anchor defines it ((end to end - first token) / (n - 1)) and the median single decode step;
* batch 32, ``--bs32-ctx``-token prompts: the median decode step over the steps in which all 32 requests decode
  (none still prefilling, none finished: ``--bs32-tokens`` outlasts the batch's prefill), and tokens/s. Steps
  while some requests still prefill or have already finished would time a smaller batch than 32. Where no step had
  the whole batch decoding, ``bs{8,32}_why`` says why (the KV room in requests, the most requests that decoded at
  once, the preemptions; the table shows it as a footnote), never a bare ``nan``; a batch the KV room
  (``kv_tokens``, ``kv_requests``) cannot hold is said so in the worker's log before it starts.

Printed beside them: the batch-1 bandwidth roofline = bytes one decode step must read (active weights: everything
but the 502 idle experts per layer, the LM head, the PLE rows; the GDN states; the QSA keys a query reads at this
context) over the device-to-device copy bandwidth measured in the same run. Table on stdout, rows in ``results.csv``.

A/B in one call: ``--variant NAME=ENV=VALUE`` runs ours with extra environment settings as NAME, ``--ours-at
NAME=PATH`` runs ours from another checkout of this repository (e.g. ``git worktree add ../prev HEAD~1``: its
``qwen4exp`` goes first on the worker's PYTHONPATH, before the installed one); name them in ``--impls`` beside ours
and the ratios NAME/ours and NAME/upstream are printed. With ``--gpus`` naming one GPU per implementation they run at
the same time (same clock, same host load), otherwise one after the other on the same warm machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))  # trace_summary, host_sampler (py-spy tables)


# ------------------------------------------------------------------------------------------------- the config
def write_config(path: str, layers: int, preset: str = "fn") -> dict:
    sys.path.insert(0, os.path.dirname(HERE))
    from qwen4exp import presets

    cfg = presets.tiny_text(num_hidden_layers=4) if preset == "tiny" else presets.fn12l()
    if layers != cfg.num_hidden_layers:
        d = cfg.to_dict()
        d["num_hidden_layers"] = layers
        d["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
        cfg = type(cfg)(**{k: v for k, v in d.items() if k not in ("model_type", "transformers_version")})
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    if preset == "fn-nvfp4":  # FN-48L-NVFP4: the upstream anchor's quantization_config (routed experts NVFP4)
        c["quantization_config"] = presets.anchor_nvfp4_quantization_config()
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
    return c


# the defaults a preset changes (FN-48L-NVFP4: every layer, both engines at the anchor's memory utilisation, as the
# weights alone take 74 GiB; batch 8 beside batch 32)
PRESET_DEFAULTS = {"fn-nvfp4": dict(layers=48, gpu_util=0.92, gpu_util_ours=0.92, bs8_ctx=50_000)}


def roofline_bytes(c: dict, ctx: int, elt: int = 2) -> dict:
    """Bytes one batch-1 decode step reads at context ``ctx`` (bf16 weights, fp32 GDN state, bf16 QSA K/V; routed
    experts at 4 bits + one FP8 scale per 16 when the config quantizes them to NVFP4)."""
    D, L = c["hidden_size"], c["num_hidden_layers"]
    n = c["hc_count"]
    types = c["layer_types"]
    n_lin = sum(t == "linear_attention" for t in types)
    n_qsa = L - n_lin
    hd, hq, hkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    qsa_w = D * (hq * hd * 2 + hkv * hd * 2) + hq * hd * D  # q (+gate), k, v, o
    di, hi = c["indexer_head_dim"], c["indexer_n_heads"]
    qsa_w += D * (hi * di + di) + D * hi  # indexer q, k, weights (approx.)
    kd, vd = c["linear_key_head_dim"], c["linear_value_head_dim"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    gdn_w = D * (2 * nk * kd + 2 * nv * vd + 2 * nv) + nv * vd * D
    I, E, k = c["moe_intermediate_size"], c["num_experts"], c["num_experts_per_tok"]
    shared = 3 * D * c["shared_expert_intermediate_size"] + D
    q = c.get("quantization_config") or {}
    fp4 = "NVFP4" in str(q.get("quant_algo", "")).upper()
    experts = k * 3 * D * I * ((0.5 + 1 / 16) / elt if fp4 else 1)  # (in units of elt bytes)
    moe_w = experts + shared + E * D  # active experts + shared + router
    hc_w = 2 * (n * D * c["hc_lowrank"] * 2 + n * D)  # two mixers per layer, down + up + norm
    weights = elt * (n_lin * gdn_w + n_qsa * qsa_w + L * (moe_w + hc_w)) + elt * c["vocab_size"] * D  # + LM head
    gdn_state = n_lin * nv * kd * vd * 4 * 2  # read + write, fp32
    r, budget = c["indexer_compress_ratio"], c["indexer_budget"]
    sel = min(ctx, budget + r - 1)
    qsa_kv = n_qsa * (sel * hkv * hd * 2 * elt + (ctx // r) * di * elt)
    return dict(weights=weights, gdn_state=gdn_state, qsa_kv=qsa_kv, total=weights + gdn_state + qsa_kv)


def copy_bandwidth() -> float:
    import torch

    if not torch.cuda.is_available():
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    bw = 2 * x.numel() / statistics.median(ts)  # read + write
    del x, y
    torch.cuda.empty_cache()  # the engines started next want this memory free
    return bw


# ------------------------------------------------------------------------------------------------- one engine
TRACE_WAIT_S = 180  # how long the engine core may take to write its trace after stop_profile (gzip at 5 steps: ~s)


def _await_trace(d: str, prefix: str, wait_s: float) -> str | None:
    """The newest trace vLLM's profiler wrote into ``d`` for ``prefix`` (a name starting with it, or holding it
    after a worker prefix, with ".json"), once its size stops changing: the engine core process writes it after
    ``stop_profile`` returns. None if none appears within ``wait_s``."""
    import time

    deadline, last = time.monotonic() + wait_s, None
    while True:
        found = sorted((os.path.join(d, f) for f in os.listdir(d) if prefix in f and ".json" in f),
                       key=os.path.getmtime)
        if found:
            size = os.path.getsize(found[-1])
            if last == (found[-1], size) and size:
                return found[-1]
            last = (found[-1], size)
        if time.monotonic() > deadline:
            return found[-1] if found else None
        time.sleep(2)


def _profile_steps(engine, n: int, path: str, row_limit: int, llm=None, gpu_only: bool = False,
                   layers=None, census_out: dict | None = None) -> None:
    """Run n engine steps under the torch profiler (their outputs are dropped) and write its tables to ``path``:
    by GPU time (CPU time without a GPU), then by CPU time, then ``tools/trace_summary.py``'s report of the
    Chrome trace (kept beside it as ``<path>.trace.json.gz``: GPU busy vs idle per step, gaps, host annotations).
    ``llm``: the engine core runs in its own process (``--mp``): profile it through vLLM's profiler instead
    (``profiler_config``; its trace lands beside ``path``, named after it). ``gpu_only``: record GPU activity only
    (in-process; ``--mp`` sets it in the engine's profiler config), so the host is not slowed by op recording.
    ``layers``: the decoder layers a step runs (candidates, see ``trace_summary.census``): the per-layer census is
    appended, and its figures go into ``census_out``."""
    import torch

    from trace_summary import census, census_report, load, report, summarize

    ran = [0]

    def steps():
        for _ in range(n):
            if not engine.has_unfinished_requests():  # (with --mp a step would wait for output forever)
                break
            engine.step()
            ran[0] += 1

    tables = ""
    if llm is not None:
        d, prefix = os.path.dirname(path), os.path.basename(path).removesuffix(".txt")
        llm.start_profile(prefix)
        steps()
        llm.stop_profile()
        trace = _await_trace(d, prefix, TRACE_WAIT_S)
        if trace is None:  # say so where the table would be (run 28's --mp profile left nothing and no word)
            with open(path, "w") as f:
                f.write(f"no profile: vLLM's profiler wrote no trace named {prefix}* in {d} within "
                        f"{TRACE_WAIT_S} s of stop_profile (files there: {sorted(os.listdir(d))[:20]})\n")
            return
    else:
        cuda = torch.cuda.is_available()
        acts = ([] if cuda and gpu_only else [torch.profiler.ProfilerActivity.CPU]) + (
            [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            steps()
            if cuda:
                torch.cuda.synchronize()
        trace = path + ".trace.json.gz"
        prof.export_chrome_trace(trace)  # (gzipped: the suffix says so)
        tables = (prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total",
                                            row_limit=row_limit) + "\n\n"
                  + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25) + "\n\n")
    events = load(trace)
    text = tables + report(summarize(events), row_limit) + "\n"
    if layers:
        c = census(events, max(ran[0], 1), layers)
        text += census_report(c) + "\n"
        if census_out is not None:
            census_out.update(census_figures(c))
    with open(path, "w") as f:
        f.write(text)


def census_figures(c: dict) -> dict:
    """The census's headline figures for the results row: GPU ops a step, kernels and µs (wall) per GDN / QSA
    layer."""
    out = dict(kernels_per_step=round(c["kernels_per_step"]))
    for kind in ("gdn", "qsa"):
        if kind in c:
            out[f"{kind}_layer_kernels"] = c[kind]["kernels"]
            out[f"{kind}_layer_us"] = round(c[kind]["wall_us"], 2)
    return out


_PYSPY: dict = {}  # the py-spy recorder of the open window: proc, raw file, label


def _pyspy_window(label: str | None) -> None:
    """``--py-spy``: record this process and its children (the engine core under ``--mp``) with py-spy from the
    window's start to its end (SIGINT ends a recording and makes py-spy write it); at the end the raw stacks go into
    stack tables (``tools/host_sampler.py``'s ``collapsed_table``) in ``<QWEN4EXP_PYSPY_OUT>-<label>.txt``. py-spy reads
    the processes from outside without pausing them (``--nonblocking``), so its shares do not depend on the GIL."""
    exe, out = os.environ.get("QWEN4EXP_PYSPY"), os.environ.get("QWEN4EXP_PYSPY_OUT")
    if not exe or not out:
        return
    if label is not None:
        raw = f"{out}-{label}.raw"
        log = open(f"{out}-{label}.log", "w")
        cmd = [exe, "record", "--pid", str(os.getpid()), "--subprocesses", "--idle", "--threads", "--nonblocking",
               "-r", os.environ.get("QWEN4EXP_PYSPY_RATE", "1000"), "-f", "raw", "-o", raw]
        # (no waiting for it to attach: under --mp the engine core runs ahead while this process sleeps, and the
        # queued outputs would make the next timed steps return at once; its first few samples are lost instead)
        _PYSPY.update(proc=subprocess.Popen(cmd, stdout=log, stderr=log), raw=raw, label=label, log=log)
        return
    proc = _PYSPY.pop("proc", None)
    if proc is None:
        return
    import signal

    from host_sampler import collapsed_table

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
    _PYSPY.pop("log").close()
    raw, label = _PYSPY.pop("raw"), _PYSPY.pop("label")
    if os.path.exists(raw):
        with open(raw) as f, open(f"{out}-{label}.txt", "w") as g:
            g.write(collapsed_table(f.read(), label))


def _pyspy_on() -> bool:
    return bool(os.environ.get("QWEN4EXP_PYSPY") and os.environ.get("QWEN4EXP_PYSPY_OUT"))


def _scheduler(engine):
    """vLLM's scheduler where the engine core runs in this process (LLMEngine -> InprocClient -> EngineCore), else
    None (``--mp``: it lives in the engine core's process)."""
    return getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)


def _drive(engine, prompts, max_tokens: int, profile_to: str | None = None, prefill_steps: list | None = None,
           profile_prefill: int = 0, llm=None, gpu_only: bool = False, sample: tuple | None = None,
           counts: list | None = None, facts: dict | None = None, layers=None, census_out: dict | None = None):
    """Add the prompts, step until done. Returns (t_first_all, t_end, step_times_while_all_decoding, tokens):
    the step times are of steps in which every request is decoding and none has finished (all of the batch in the
    step; with long prompts the first requests decode while later ones prefill, so max_tokens must outlast the
    batch's prefill for there to be such steps)
    ``profile_to``: write a torch-profiler table of decode steps 32..39 there (the steps stay out of the timings),
    or with ``profile_prefill`` = k of the first k steps (prefill chunks). ``prefill_steps``: gets the wall time
    of every step before all first tokens. ``llm``: profile through vLLM's profiler (``--mp``). ``sample``:
    (label, first, last): ``--py-spy`` records from the first-th to the last-th step with the batch decoding; those
    steps stay out of the timings (sampling at 1 kHz from outside slows a host-bound step). ``counts``: gets
    the tokens the batch gained in each timed step (with MTP: 1 + the accepted drafts, summed over the batch).
    ``facts``: gets ``max_decoding`` (the most requests that gained a token in one step after their first) and
    ``preemptions`` (summed over the requests, read from the scheduler's requests after each step; None under
    ``--mp``): what says why no step had the whole batch decoding."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{t0}", {"prompt_token_ids": p}, sp)
    got = {}
    t_first = None
    steps = []
    profiled = not profile_to
    timing = True
    sched = _scheduler(engine) if facts is not None else None
    preempted: dict = {}  # request id -> its preemptions so far (kept after it finishes and leaves the scheduler)
    max_decoding = 0
    decoding = 0  # steps with the whole batch decoding, timed or not (the py-spy window counts them)
    if profile_to and profile_prefill:
        _profile_steps(engine, profile_prefill, profile_to, 45, llm, gpu_only, layers, census_out)
        profiled = True
    while engine.has_unfinished_requests():
        if not profiled and len(steps) == PROFILE_AT_STEP:
            _profile_steps(engine, PROFILE_STEPS, profile_to, 40, llm, gpu_only, layers, census_out)
            profiled = True
            # the engine core in its own process (--mp) keeps stepping while the profiler writes its trace, and
            # its outputs queue up: step() then returns at once (a batch-32 median of a fraction of a millisecond).
            # Steps after a profile are not timed there.
            timing = llm is None
            continue
        if sample and decoding in (sample[1], sample[2]):
            _pyspy_window(sample[0] if decoding == sample[1] else None)
        sampled = bool(sample) and sample[1] <= decoding < sample[2] and _pyspy_on()
        ts = time.perf_counter()
        outs = engine.step()
        te = time.perf_counter()
        if prefill_steps is not None and t_first is None:
            prefill_steps.append(round(te - ts, 4))
        before = sum(got.values())
        if facts is not None:
            max_decoding = max(max_decoding, sum(1 for o in outs if got.get(o.request_id, 0) >= 1))
            for r in getattr(sched, "requests", {}).values():
                if getattr(r, "num_preemptions", 0):
                    preempted[r.request_id] = r.num_preemptions
        for o in outs:
            got[o.request_id] = len(o.outputs[0].token_ids) if o.outputs else 0
        all_started = len(got) == len(prompts) and min(got.values()) >= 1
        if all_started and t_first is None:
            t_first = te - t0
        elif all_started and outs and max(got.values()) < max_tokens and timing:  # all decoding, none done
            decoding += 1
            if not sampled:
                steps.append(te - ts)
                if counts is not None:
                    counts.append(sum(got.values()) - before)
    if sample:
        _pyspy_window(None)
    if not profiled:  # say so where the table would be
        with open(profile_to, "w") as f:
            f.write(f"no profile: the requests ended after {len(steps)} timed decode steps, before the "
                    f"{PROFILE_AT_STEP}th (give them more tokens: profile_tokens)\n")
    if facts is not None:
        facts.update(max_decoding=max_decoding, preemptions=sum(preempted.values()) if sched is not None else None)
    return t_first, time.perf_counter() - t0, steps, sum(got.values())


PROFILE_AT_STEP, PROFILE_STEPS = 32, 8  # --profile: decode steps 32..39 of a batch


def step_layers(layers: int, mtp: int, prefill: bool = False) -> tuple[int, ...]:
    """Decoder-layer runs a profiled step may hold, for the census's cut (``trace_summary.census``): the target's
    layers plus the MTP draft's runs (k at a decode step, one at a prefill chunk), then the target's alone (a cut
    kernel the draft layer lacks)."""
    return ((layers + (1 if prefill else mtp)),) * bool(mtp) + (layers,)


def tokens_per_step(mtp: int, acceptance_length: float) -> float:
    """Tokens a request gains in a decode step: 1, or with MTP about the acceptance length."""
    return max(acceptance_length, 1.0) if mtp else 1.0


def profile_tokens(mtp: int, acceptance_length: float) -> int:
    """Output tokens a request needs for the profile of its decode steps PROFILE_AT_STEP.. (+ the steps that time
    nothing after it): with MTP a step gains several tokens, so a fixed token count ends before the profiled steps."""
    return int((PROFILE_AT_STEP + PROFILE_STEPS + 8) * tokens_per_step(mtp, acceptance_length) * 1.25) + 1


def mtp_config(k: int, acceptance_length: float) -> dict:
    """vLLM's speculative_config for our MTP head with ``k`` drafts a step, accepted by vLLM 0.32's synthetic rejection
    sampling (each step accepts drafts at random, calibrated to the mean acceptance length; CUDA only)."""
    if not 1 <= acceptance_length <= k + 1:
        raise SystemExit(f"--acceptance-length {acceptance_length}: want a value in [1, {k + 1}] for --mtp {k}")
    return {"method": "mtp", "num_speculative_tokens": k, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": acceptance_length}


def self_consistency(llm, prompt: list[int], n: int = 48) -> dict:
    """A correctness probe that needs no reference weights: generate n greedy tokens (the decode path: CUDA graphs),
    then run prompt + generation as one prompt (the prefill path) and count the positions whose prefill top-1 is
    the token the decode path produced. Random (dummy) weights give narrow margins, so a few bf16 flips are
    normal; a broken decode path (wrong cache, wrong selection) agrees at chance level."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
    gen = list(llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids)
    sp2 = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
    plp = llm.generate([{"prompt_token_ids": prompt + gen}], sp2, use_tqdm=False)[0].prompt_logprobs
    agree = 0
    for i, tok in enumerate(gen):
        d = plp[len(prompt) + i] or {}
        top = [t for t, lp in d.items() if getattr(lp, "rank", None) == 1]
        agree += bool(top) and top[0] == tok
    return dict(consistency=f"{agree}/{len(gen)}", consistency_ctx=len(prompt))


# ---------------------------------------------------------------------------------- why a figure is missing
def kv_room(engine) -> dict:
    """The engine's KV room: ``kv_tokens`` = vLLM's "GPU KV cache size: N tokens" (its request capacity at
    max_model_len times that length, counting every cache group), else blocks x block size; None when unknown."""
    cc = engine.vllm_config.cache_config
    blocks, size = getattr(cc, "num_gpu_blocks", None), getattr(cc, "block_size", None)
    tokens = getattr(cc, "kv_cache_size_tokens", None) or (blocks * size if blocks and size else None)
    return dict(kv_tokens=tokens, kv_blocks=blocks, kv_block_size=size)


def kv_tokens_from_log(log_path: str) -> int | None:
    """The last "KV cache size: N tokens" of a worker's vLLM log (a row whose worker did not report it)."""
    import re

    try:
        m = re.findall(r"KV cache size: ([\d,]+) tokens", open(log_path, errors="replace").read())
    except OSError:
        return None
    return int(m[-1].replace(",", "")) if m else None


def kv_short(n: int, req_tokens: int, kv_tokens) -> str | None:
    """"KV room T tokens holds H of n requests of L tokens" where it holds fewer than n such requests, else None."""
    if not kv_tokens or not req_tokens or kv_tokens // req_tokens >= n:
        return None
    return f"KV room {kv_tokens:,} tokens holds {kv_tokens // req_tokens} of {n} requests of {req_tokens:,} tokens"


def kv_warning(n: int, req_tokens: int, kv_tokens) -> str | None:
    """The log line before batch ``n`` when the KV room cannot hold n requests of ``req_tokens`` (it runs anyway)."""
    kv = kv_short(n, req_tokens, kv_tokens)
    return f"batch {n}: {kv}: no step may have all {n} decoding (trying anyway)" if kv else None


def missing_reason(n: int, req_tokens: int, steps, max_decoding, preemptions, kv_tokens,
                   error: str | None = None) -> tuple[str, str] | None:
    """Why batch ``n``'s decode step has no figure: (short form for a table cell, full reason); None when it has
    one (``steps`` > 0). ``steps`` None: the phase never ran (the run ended before it). ``req_tokens``: a request's
    prompt + output tokens; ``preemptions`` None: not counted (engine core in another process)."""
    if steps:
        return None
    kv = kv_short(n, req_tokens, kv_tokens)
    parts = [kv] if kv else []
    if steps is None:
        parts.append(f"batch {n} not reached" + (f" ({error})" if error else ""))
        short = "not reached"
    else:
        pre = ("preemptions not counted (engine core in another process)" if preemptions is None else
               f"{preemptions} preemption{'' if preemptions == 1 else 's'}")
        seen = f"at most {max_decoding} decoded at once, " if max_decoding is not None else ""
        why = f"no step had all {n} decoding: {seen}{pre}"
        if preemptions == 0 and kv_tokens and not kv:  # room enough, nothing preempted: the output was too short
            why += f" (the first finished before the last began decoding: raise --bs{n}-tokens)"
        parts.append(why)
        short = f"max {max_decoding}/{n} decoding" if max_decoding is not None else "no full step"
    if kv:
        short = f"KV {kv_tokens // req_tokens}/{n}"
    return short, "; ".join(parts)


def worker(args) -> None:
    import random

    import torch
    from vllm import LLM

    cfg = json.load(open(os.path.join(args.model, "config.json")))
    res = dict(impl=args.impl, layers=cfg["num_hidden_layers"])
    eng = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=args.ctx + 320,
               max_num_seqs=32, max_num_batched_tokens=16384, gpu_memory_utilization=args.gpu_util,
               enable_prefix_caching=False, seed=0)
    if args.mp and args.profile:  # the engine core is another process: vLLM's own profiler traces it
        eng["profiler_config"] = dict(profiler="torch", torch_profiler_dir=os.path.abspath(
            os.path.dirname(args.result)), torch_profiler_with_stack=bool(args.profile_host_stacks))
        if args.profile_gpu_only:  # no host-op recording: the host runs at (nearly) its unprofiled speed
            eng["profiler_config"]["torch_profiler_activities"] = ["CUDA"]
    sizes = [1, 2, 4, 8, 16, 32]
    if args.mtp:  # MTP drafts, accepted at random so that the mean acceptance length is --acceptance-length
        # (vLLM's synthetic rejection sampling: dummy weights never draft right; a benchmark-only mode)
        eng["speculative_config"] = mtp_config(args.mtp, args.acceptance_length)
        sizes = sorted(set(sizes) | {b * (args.mtp + 1) for b in sizes})  # a decode step of b requests: b(K+1)
    if args.eager:
        eng["enforce_eager"] = True
    else:
        eng["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    res["eager"] = bool(args.eager)
    res["mp"] = bool(args.mp)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, **eng)
    res["startup_s"] = time.perf_counter() - t0
    res["qwen4exp_from"] = package_root()  # (the plugin, loaded by vLLM in this process too: which checkout)
    res["breakable_cudagraph"] = os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH")
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        res["gpu_used_gib"] = (total - free) / 2**30
        res["torch_alloc_gib"] = torch.cuda.memory_allocated() / 2**30
    engine = llm.llm_engine
    res.update(kv_room(engine))
    plm = llm if args.mp else None  # who profiles: vLLM's profiler in the engine core process, or this process
    rng = random.Random(0)
    V = cfg["vocab_size"]

    def prompts(n, L):
        return [[rng.randrange(10, V - 10) for _ in range(L)] for _ in range(n)]

    _drive(engine, prompts(1, 64), 8)  # warm-up (kernels, allocator) outside every figure
    if args.mtp:  # synthetic acceptance keeps drafts whatever they are: the output is not the model's greedy text
        res["consistency"] = "n/a (synthetic MTP)"
    else:
        res.update(self_consistency(llm, prompts(1, min(args.ctx, 3000))[0]))
    chunks = []
    gained = []
    t_first, t_end, steps, ntok = _drive(engine, prompts(1, args.ctx), args.out_tokens, prefill_steps=chunks,
                                         counts=gained)
    res.update(bs1_ctx=args.ctx, bs1_prefill_s=t_first, bs1_e2e_s=t_end,
               bs1_tpot_ms=1e3 * (t_end - t_first) / max(ntok - 1, 1),
               bs1_step_ms=1e3 * statistics.median(steps) if steps else None, bs1_prefill_steps_s=chunks,
               mtp=args.mtp, bs1_tokens_per_step=sum(gained) / len(gained) if gained else None)
    res["bs1_tok_s_user"] = 1e3 / res["bs1_tpot_ms"] if res["bs1_tpot_ms"] else None
    if _pyspy_on():  # py-spy's batch-1 window: a request of its own, so the figures above are unsampled
        _drive(engine, prompts(1, args.ctx), args.out_tokens, sample=("bs1", 4, 1 << 30))
    if args.warm_prefill:  # the same length again: no first-use costs (kernel JIT, allocator growth) left
        chunks = []
        res["bs1_prefill_warm_s"] = _drive(engine, prompts(1, args.ctx), 1, prefill_steps=chunks)[0]
        res["bs1_prefill_warm_steps_s"] = chunks
        if args.profile:
            _drive(engine, prompts(1, args.ctx), 1, os.path.join(os.path.dirname(args.result),
                   f"{args.impl}.profile-prefill.txt"), profile_prefill=2, llm=plm,
                   gpu_only=args.profile_gpu_only, layers=step_layers(res["layers"], args.mtp, prefill=True))
    print(json.dumps(res), flush=True)
    if args.profile:  # a separate request: the profiler's overhead stays out of the figures above
        _drive(engine, prompts(1, args.ctx), profile_tokens(args.mtp, args.acceptance_length),
               os.path.join(os.path.dirname(args.result), f"{args.impl}.profile.txt"), llm=plm,
               gpu_only=args.profile_gpu_only, layers=step_layers(res["layers"], args.mtp), census_out=res)
    def before(n, ctx, out):  # a batch the KV room cannot hold is said so up front (and tried all the same)
        warn = kv_warning(n, ctx + out, res.get("kv_tokens"))
        if warn:
            print(warn, flush=True)

    def after(n, ctx, out, steps, facts):  # what says why a step figure is missing (the driver builds the reason)
        res.update({f"bs{n}_max_decoding": facts["max_decoding"], f"bs{n}_preemptions": facts["preemptions"]})
        why = missing_reason(n, ctx + out, len(steps), facts["max_decoding"], facts["preemptions"],
                             res.get("kv_tokens"))
        if why:
            print(f"batch {n}: no decode-step figure: {why[1]}", flush=True)

    if args.bs8_ctx > 0:  # batch 8 at its context: the median step with all 8 decoding
        before(8, args.bs8_ctx, args.bs8_tokens)
        gained, facts = [], {}
        t_first, t_end, steps, ntok = _drive(engine, prompts(8, args.bs8_ctx), args.bs8_tokens, sample=("bs8", 4, 28),
                                             counts=gained, facts=facts)
        step = statistics.median(steps) if steps else float("nan")
        per = sum(gained) / len(gained) / 8 if gained else float("nan")  # tokens a request gains a step
        res.update(bs8_ctx=args.bs8_ctx, bs8_prefill_s=t_first, bs8_step_ms=1e3 * step, bs8_steps=len(steps),
                   bs8_tokens_per_step=per, bs8_decode_tok_s=8 * per / step)
        after(8, args.bs8_ctx, args.bs8_tokens, steps, facts)
        print(json.dumps(res), flush=True)
    if args.bs32_ctx > 0:
        before(32, args.bs32_ctx, args.bs32_tokens)
        prof32 = os.path.join(os.path.dirname(args.result), f"{args.impl}.profile-bs32.txt") if args.profile else None
        gained, facts = [], {}
        t_first, t_end, steps, ntok = _drive(engine, prompts(32, args.bs32_ctx), args.bs32_tokens, prof32,
                                             llm=plm, gpu_only=args.profile_gpu_only, sample=("bs32", 4, 28),
                                             counts=gained, facts=facts, layers=step_layers(res["layers"], args.mtp))
        step = statistics.median(steps) if steps else float("nan")
        per = sum(gained) / len(gained) / 32 if gained else float("nan")
        res.update(bs32_ctx=args.bs32_ctx, bs32_prefill_s=t_first, bs32_e2e_s=t_end, bs32_step_ms=1e3 * step,
                   bs32_steps=len(steps), bs32_tokens_per_step=per, bs32_decode_tok_s=32 * per / step,
                   bs32_tok_s_user=per / step, bs32_e2e_out_tok_s=ntok / t_end)
        after(32, args.bs32_ctx, args.bs32_tokens, steps, facts)
    with open(args.result, "w") as f:
        json.dump(res, f)
    print(json.dumps(res), flush=True)
    del llm


# ------------------------------------------------------------------------------------------------- driver
def _finish(proc_lf, timeout: float) -> str | None:
    """Wait for a worker (kill it past ``timeout``); None when it exited cleanly, else what went wrong. A worker runs
    in its own process group (``start_new_session``): past the timeout the whole group dies, its engine core
    included, so the next implementation does not start beside an orphaned engine still holding the GPU."""
    p, lf = proc_lf
    try:
        rc = p.wait(timeout=timeout)
        err = f"rc={rc}" if rc else None
    except subprocess.TimeoutExpired:
        import signal

        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        err = f"timeout {timeout:.0f}s"
    _wait_group_gone(p.pid)
    lf.close()
    return err


def _group_alive(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group ``pgid`` (Linux /proc)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(d))
    return pids


def _wait_group_gone(pgid: int, seconds: float = 60.0) -> None:
    """Kill what is left of a worker's process group (an engine core outliving its worker) and wait until none of
    it runs, at most ``seconds``."""
    import signal

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.2)


FIELDS = ["impl", "eager", "mp", "mtp", "layers", "startup_s", "gpu_used_gib", "torch_alloc_gib", "consistency",
          "bs1_ctx", "bs1_prefill_s", "bs1_prefill_warm_s", "bs1_tpot_ms", "bs1_step_ms", "bs1_tokens_per_step",
          "bs1_tok_s_user", "kv_tokens", "kv_requests", "bs8_ctx", "bs8_step_ms", "bs8_steps", "bs8_tokens_per_step",
          "bs8_max_decoding", "bs8_preemptions", "bs8_why", "bs32_ctx", "bs32_prefill_s", "bs32_step_ms", "bs32_steps",
          "bs32_tokens_per_step", "bs32_tok_s_user", "bs32_decode_tok_s", "bs32_e2e_out_tok_s", "bs32_max_decoding",
          "bs32_preemptions", "bs32_why", "roofline_ms", "bs1_bw_fraction", "kernels_per_step", "gdn_layer_kernels",
          "gdn_layer_us", "qsa_layer_kernels", "qsa_layer_us", "moe_backend", "jit_during_inference", "package",
          "error"]
TABLE_FIELDS = [k for k in FIELDS if not k.endswith("_why")]  # (the reasons go under the table, as footnotes)
BATCHES = (8, 32)  # the batch phases whose step figure may be missing


def _nan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def phase_tokens(args) -> dict[int, int]:
    """A request's prompt + output tokens in each batch phase that runs: {8: ..., 32: ...}."""
    return {n: ctx + out for n, ctx, out in ((8, args.bs8_ctx, args.bs8_tokens), (32, args.bs32_ctx, args.bs32_tokens))
            if ctx > 0}


def fill_reasons(row: dict, tokens: dict[int, int], req_tokens: int) -> None:
    """``kv_requests`` (the KV room in requests of ``req_tokens``: the largest batch's prompt + output) and, for each
    phase of ``tokens``, ``bs{n}_why`` (full reason, '' when measured) and ``bs{n}_why_short`` (the table's cell)."""
    kv = row.get("kv_tokens")
    row["kv_requests"] = round(kv / req_tokens, 2) if kv and req_tokens else None
    for n, length in tokens.items():
        why = missing_reason(n, length, row.get(f"bs{n}_steps"), row.get(f"bs{n}_max_decoding"),
                             row.get(f"bs{n}_preemptions"), kv, row.get("error"))
        row[f"bs{n}_why_short"], row[f"bs{n}_why"] = why or ("", "")


def write_csv(rows: list[dict], path: str) -> None:
    """``results.csv``: FIELDS; a figure that could not be measured is left empty (its ``bs{n}_why`` says why)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: "" if _nan(v) else v for k, v in r.items()} for r in rows)


def results_table(rows: list[dict]) -> str:
    """The markdown table of TABLE_FIELDS, then one footnote per missing batch figure: its cells read
    "<short> [k]" (the step) or "n/a [k]" (figures derived from it), footnote k the full reason; never "nan"."""
    def fmt(v):
        return "-" if v is None else "n/a" if _nan(v) else f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(TABLE_FIELDS) + " |", "|" + "---|" * len(TABLE_FIELDS)]
    notes = []
    for r in rows:
        marks = {}  # field prefix -> (footnote number, short form)
        for n in BATCHES:
            if r.get(f"bs{n}_why"):
                notes.append(f"[{len(notes) + 1}] {r.get('impl')}, batch {n}: {r[f'bs{n}_why']}")
                marks[f"bs{n}_"] = (len(notes), r.get(f"bs{n}_why_short") or "n/a")
        cells = []
        for k in TABLE_FIELDS:
            v, m = r.get(k), next((m for pre, m in marks.items() if k.startswith(pre)), None)
            if m and k.endswith("_step_ms"):
                cells.append(f"{m[1]} [{m[0]}]")
            elif m and _nan(v):
                cells.append(f"n/a [{m[0]}]")
            else:
                cells.append(fmt(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + ([""] + notes if notes else []))


RATIO_KEYS = ("bs1_tpot_ms", "bs1_step_ms", "bs1_tok_s_user", "bs8_step_ms", "bs32_step_ms", "bs32_decode_tok_s")


def ratio_lines(by: dict[str, dict], pairs: list[tuple[str, str]]) -> list[str]:
    """"KEY: A/B = r" for each pair both of whose rows have KEY; where a batch figure is missing, "n/a" and why."""
    out = []
    for a_name, b_name in pairs:
        if a_name not in by or b_name not in by:
            continue
        for k in RATIO_KEYS:
            a, b = by[a_name].get(k), by[b_name].get(k)
            if a and b and not _nan(a) and not _nan(b):
                out.append(f"{k}: {a_name}/{b_name} = {a / b:.2f}")
                continue
            n = k.split("_")[0][2:]
            whys = [f"{name}: {by[name].get(f'bs{n}_why_short')}" for name in (a_name, b_name)
                    if n.isdigit() and by[name].get(f"bs{n}_why")]
            if whys:
                out.append(f"{k}: {a_name}/{b_name} n/a ({'; '.join(whys)})")
    return out


def moe_backend(log_path: str) -> str:
    """The MoE backend the worker's vLLM logged ("Using 'HUMMING' NvFp4 MoE backend ...": NVFP4:HUMMING; else the
    last "Using X ... MoE backend"), '' when none."""
    import re

    try:
        text = open(log_path, errors="replace").read()
    except OSError:
        return ""
    m = re.findall(r"Using '(\w+)' NvFp4 MoE backend", text)
    if m:
        return "NVFP4:" + m[-1]
    m = re.findall(r"Using (\S+) (?:\w+ )?MoE backend", text)
    return m[-1] if m else ""


def jit_during_inference(log_path: str) -> str:
    """The kernels vLLM's JIT monitor saw compile after start-up ("Triton kernel JIT compilation during inference:
    NAME (...)"), sorted and ';'-joined ('' when none): what a start-up warm-up left to the first requests."""
    import re

    try:
        text = open(log_path, errors="replace").read()
    except OSError:
        return ""
    return ";".join(sorted(set(re.findall(r"during inference: (\w+(?:\.\w+)*)", text))))


def package_root() -> str:
    """The checkout (folder holding ``qwen4exp/``) this process imported the package from, '' when not imported."""
    mod = sys.modules.get("qwen4exp")
    f = getattr(mod, "__file__", None)
    return os.path.dirname(os.path.dirname(os.path.abspath(f))) if f else ""


def parse_variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """``--variant NAME=ENV=VALUE[;ENV=VALUE...]`` -> {NAME: {ENV: VALUE}}: ours with those environment settings,
    runnable under NAME in ``--impls`` (an A/B of a plugin switch, e.g. ``prefetch=QWEN4EXP_PLE_PREFETCH=1``)."""
    out = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        name = name.strip()
        pairs = [p.partition("=") for p in rest.split(";") if p.strip()]
        if not sep or not name or name in ("ours", "upstream") or not pairs or any(not e or not q for e, q, _ in pairs):
            raise SystemExit(f"--variant {spec!r}: want NAME=ENV=VALUE[;ENV=VALUE...] with a new NAME")
        out[name] = {e.strip(): v.strip() for e, _, v in pairs}
    return out


def parse_ours_at(specs: list[str]) -> dict[str, str]:
    """``--ours-at NAME=PATH`` -> {NAME: absolute PATH}: ours from the checkout at PATH (a folder with
    ``qwen4exp/__init__.py``), runnable under NAME in ``--impls``. A NAME that is also a ``--variant`` gets both."""
    out = {}
    for spec in specs:
        name, sep, path = (x.strip() for x in spec.partition("="))
        if not sep or not name or not path or name in ("ours", "upstream") or name in out:
            raise SystemExit(f"--ours-at {spec!r}: want NAME=PATH with a new NAME")
        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isfile(os.path.join(path, "qwen4exp", "__init__.py")):
            raise SystemExit(f"--ours-at {spec!r}: {path} holds no qwen4exp package (qwen4exp/__init__.py)")
        out[name] = path
    return out


def worker_env(impl: str, args, variants: dict, ours_at: dict, gpu: str | None = None) -> dict:
    """The environment of ``impl``'s worker: upstream (``QWEN4EXP_VLLM=0``), ours, or a ``--variant`` /
    ``--ours-at`` of ours (its checkout first on PYTHONPATH, so it wins over the installed package and this one)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if args.mp else "0")
    env["QWEN4EXP_VLLM"] = "0" if impl == "upstream" else "1"
    env.update(variants.get(impl, {}))
    if impl in ours_at:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ours_at[impl], env.get("PYTHONPATH")]))
    # both: vLLM's FlashInfer top-k/top-p sampler is JIT-built on a fresh machine (~2 min of start-up);
    # greedy sampling does not use it
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if args.py_spy:
        env["QWEN4EXP_PYSPY"] = os.path.abspath(args.py_spy)
        env["QWEN4EXP_PYSPY_OUT"] = os.path.abspath(os.path.join(args.out, f"pyspy-{impl}"))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def package_label(root: str) -> str:
    """A checkout for the results table: its git commit (``-dirty`` with local changes) where the folder is a git
    work tree of its own, else the folder's name."""
    if not root:
        return ""

    def git(*a):
        return subprocess.run(["git", "-C", root, *a], capture_output=True, text=True, timeout=10)

    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode == 0 and os.path.realpath(top.stdout.strip()) == os.path.realpath(root):
            d = git("describe", "--always", "--dirty")
            if d.returncode == 0 and d.stdout.strip():
                return d.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return os.path.basename(root.rstrip(os.sep))


def package_error(impl: str, row: dict, ours_at: dict) -> str | None:
    """An ``--ours-at`` run whose worker imported qwen4exp from elsewhere than its checkout: what went wrong."""
    got = row.get("qwen4exp_from")
    if impl not in ours_at or got is None:  # (no result: the run's own error says why)
        return None
    if os.path.realpath(got or "-") != os.path.realpath(ours_at[impl]):
        return f"ran qwen4exp from {got or 'nowhere (plugin not loaded)'}, not {ours_at[impl]}"
    return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out/vllm_gpu", help="folder for config, logs, results.csv")
    ap.add_argument("--impls", default="upstream,ours", help="comma list: upstream (QWEN4EXP_VLLM=0), ours, and "
                    "the NAMEs of --variant / --ours-at")
    ap.add_argument("--layers", type=int, default=None, help="FN depth (default 12 = FN-12L; fn-nvfp4: 48)")
    ap.add_argument("--preset", default="fn", choices=("fn", "fn-nvfp4", "tiny"), help="fn: FN-12L (bf16); "
                    "fn-nvfp4: FN-48L-NVFP4, the upstream full-depth anchor (its quantization_config, 48 layers, "
                    "both engines at --gpu-util 0.92, batch 8 too); tiny: the test model (a CPU smoke run)")
    ap.add_argument("--ctx", type=int, default=50_000, help="batch-1 prompt length")
    ap.add_argument("--out-tokens", type=int, default=256, help="batch-1 output tokens")
    ap.add_argument("--bs32-ctx", type=int, default=50_000, help="batch-32 prompt length (0: skip batch 32)")
    ap.add_argument("--bs8-ctx", type=int, default=None, help="batch-8 prompt length (default 0 = skip; "
                    "fn-nvfp4: 50,000)")
    ap.add_argument("--bs8-tokens", type=int, default=None, help="batch-8 output tokens per request (default 96, "
                    "times --acceptance-length with --mtp)")
    ap.add_argument("--mtp", type=int, default=0, help="MTP drafts a step (0: off); dummy weights never draft right, "
                    "so drafts are accepted by vLLM's synthetic rejection sampling at --acceptance-length")
    ap.add_argument("--acceptance-length", type=float, default=3.23, help="mean tokens a step with --mtp (default "
                    "3.23: TokenSpeed's measured figure for this model with 3 drafts)")
    ap.add_argument("--bs32-tokens", type=int, default=None,
                    help="batch-32 output tokens per request (default 192, times --acceptance-length with --mtp): "
                         "enough to outlast the batch's prefill (32 x 50k tokens at 16,384 a step: ~100 steps, "
                         "during which the first requests already decode), so that there are steps with all 32 "
                         "decoding; only those are timed (bs32_steps: how many)")
    ap.add_argument("--eager", default="", help="comma list of impls run with enforce_eager (default none: vLLM's "
                    "defaults, i.e. CUDA graphs; for Qwen4Exp vLLM uses breakable graphs, see qwen4exp/vllm/README.md)")
    ap.add_argument("--gpu-util", type=float, default=None, help="upstream's gpu_memory_utilization (default 0.85)")
    ap.add_argument("--gpu-util-ours", type=float, default=None, help="ours: vLLM's profiling run does not see the "
                    "peak of our eager QSA prefill (its per-chunk sort keys and scratch), so leave it headroom (default 0.7)")
    ap.add_argument("--profile", action="store_true", help="torch-profiler table of 8 batch-1 decode steps per impl "
                    "(<impl>.profile.txt; those steps are left out of the timings, not of the end-to-end TPOT), "
                    "and of 8 batch-32 decode steps (<impl>.profile-bs32.txt; left out of the batch-32 figures)")
    ap.add_argument("--warm-prefill", action="store_true", help="time the batch-1 prefill a second time (after "
                    "first-use costs); with --profile also a profiler table of its first two chunks")
    ap.add_argument("--profile-gpu-only", action="store_true", help="with --profile: record GPU activity only (no "
                    "host ops: the host keeps its unprofiled speed, so GPU idle time per step is the real one)")
    ap.add_argument("--profile-host-stacks", action="store_true", help="with --profile --mp: record Python stacks "
                    "in the engine core's traces (trace_summary.py then tables host time by Python function; the "
                    "profiled steps' host runs several times slower, so read its shares, not its absolute times)")
    ap.add_argument("--py-spy", default="", help="path of a py-spy executable (e.g. `pip install --target .whl/pyspy "
                    "py-spy`): record the Python stacks of the bench and its engine core from outside (no GIL bias, "
                    "no pausing) during a batch-1 request of its own after the timed one, and batch-8 / batch-32 "
                    "decode steps 4-27, which the step medians leave out: OUT/pyspy-IMPL-LABEL.txt")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ENV=VALUE",
                    help="NAME=ENV=VALUE[;ENV=VALUE...]: ours with those environment settings, run as NAME when "
                    "--impls names it (repeatable)")
    ap.add_argument("--ours-at", action="append", default=[], metavar="NAME=PATH", help="ours from the checkout at "
                    "PATH (its qwen4exp first on PYTHONPATH), run as NAME when --impls names it (repeatable): an A/B "
                    "of two commits' packages in one call")
    ap.add_argument("--mp", action="store_true", help="the engine core in its own process, as `vllm serve` and "
                    "`LLM` run it by default (and as the upstream anchor was measured): its host work (schedule, "
                    "inputs, outputs) overlaps this process's; default: in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    ap.add_argument("--timeout", type=float, default=560, help="seconds per implementation")
    ap.add_argument("--gpus", default="", help="comma list of GPU ids, one per implementation (e.g. 0,1): all "
                    "implementations then run at the same time, each on its own GPU")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    return ap


def worker_runs(args, impls: list[str], model: str, variants: dict, ours_at: dict) -> list[tuple]:
    """(impl, result path, log path, command, environment) of each implementation's worker."""
    eager = set(args.eager.split(","))
    gpus = [g for g in args.gpus.split(",") if g] if args.gpus else []
    runs = []
    for i, impl in enumerate(impls):
        res_path = os.path.join(args.out, f"{impl}.json")
        log = os.path.join(args.out, f"{impl}.log")
        env = worker_env(impl, args, variants, ours_at, gpus[i % len(gpus)] if gpus else None)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--impl", impl, "--model", model,
               "--result", res_path, "--ctx", str(args.ctx), "--out-tokens", str(args.out_tokens),
               "--bs32-ctx", str(args.bs32_ctx), "--bs32-tokens", str(args.bs32_tokens),
               "--bs8-ctx", str(args.bs8_ctx), "--bs8-tokens", str(args.bs8_tokens), "--preset", args.preset,
               "--mtp", str(args.mtp), "--acceptance-length", str(args.acceptance_length),
               "--eager", "1" if impl in eager else "0",
               "--gpu-util", str(args.gpu_util if impl == "upstream" else args.gpu_util_ours)]
        for flag in ("profile", "warm_prefill", "mp", "profile_gpu_only", "profile_host_stacks"):
            if getattr(args, flag):
                cmd.append("--" + flag.replace("_", "-"))
        runs.append((impl, res_path, log, cmd, env))
    return runs


def apply_preset(args) -> None:
    """Fill the options left unset (None) from the preset's defaults, then the general ones."""
    base = dict(layers=12, gpu_util=0.85, gpu_util_ours=0.7, bs8_ctx=0)
    for k, v in {**base, **PRESET_DEFAULTS.get(args.preset, {})}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    # a batch's requests must outlast its prefill for steps with all of them decoding; with MTP a step gains
    # ~acceptance-length tokens, so the same number of steps needs that many times the tokens
    per_step = tokens_per_step(args.mtp, args.acceptance_length)
    for k, v in (("bs8_tokens", 96), ("bs32_tokens", 192)):
        if getattr(args, k) is None:
            setattr(args, k, int(round(v * per_step)))


def main() -> None:
    args = build_parser().parse_args()
    apply_preset(args)
    if args.worker:
        args.eager = args.eager == "1"
        return worker(args)

    os.makedirs(args.out, exist_ok=True)
    model = os.path.join(args.out, f"{args.preset}{args.layers}l")
    cfg = write_config(model, args.layers, args.preset)
    bw = copy_bandwidth()
    rb = roofline_bytes(cfg, args.ctx)
    roof_ms = 1e3 * rb["total"] / bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; batch-1 bytes/step at ctx {args.ctx}: weights "
          f"{rb['weights'] / 1e9:.2f} GB + GDN state {rb['gdn_state'] / 1e9:.3f} GB + QSA keys "
          f"{rb['qsa_kv'] / 1e9:.3f} GB -> roofline {roof_ms:.3f} ms", flush=True)
    rows = []
    impls = args.impls.split(",")
    variants, ours_at = parse_variants(args.variant), parse_ours_at(args.ours_at)
    unknown = [i for i in impls if i not in ("ours", "upstream") and i not in variants and i not in ours_at]
    if unknown:
        raise SystemExit(f"--impls: {', '.join(unknown)} is neither ours, upstream, a --variant nor an --ours-at")
    gpus = [g for g in args.gpus.split(",") if g] if args.gpus else []
    runs = worker_runs(args, impls, model, variants, ours_at)
    for _impl, res_path, _log, _cmd, _env in runs:
        if os.path.exists(res_path):
            os.remove(res_path)
    # one GPU per implementation when --gpus names enough of them: all run at once (same wall clock, same host
    # load); otherwise one after the other
    parallel = len(gpus) >= len(impls) > 1
    procs, errs = {}, {}
    t_start = time.monotonic()
    for impl, _res, log, cmd, env in runs:
        lf = open(log, "w")
        procs[impl] = (subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True),
                       lf)
        if not parallel:
            errs[impl] = _finish(procs[impl], args.timeout)
    for impl, res_path, log, _cmd, _env in runs:
        row = dict(impl=impl)
        if impl not in errs:
            errs[impl] = _finish(procs[impl], max(1.0, args.timeout - (time.monotonic() - t_start)))
        err = errs[impl]
        if err:
            row["error"] = f"{err} (see {os.path.basename(log)})"
        if os.path.exists(res_path):
            row.update(json.load(open(res_path)))
        else:  # partial: the batch-1 line printed before batch 32
            for line in open(log):
                if line.startswith('{"impl"'):
                    row.update(json.loads(line))
        row["roofline_ms"] = roof_ms
        if not row.get("mtp") and row.get("bs1_step_ms"):  # (with MTP a step reads the weights for ~3 tokens)
            row["bs1_bw_fraction"] = roof_ms / row["bs1_step_ms"]
        if not row.get("kv_tokens"):  # (a worker that died before reporting it: vLLM logged it at start-up)
            row["kv_tokens"] = kv_tokens_from_log(log)
        tokens = phase_tokens(args)
        fill_reasons(row, tokens, tokens[max(tokens)] if tokens else args.ctx + args.out_tokens)
        row["moe_backend"] = moe_backend(log)
        row["jit_during_inference"] = jit_during_inference(log)
        row["package"] = "" if impl == "upstream" else package_label(row.get("qwen4exp_from") or "")
        bad = package_error(impl, row, ours_at)
        if bad:
            row["error"] = "; ".join(filter(None, [row.get("error"), bad]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_csv(rows, os.path.join(args.out, "results.csv"))
    print("\n" + results_table(rows))
    by = {r["impl"]: r for r in rows}
    others = [*variants, *(n for n in ours_at if n not in variants)]
    for line in ratio_lines(by, [("ours", "upstream")] + [(v, base) for v in others for base in ("ours", "upstream")]):
        print(line)


if __name__ == "__main__":
    main()
