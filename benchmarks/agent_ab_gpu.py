"""AgentScheduler vs vLLM's default scheduler on a GPU: FN-12L (real widths, dummy weights), the agent workload of
issue 27 (long first turns, +N tokens a turn, tool pauses, one session id per conversation), one command.

    python benchmarks/agent_ab_gpu.py --out bench_out/agent-ab                 # no pressure, then under pressure
    python benchmarks/agent_ab_gpu.py --out bench_out/agent-ab --no-pressure   # only the first A/B
    python benchmarks/agent_ab_gpu.py --out bench_out/agent-ab-mtp --mtp 3     # both servers drafting with MTP
    python benchmarks/agent_ab_gpu.py --out bench_out/agent-ab --phases pressure   # only the A/B under pressure (the
                                                                   # KV bytes a token from a probe start)
    python benchmarks/agent_ab_gpu.py --out bench_out/agent-ab --phases pressure --pressure-factor 1.5,1.2
                                                                   # one pressure phase a factor

Both A/Bs are ``qwen4exp-bench --ab default='ARGS' agent='ARGS --scheduler-cls ...'`` (the same seeded
conversations, one server after the other, each server's log under OUT/<phase>/<config>/). The first runs with the
KV room vLLM gives at ``--gpu-util``. The second sizes the KV cache (``--kv-cache-memory-bytes``) from what the first
default server reported (bytes per token = its available KV memory / its KV tokens) to ``--pressure-factor`` times the
tokens the ``--concurrency`` active conversations need at their longest, so the default loses paused sessions' blocks
while the active ones still fit. Tables: OUT/<phase>/ab.csv (printed), OUT/summary.md with both.

The model directory is agentic_gpu.py's (FN-12L config + the tiny-coder tokenizer); sampling is restricted to ids
that decode to clean text, as there (the tokenizer is much smaller than the model's vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from agentic_gpu import allowed_ids, build_model_dir  # noqa: E402
from bench_vllm_gpu import mtp_config  # noqa: E402

from qwen4exp.bench.ab import split_env  # noqa: E402

AGENT = "--scheduler-cls qwen4exp.serving.scheduler.AgentScheduler"
# AgentScheduler with one thing changed: (environment, server arguments added after the shared ones). nocap: without
# its step cap for a waiting next turn; notok: without the plugin's tokenization cache; short: 4,096-token steps
# always, instead of 16,384 (not only during tool pauses); nopause: full steps during tool pauses too
# (QWEN4EXP_PAUSE_CHUNK=0); pause2k: 2,048-token prefill steps during tool pauses (one FN-12L block) instead of 4,096
AGENT_VARIANTS = {"nocap": ("QWEN4EXP_CONTINUATION_CHUNK=0", ""), "notok": ("QWEN4EXP_TOKENIZE_CACHE_TOKENS=0", ""),
                  "short": ("", "--max-num-batched-tokens 4096"), "nopause": ("QWEN4EXP_PAUSE_CHUNK=0", ""),
                  "pause2k": ("QWEN4EXP_PAUSE_CHUNK=2048", "")}
CONFIGS = ("default", "agent", *AGENT_VARIANTS)


def kv_bytes_per_token(server_log: str) -> float | None:
    """vLLM's start-up lines 'Available KV cache memory: X GiB' (or, with ``--kv-cache-memory-bytes``, 'reserved X
    GiB memory for KV Cache') and 'GPU KV cache size: N tokens' -> X / N bytes."""
    try:
        text = open(server_log, errors="replace").read()
    except OSError:
        return None
    mem = re.findall(r"(?:Available KV cache memory:|reserved) ([\d.]+) GiB(?: memory for KV Cache)?", text)
    tok = re.findall(r"GPU KV cache size: ([\d,]+) tokens", text)
    if not mem or not tok:
        return None
    return float(mem[-1]) * 2**30 / int(tok[-1].replace(",", ""))


PROBE_KV_BYTES = 2 << 30  # the probe server's fixed KV cache: enough for its start-up to log both KV lines


def probe_bytes_per_token(cmd: list[str], log: str, timeout: float, env: dict | None = None) -> float | None:
    """Start ``cmd`` (a server with ``--kv-cache-memory-bytes``), wait until its log has both KV lines (logged once
    the cache is allocated, before CUDA-graph capture), stop it: the KV bytes a token (``kv_bytes_per_token``), or
    None if it exited or ``timeout`` passed first. Lets ``--phases pressure`` run without the free phase."""
    from qwen4exp.demo import stop_server

    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            bpt = kv_bytes_per_token(log)
            if bpt or proc.poll() is not None:
                return bpt or kv_bytes_per_token(log)
            time.sleep(1.0)
        return None
    finally:
        stop_server(proc, timeout=30)


def gpu_name() -> str:
    """The first CUDA device's name for the tables ('NVIDIA H200' -> 'H200'); 'GPU' when torch has none."""
    try:
        import torch

        return torch.cuda.get_device_name(0).replace("NVIDIA ", "") if torch.cuda.is_available() else "GPU"
    except Exception:
        return "GPU"


def default_gpu_util() -> float:
    """0.7 where the card holds FN-12L's ~61 GiB of weights with room to spare (H200); 0.88 on an 80-GB card."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 100 * 2**30:
            return 0.88
    except Exception:
        pass
    return 0.7


def serve_args(args, model: str, model_len: int, extra_serve: str) -> str:
    """The server arguments both configurations share (one shell-quoted string, as ``qwen4exp-bench --ab`` takes
    them); ``--mtp K``: our MTP head drafting K tokens a step, accepted by vLLM's synthetic rejection sampling at
    ``--acceptance-length`` (dummy weights never draft right; the A/B is about what a turn finds cached)."""
    common = (f"{model} --load-format dummy --dtype bfloat16 --max-model-len {model_len} --max-num-seqs 32 "
              f"--max-num-batched-tokens 16384 --gpu-memory-utilization {args.gpu_util} --served-model-name model "
              f"--enable-prompt-tokens-details")
    if args.mtp:
        spec = mtp_config(args.mtp, args.acceptance_length)
        common += f" --speculative-config {shlex.quote(json.dumps(spec, separators=(',', ':')))}"
    return f"{common} {extra_serve}".strip()


def run_ab(args, phase: str, model: str, model_len: int, extra_serve: str, extra_body: dict | None) -> int:
    out = os.path.join(args.out, phase)
    common = serve_args(args, model, model_len, extra_serve)
    configs = {"default": common, "agent": f"{common} {AGENT}",
               **{name: f"{env} {common} {AGENT} {more}".strip() for name, (env, more) in AGENT_VARIANTS.items()}}
    abs_ = [x for c in args.configs.split(",") for x in ("--ab", f"{c}={configs[c]}")]
    if len(abs_) == 2:  # one configuration: --ab wants two or more, so a plain run against its own server
        abs_ = []
    cmd = [sys.executable, "-m", "qwen4exp.bench", "--serve-cmd", f"{shlex.quote(sys.executable)} -m qwen4exp.serve",
           *abs_, "--tokenizer", model,
           "--first-turn-tokens", str(args.first_turn_tokens), "--turn-tokens", str(args.turn_tokens),
           "--turns", str(args.turns), "--max-output-tokens", str(args.max_output_tokens),
           "--concurrency", str(args.concurrency), "--conversations", str(args.conversations), "--warmup", "1",
           "--think-time", args.think_time, "--seed", "42", "--num-gpus", "1", "--hardware", f"1x {gpu_name()}",
           "--request-timeout", "300", "--ab-start-timeout", str(args.start_timeout), "--no-progress",
           "--out", out]
    if extra_body:
        cmd += ["--extra-body", json.dumps(extra_body, separators=(",", ":"))]
    env = dict(os.environ)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # greedy: the torch sampler (no first-use JIT build)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    t0 = time.monotonic()
    if not abs_:
        return run_one(args, phase, cmd, configs[args.configs], env)
    with open(os.path.join(args.out, f"{phase}.log"), "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=args.phase_timeout)
        except subprocess.TimeoutExpired:  # SIGINT first: --ab then writes what it has and stops its server
            os.killpg(p.pid, signal.SIGINT)
            try:
                rc = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
    print(f"== {phase} ({extra_serve or 'KV room at --gpu-util'}): rc={rc}, {time.monotonic() - t0:.0f} s")
    try:
        print(open(os.path.join(out, "ab.txt")).read() if os.path.exists(os.path.join(out, "ab.txt"))
              else open(os.path.join(out, "ab.csv")).read())
    except OSError:
        print(open(os.path.join(args.out, f"{phase}.log"), errors="replace").read()[-3000:])
    return rc


def run_one(args, phase: str, bench: list[str], serve_args: str, env: dict) -> int:
    """One configuration (--configs NAME): its server, then the bench against it, into OUT/<phase>/<NAME>/."""
    from qwen4exp.demo import free_port, stop_server, wait_ready

    name = args.configs
    out = os.path.join(args.out, phase, name)
    os.makedirs(out, exist_ok=True)
    port = free_port()
    senv, words = split_env(serve_args)
    with open(os.path.join(out, "server.log"), "w") as lf:
        srv = subprocess.Popen([sys.executable, "-m", "qwen4exp.serve", *words, "--host", "127.0.0.1", "--port",
                                str(port)], stdout=lf, stderr=subprocess.STDOUT, env={**env, **senv},
                               start_new_session=True)
    try:
        wait_ready(srv, port, timeout=args.start_timeout)
        i = bench.index("--out")
        bench = bench[:i] + ["--out", out, "--label", name, "--base-url", f"http://127.0.0.1:{port}/v1",
                             "--model", "model"] + bench[i + 2:]
        with open(os.path.join(args.out, f"{phase}-{name}.log"), "w") as f:
            rc = subprocess.call(bench, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.phase_timeout)
        print(f"== {phase}/{name}: rc={rc}")
        print(open(os.path.join(out, "summary.csv")).read() if os.path.exists(os.path.join(out, "summary.csv"))
              else "(no summary.csv)")
        return rc
    finally:
        stop_server(srv, timeout=30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out/agent-ab")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--first-turn-tokens", type=int, default=50000)
    ap.add_argument("--turn-tokens", type=int, default=800)
    ap.add_argument("--turns", default="3")
    ap.add_argument("--max-output-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--think-time", default="lognormal:0.5,1,3")
    ap.add_argument("--gpu-util", type=float, help="vLLM's --gpu-memory-utilization (default 0.7; 0.88 on a card "
                    "under 100 GiB, where FN-12L's weights leave little KV room at 0.7)")
    ap.add_argument("--pressure-factor", default="1.5",
                    help="KV room under pressure, in units of what --concurrency active conversations need; a comma "
                    "list runs one pressure phase each (OUT/pressure for the first, OUT/pressure-xF for the others)")
    ap.add_argument("--no-pressure", action="store_true")
    ap.add_argument("--phases", default="free,pressure", help="comma list of free, pressure")
    ap.add_argument("--configs", default="default,agent", help="comma list of default, agent, " + ", ".join(
        f"{name} (AgentScheduler with {env or more})" for name, (env, more) in AGENT_VARIANTS.items())
        + "; one: a plain run")
    ap.add_argument("--bytes-per-token", type=float, help="KV bytes a token for the pressure phase (default: read "
                    "from the free phase's default server log)")
    ap.add_argument("--mtp", type=int, default=0, help="MTP drafts a step for both servers (0: off; AgentScheduler "
                    "then has no exact resume: a next turn finds what vLLM's default finds, bounded by vLLM's "
                    "EAGLE block drop)")
    ap.add_argument("--acceptance-length", type=float, default=3.23, help="with --mtp: the synthetic mean "
                    "tokens a step (TokenSpeed's measured 3.23)")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--phase-timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    args.gpu_util = args.gpu_util or default_gpu_util()
    if args.mtp < 0:
        ap.error("--mtp: want 0 (off) or the number of drafts a step")
    names = args.configs.split(",")
    if not names or set(names) - set(CONFIGS) or len(set(names)) != len(names):
        ap.error(f"--configs: want distinct names of {', '.join(CONFIGS)}, comma-separated (got {args.configs!r})")
    try:
        factors = [float(f) for f in str(args.pressure_factor).split(",")]
    except ValueError:
        factors = []
    if not factors or min(factors) <= 0:
        ap.error(f"--pressure-factor: want positive numbers, comma-separated (got {args.pressure_factor!r})")
    if args.mtp:
        try:
            mtp_config(args.mtp, args.acceptance_length)
        except SystemExit as e:  # an acceptance length outside [1, K + 1]
            ap.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    turns = int(str(args.turns).split("-")[-1])
    longest = args.first_turn_tokens + (turns - 1) * (args.turn_tokens + args.max_output_tokens) \
        + args.max_output_tokens + 256
    model_len = 1024 * -(-longest // 1024)
    model = build_model_dir(args.out, "fn", args.layers, model_len)
    ids = allowed_ids(model)
    body = {"allowed_token_ids": ids} if ids else None
    phases = args.phases.split(",")
    rc = run_ab(args, "free", model, model_len, "", body) if "free" in phases else 0
    if args.no_pressure or "pressure" not in phases:
        return rc
    bpt = args.bytes_per_token or kv_bytes_per_token(os.path.join(args.out, "free", "default", "server.log"))
    if bpt is None and "free" not in phases:  # no free phase to read it from: a probe start of the server
        from qwen4exp.demo import free_port

        probe = os.path.join(args.out, "probe")
        os.makedirs(probe, exist_ok=True)
        cmd = [sys.executable, "-m", "qwen4exp.serve",
               *shlex.split(serve_args(args, model, model_len, f"--kv-cache-memory-bytes {PROBE_KV_BYTES}")),
               "--host", "127.0.0.1", "--port", str(free_port())]
        bpt = probe_bytes_per_token(cmd, os.path.join(probe, "server.log"), args.start_timeout)
        print(f"probe: {bpt and round(bpt)} KV bytes a token", flush=True)
    if bpt is None:
        print("no KV size in the default server's log: pressure phase skipped")
        return 1
    for i, factor in enumerate(factors):
        nbytes = int(bpt * factor * args.concurrency * longest)
        phase = "pressure" if i == 0 else f"pressure-x{factor:g}"
        print(f"{phase}: {bpt:.0f} B/token -> --kv-cache-memory-bytes {nbytes} "
              f"({factor:g} x {args.concurrency} x {longest} tokens)")
        rc = run_ab(args, phase, model, model_len, f"--kv-cache-memory-bytes {nbytes}", body) or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
