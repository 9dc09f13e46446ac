"""Agent sessions on 2 CPU replicas behind vllm-router: session-affine policies against round-robin, and failover.

    .venv/bin/python benchmarks/router_cpu.py --out bench_out/router   # about 2.5 minutes on 2 cores

One run, one set of replicas (``python -m qwen4exp.replicas``: tiny-coder, ``AgentScheduler``, a KV cache of
``--kv-blocks`` blocks each, small enough that a replica cannot keep every session's last turn):

1. for each ``--policies`` entry the router is restarted with it (the replicas keep running) and ``--sessions``
   sessions of ``--turns`` turns with ``--think-s`` tool pauses run at once (distinct session ids and a fresh
   nonce per policy, every session closed on its last turn, so no policy finds another's cache): turn>=2 cached
   fraction (of what the previous turn processed), turn>=2 TTFT p50/p99, requests and tokens (prompt + generated)
   per replica from each replica's ``/metrics``;
2. failover (the first policy): ``--failover-sessions`` sessions; third turns wait until every second turn is
   done, then go, and ``--kill-delay-s`` later replica 0 is killed (SIGKILL of its process group) under them
   (those in flight are cut, later ones find it dead); it is started again at once. Counted: failed turns (must
   be 0), client retries (streams cut by the kill), router retries, the sessions that moved (their first turn
   after the kill found < 0.5 of their history cached: re-formed on the survivor as a first turn) and the cache
   reuse of their turns after that; once replica 0 is back and healthy in the router, new sessions run and the
   requests it took count;
3. greedy outputs through the router and directly from each replica (temperature 0), and the retained sessions
   each replica's ``/metrics`` shows.

Writes OUT/router.csv (one row per policy), OUT/failover.json, OUT/summary.json, OUT/turns.jsonl and OUT/table.md,
and prints the table. ``tests/test_router.py`` runs it and checks the goals.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import secrets
import signal
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qwen4exp.bench.fleet import SessionRun, replica_counters, table, turns_rows  # noqa: E402
from qwen4exp.replicas import ASSET, Fleet  # noqa: E402
from qwen4exp.demo import free_port  # noqa: E402

COLS = ["policy", "sessions", "turn2_cached_fraction", "turn2_cached_min", "turn2_ttft_p50_ms", "turn2_ttft_p99_ms",
        "requests_per_replica", "tokens_per_replica", "busiest_over_idlest", "failed", "client_retries", "wall_s"]
GREEDY_PROMPTS = ["Write a Python function `is_prime(n)`.", "def fibonacci(n):", "class Stack:\n    def push(self, x):"]


def _post(url: str, body: dict, headers: dict | None = None, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def router_counter(fl: Fleet, name: str) -> float:
    try:
        with urllib.request.urlopen(fl.metrics_url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return float("nan")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def greedy_check(fl: Fleet) -> dict:
    """Temperature-0 answers through the router and from each replica directly: identical?"""
    out = {"identical": True, "prompts": len(GREEDY_PROMPTS), "retained_sessions_per_replica": None}
    for i, prompt in enumerate(GREEDY_PROMPTS):
        body = {"model": fl.served_name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
                "temperature": 0}
        texts = [_post(fl.url + "/v1/chat/completions", body, {"X-Session-ID": f"greedy-{i}"})
                 ["choices"][0]["message"]["content"]]
        texts += [_post(m.url + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
                  for m in fl.members]
        if len(set(texts)) != 1:
            out["identical"] = False
            out.setdefault("differ", []).append({"prompt": prompt, "texts": texts})
    try:
        with urllib.request.urlopen(fl.metrics_url, timeout=5) as r:
            out["router_metrics"] = "vllm_router_requests_total" in r.read().decode()
    except OSError:
        out["router_metrics"] = False
    # the greedy-i sessions were not closed: each replica that served one retains it
    out["retained_sessions_per_replica"] = [replica_counters(m.url)["retained_sessions"] for m in fl.members]
    return out


async def policy_run(fl: Fleet, policy: str, a, nonce: str) -> tuple[dict, list]:
    if policy != fl.policy:
        fl.start_router(policy)
    run = SessionRun(fl.url + "/v1", ASSET, sessions=a.sessions, turns=a.turns,
                     first_turn_tokens=a.first_turn_tokens, turn_tokens=a.turn_tokens,
                     max_output_tokens=a.max_output_tokens, think_s=a.think_s, prefix=f"{policy}-{nonce}")
    res = await run.run([m.url for m in fl.members])
    row = {"policy": policy, "sessions": a.sessions, **res.summary()}
    return row, [dict(r, policy=policy) for r in turns_rows(res)]


async def failover_run(fl: Fleet, a, nonce: str) -> tuple[dict, list]:
    if fl.policy != a.policies[0]:
        fl.start_router(a.policies[0])
    run = SessionRun(fl.url + "/v1", ASSET, sessions=a.failover_sessions, turns=a.turns,
                     first_turn_tokens=a.first_turn_tokens, turn_tokens=a.turn_tokens,
                     max_output_tokens=a.max_output_tokens, think_s=a.think_s, prefix=f"failover-{nonce}")
    await run.plan()
    state: dict = {}
    router_retries0 = router_counter(fl, "vllm_router_retries_total")

    run.gates[3] = gate = asyncio.Event()

    async def kill_then_restart() -> float:
        gate.set()  # third turns go (each after its tool pause) ...
        await asyncio.sleep(a.kill_delay_s)  # ... and replica 0 dies under them
        state["killed_at_s"] = round(time.perf_counter() - state["t0"], 3)
        await asyncio.to_thread(fl.members[0].kill)
        return await asyncio.to_thread(fl.restart, 0)

    async def on_turn(t, out) -> None:
        if "task" not in state and sum(1 for x in out if x.turn == 2) == a.failover_sessions:
            state["task"] = asyncio.create_task(kill_then_restart())

    state["t0"] = time.perf_counter()
    res = await run.run([m.url for m in fl.members], on_turn)
    if "task" not in state:
        raise RuntimeError("failover: the kill never happened (a second turn failed?)")
    restart_s = await state["task"]
    # the run's own clock starts a hair after state["t0"]; turn times are relative to the run's start
    killed = state["killed_at_s"]
    moved, stayed, moved_later = [], [], []
    for sid in sorted({t.session for t in res.turns}):
        ts = [t for t in res.turns if t.session == sid and t.ok]
        after = [t for t in ts if t.turn >= 2 and t.end_s > killed]
        if not after:
            continue
        if after[0].cached_fraction is not None and after[0].cached_fraction < 0.5:
            moved.append(sid)
            moved_later += [t.cached_fraction for t in after[1:] if t.cached_fraction is not None]
        else:
            stayed.append(sid)
    # replica 0 back: healthy in the router, then new sessions
    t0 = time.monotonic()
    while fl.worker_health().get(fl.members[0].url) != 1.0 and time.monotonic() - t0 < 60:
        await asyncio.sleep(0.5)
    rejoin_s = time.monotonic() - t0
    await asyncio.sleep(6)  # the circuit breaker's open state (--cb-timeout-duration-secs 5) ends
    back = SessionRun(fl.url + "/v1", ASSET, sessions=a.failover_sessions, turns=2,
                      first_turn_tokens=a.first_turn_tokens, turn_tokens=a.turn_tokens,
                      max_output_tokens=a.max_output_tokens, think_s=a.think_s, prefix=f"back-{nonce}")
    back_res = await back.run([m.url for m in fl.members])
    s = res.summary()
    out = {
        "policy": a.policies[0], "sessions": a.failover_sessions, "turns": s["turns"], "failed": s["failed"],
        "client_retries": s["client_retries"],
        "router_retries": router_counter(fl, "vllm_router_retries_total") - router_retries0,
        "errors_seen": sorted({e.split(" [")[0] for t in res.turns for e in t.errors}),
        "killed_at_s": killed, "restart_s": round(restart_s, 1), "router_rejoin_wait_s": round(rejoin_s, 1),
        "moved_sessions": len(moved), "stayed_sessions": len(stayed),
        "moved_later_cached_fraction": round(sum(moved_later) / len(moved_later), 3) if moved_later else None,
        "max_turn_s": round(max(t.end_s - t.start_s for t in res.turns), 2),
        "after_return_requests_per_replica": back_res.summary()["requests_per_replica"],
        "after_return_failed": back_res.summary()["failed"],
    }
    rows = [dict(r, policy="failover") for r in turns_rows(res)]
    rows += [dict(r, policy="after-return") for r in turns_rows(back_res)]
    return out, rows


async def amain(a, fl: Fleet) -> dict:
    nonce = secrets.token_hex(3)
    rows, turn_rows = [], []
    for policy in a.policies:
        row, tr = await policy_run(fl, policy, a, nonce)
        print(table([row], COLS).splitlines()[-1], flush=True)
        rows.append(row)
        turn_rows += tr
    fo = None
    if a.failover:
        fo, tr = await failover_run(fl, a, nonce)
        print("failover:", json.dumps(fo), flush=True)
        turn_rows += tr
    greedy = greedy_check(fl)
    return {"rows": rows, "failover": fo, "greedy": greedy, "turn_rows": turn_rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--policies", default="sticky_least_loaded,consistent_hash,round_robin",
                   help="comma-separated vllm-router policies; the first also runs the failover")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--failover-sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-turn-tokens", type=int, default=600)
    p.add_argument("--turn-tokens", type=int, default=100)
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--think-s", type=float, default=1.0)
    p.add_argument("--kill-delay-s", type=float, default=0.05,
                   help="from the release of the third turns (held until every second turn is done) to the kill")
    p.add_argument("--kv-blocks", type=int, default=40, help="KV blocks per replica (40: about 6,800 tokens)")
    p.add_argument("--no-failover", dest="failover", action="store_false")
    a = p.parse_args(argv)
    a.policies = [x.strip() for x in a.policies.split(",") if x.strip()]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    fl = Fleet(model=ASSET, replicas=2, port=free_port(), policy=a.policies[0], workdir=out / "logs",
               serve_args=["--max-model-len", "2048", "--enforce-eager", "--num-gpu-blocks-override",
                           str(a.kv_blocks), "--max-num-seqs", "4"])

    def _term(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    t0 = time.monotonic()
    try:
        fl.start()
        # the process groups, for a caller that must clean up after a killed run
        (out / "pgids").write_text(" ".join(str(m.proc.pid) for m in fl.members) + f" {fl.router.pid}\n")
        startup = time.monotonic() - t0
        print(f"2 replicas + vllm-router up in {startup:.1f} s", flush=True)
        r = asyncio.run(amain(a, fl))
    finally:
        fl.stop()
    r["startup_s"] = round(startup, 1)
    r["total_s"] = round(time.monotonic() - t0, 1)
    with open(out / "router.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLS)
        w.writeheader()
        w.writerows({c: row.get(c) for c in COLS} for row in r["rows"])
    with open(out / "turns.jsonl", "w") as f:
        for row in r.pop("turn_rows"):
            f.write(json.dumps(row) + "\n")
    (out / "failover.json").write_text(json.dumps(r["failover"], indent=1))
    (out / "summary.json").write_text(json.dumps(r, indent=1))
    md = table(r["rows"], COLS)
    (out / "table.md").write_text(md + "\n")
    print(md)
    print(f"greedy through the router == direct: {r['greedy']['identical']}; retained sessions per replica "
          f"{r['greedy']['retained_sessions_per_replica']}; total {r['total_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
