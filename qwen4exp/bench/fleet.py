"""Agent sessions against replicas behind a router: per-turn cache reuse and TTFT, per-replica load, client retries.

The workload is ``qwen4exp-bench``'s (seeded SWE-Smith-shaped conversations, :func:`plan_conversation`, streamed
turns through :func:`stream_chat`, the session id in ``X-Session-ID`` and ``vllm_xargs.session_close`` on the last
turn); what this adds for a fleet:

* every session runs at once (one task each) with a fixed tool pause between turns;
* a turn that fails for a reason a retry can cure (the connection refused or cut, a stream that ended before
  ``[DONE]``, an HTTP 5xx, a timeout) is sent again, up to ``retries`` times, one second apart: what a client of a
  fleet must do when a replica dies under a running stream, which no router can replay;
* per replica, the requests, prompt and generated tokens it served (deltas of vLLM's ``/metrics`` counters);
* a hook after each finished turn, and gates (every session's turn N waits for an event: the failover run holds
  the third turns until it kills a replica under them).

Used by ``benchmarks/router_cpu.py`` and ``tests/test_router.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import aiohttp

from .client import TurnResult, stream_chat
from .metrics import parse_prometheus
from .tokenizer import HFTokenizer
from .workload import WorkloadSpec, plan_conversation, template_overhead

SESSION_HEADER = "X-Session-ID"
RETRY_WAIT_S = 1.0


@dataclass
class Turn:
    session: str
    turn: int  # 1-based
    ok: bool
    attempts: int
    errors: list[str]
    start_s: float  # since the run started
    end_s: float
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_fraction: float | None = None  # turn >= 2: cached / (previous prompt + previous completion)
    text: str = ""


@dataclass
class RunResult:
    turns: list[Turn] = field(default_factory=list)
    per_replica: list[dict[str, float]] = field(default_factory=list)  # requests, prompt_tokens, generation_tokens
    wall_s: float = 0.0

    def later(self) -> list[Turn]:
        return [t for t in self.turns if t.turn >= 2 and t.ok]

    def summary(self) -> dict[str, Any]:
        later = self.later()
        fr = [t.cached_fraction for t in later if t.cached_fraction is not None]
        ttft = sorted(t.ttft_s * 1000 for t in later if t.ttft_s is not None)
        toks = [r["prompt_tokens"] + r["generation_tokens"] for r in self.per_replica]
        return {
            "turns": len(self.turns),
            "failed": sum(not t.ok for t in self.turns),
            "client_retries": sum(t.attempts - 1 for t in self.turns),
            "turn2_cached_fraction": round(sum(fr) / len(fr), 3) if fr else None,
            "turn2_cached_min": round(min(fr), 3) if fr else None,
            "turn2_ttft_p50_ms": round(_pct(ttft, 50), 1) if ttft else None,
            "turn2_ttft_p99_ms": round(_pct(ttft, 99), 1) if ttft else None,
            "requests_per_replica": "/".join(str(int(r["requests"])) for r in self.per_replica),
            "tokens_per_replica": "/".join(str(int(t)) for t in toks),
            "busiest_over_idlest": round(max(toks) / max(1.0, min(toks)), 2) if toks else None,
            "wall_s": round(self.wall_s, 1),
        }


def _pct(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile (as qwen4exp-bench's tables)."""
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    k = max(0, min(len(sorted_vals) - 1, int(round(q / 100 * (len(sorted_vals) - 1)))))
    return sorted_vals[k]


def replica_counters(url: str) -> dict[str, float]:
    """Requests finished and tokens served by one replica so far (its ``/metrics``); zeros when it is down."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as r:
            m = parse_prometheus(r.read().decode())
    except OSError:
        return {"requests": 0.0, "prompt_tokens": 0.0, "generation_tokens": 0.0, "retained_sessions": 0.0}
    return {"requests": m.get("vllm:request_success", 0.0), "prompt_tokens": m.get("vllm:prompt_tokens", 0.0),
            "generation_tokens": m.get("vllm:generation_tokens", 0.0),
            "retained_sessions": m.get("qwen4exp:retained_sessions", 0.0)}


def _retryable(res: TurnResult) -> bool:
    return bool(res.connection_error or res.timed_out or (res.http_status is not None and res.http_status >= 500))


class SessionRun:
    """Plan once (``plan()``), then ``run()`` every session at once against ``base_url`` (``.../v1``)."""

    def __init__(self, base_url: str, tokenizer_dir: str, *, sessions: int, turns: int = 4,
                 first_turn_tokens: int = 600, turn_tokens: int = 100, max_output_tokens: int = 16,
                 think_s: float = 1.0, prefix: str = "s", seed: int = 7, model: str = "tiny-coder",
                 request_timeout_s: float = 120.0, retries: int = 3, stagger_s: float = 0.2) -> None:
        self.base_url = base_url.rstrip("/")
        self.spec = WorkloadSpec(first_turn_tokens=first_turn_tokens, turn_tokens=turn_tokens, min_turns=turns,
                                 max_turns=turns, max_output_tokens=max_output_tokens, seed=seed, nonce=prefix)
        self.tok = HFTokenizer(tokenizer_dir)
        self.sessions, self.think_s, self.prefix, self.model = sessions, think_s, prefix, model
        self.request_timeout_s, self.retries, self.stagger_s = request_timeout_s, retries, stagger_s
        self.plans: list = []
        # turn number (1-based) -> event every session awaits before sending that turn (after its tool pause)
        self.gates: dict[int, asyncio.Event] = {}

    async def plan(self) -> None:
        ov = await template_overhead(self.tok)
        self.plans = [await plan_conversation(self.tok, self.spec, f"{self.prefix}-{i}", ov)
                      for i in range(self.sessions)]

    async def _turn(self, http: aiohttp.ClientSession, sid: str, payload: dict, t0: float,
                    k: int) -> tuple[Turn, TurnResult | None]:
        errors: list[str] = []
        start = time.perf_counter() - t0
        res = None
        for attempt in range(1, self.retries + 2):
            res = await stream_chat(http, self.base_url + "/chat/completions", payload,
                                    headers={SESSION_HEADER: sid}, timeout_s=self.request_timeout_s)
            if res.ok:
                break
            errors.append(res.error or "unknown error")
            if not _retryable(res) or attempt > self.retries:
                break
            await asyncio.sleep(RETRY_WAIT_S)
        t = Turn(session=sid, turn=k + 1, ok=bool(res and res.ok), attempts=len(errors) + (1 if res and res.ok else 0),
                 errors=errors, start_s=round(start, 3), end_s=round(time.perf_counter() - t0, 3))
        if res is not None and res.ok:
            t.ttft_s, t.prompt_tokens, t.completion_tokens = res.ttft_s, res.prompt_tokens, res.completion_tokens
            t.cached_tokens, t.text = res.cached_tokens, res.text
        return t, res

    async def _session(self, http, plan, t0: float, out: list[Turn], on_turn: Callable | None, delay: float) -> None:
        await asyncio.sleep(delay)
        sid = plan.conv_id  # "{prefix}-{i}": unique per run when the prefix is
        messages: list[dict[str, Any]] = []
        prev = None
        for k in range(plan.num_turns):
            if k:
                await asyncio.sleep(self.think_s)
            if k + 1 in self.gates:
                await self.gates[k + 1].wait()
            text = plan.first_text if k == 0 else plan.tool_texts[k - 1]
            msgs = messages + [{"role": "user", "content": text}]
            payload: dict[str, Any] = {"model": self.model, "messages": msgs, "max_tokens": self.spec.max_output_tokens,
                                       "ignore_eos": True, "temperature": 0, "stream": True,
                                       "stream_options": {"include_usage": True}}
            if k == plan.num_turns - 1:
                payload["vllm_xargs"] = {"session_close": True}
            t, res = await self._turn(http, sid, payload, t0, k)
            if t.ok and prev is not None and t.cached_tokens is not None:
                t.cached_fraction = round(t.cached_tokens / max(1, prev[0] + prev[1]), 4)
            out.append(t)
            if on_turn is not None:
                await on_turn(t, out)
            if not t.ok:
                return
            prev = (t.prompt_tokens or 0, t.completion_tokens or 0)
            messages = msgs + [{"role": "assistant", "content": t.text}]

    async def run(self, replica_urls: list[str], on_turn: Callable | None = None) -> RunResult:
        if not self.plans:
            await self.plan()
        before = [replica_counters(u) for u in replica_urls]
        out: list[Turn] = []
        t0 = time.perf_counter()
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(self._session(http, p, t0, out, on_turn, i * self.stagger_s)
                                   for i, p in enumerate(self.plans)))
        wall = time.perf_counter() - t0
        after = [replica_counters(u) for u in replica_urls]
        per = []
        for b, a in zip(before, after):
            # a replica restarted during the run counts from zero again
            per.append({k: (a[k] - b[k] if a["requests"] >= b["requests"] else a[k])
                        for k in a if k != "retained_sessions"})
        return RunResult(turns=sorted(out, key=lambda t: (t.session, t.turn)), per_replica=per, wall_s=wall)


def turns_rows(res: RunResult) -> list[dict[str, Any]]:
    return [{k: v for k, v in asdict(t).items() if k != "text"} for t in res.turns]


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    """A Markdown table of ``rows`` (dicts) over ``cols``."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None
