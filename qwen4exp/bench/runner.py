"""The concurrency sweep: plan conversations, run them, collect per-turn records."""

from __future__ import annotations

import asyncio
import csv
import json
import random
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from . import metrics as M
from .client import TurnResult, scrape_metrics, server_alive, stream_chat
from .think import ThinkTime
from .tokenizer import HFTokenizer, ServerTokenizer, Tokenizer, TokenizerError
from .workload import (
    PROXY_USER,
    ConversationPlan,
    TemplateOverhead,
    WorkloadSpec,
    fit_chat,
    plan_conversation,
    template_overhead,
)


SESSION_HEADER = "X-Session-ID"  # vLLM's header for Request.session_id


class SetupError(RuntimeError):
    """The run could not start (server unreachable, no tokenizer, bad sizes)."""


def context_error(spec: WorkloadSpec, max_len: int | None, reply_close: int = 0,
                  source: str = "the server's max_model_len") -> str | None:
    """None if the longest conversation of ``spec`` fits a ``max_len`` context, else one line saying what it needs
    and which flag to lower to what. ``reply_close``: template tokens closing each earlier reply (0 when not
    known yet, which gives a lower bound of the need)."""
    if not max_len:
        return None
    max_len = int(max_len)
    first, out, turns = spec.first_turn_tokens, spec.max_output_tokens, spec.max_turns
    per_turn = spec.turn_tokens + out + reply_close  # what each later turn adds
    need = first + out + (turns - 1) * per_turn
    if need <= max_len:
        return None
    shape = f"--first-turn-tokens {first} + --max-output-tokens {out}"
    if turns > 1:
        shape += (f" + {turns - 1} later turn(s) x (--turn-tokens {spec.turn_tokens} + --max-output-tokens {out}"
                  + (f" + {reply_close} template" if reply_close else "") + ")")
    first_max = max_len - out - (turns - 1) * per_turn  # the largest first turn that fits with these turns
    turns_max = 1 + (max_len - first - out) // per_turn if first + out <= max_len else 0
    if first_max >= 32:  # (a first turn also holds the chat template's tokens)
        fix = f"lower --first-turn-tokens to at most {first_max}"
        if turns_max >= 1:
            fix += f" (or --turns to at most {turns_max})"
    elif turns_max >= 1:
        fix = f"lower --turns to at most {turns_max} (or --first-turn-tokens, --turn-tokens, --max-output-tokens)"
    elif out < max_len:
        fix = f"lower --first-turn-tokens to at most {max_len - out} with --turns 1, and less with more turns"
    else:
        fix = f"lower --max-output-tokens below {max_len} and --first-turn-tokens"
    return (f"the longest conversation needs {need} tokens of context ({shape}) but {source} is {max_len}"
            f": {fix}, or serve a longer context")


@dataclass
class BenchConfig:
    base_url: str
    model: str | None
    label: str | None
    spec: WorkloadSpec
    concurrency: list[int]
    conversations: list[int] | None  # per level; None = max(4, 2 * concurrency)
    duration_s: float | None
    num_gpus: float | None  # None: not given (the per-GPU columns are per server)
    request_timeout_s: float
    out_dir: Path
    warmup: int = 2
    runtime_fit: bool = True
    metrics_url: str | None = None  # None: derive from base_url; "" disables
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] | None = None
    tokenizer_dir: str | None = None
    trust_remote_code: bool = False
    progress: bool = True
    hardware: str = ""  # what serves the model, for the plot's subtitle
    log: TextIO | None = None  # default: sys.stderr at the time of writing
    # Sessions: X-Session-ID on every turn (one id per conversation), vllm_xargs.session_close on the last.
    session_id: bool = True
    session_close: bool = True
    session_prefix: str = ""  # unique per run (the run nonce, or a random one): ids never repeat across runs
    think_time: ThinkTime = field(default_factory=ThinkTime)  # pause before every turn >= 2

    def conversations_for(self, i: int, c: int) -> int:
        if self.conversations is None:
            return max(4, 2 * c)
        if len(self.conversations) == 1:
            return self.conversations[0]
        return self.conversations[i]


def root_url(base_url: str) -> str:
    """Server root: the base URL without a trailing ``/v1``."""
    u = base_url.rstrip("/")
    return u[: -len("/v1")] if u.endswith("/v1") else u


class _Progress:
    """tqdm when installed, else a plain stderr counter."""

    def __init__(self, total: int, desc: str, enabled: bool, stream: TextIO) -> None:
        self.bar = None
        self.enabled = enabled
        self.total, self.n, self.desc, self.stream = total, 0, desc, stream
        self._last = 0.0
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="turn", file=stream, mininterval=0.5, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def update(self, failed: bool = False) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            return
        now = time.monotonic()
        if now - self._last > 1.0 or self.n == self.total:
            self._last = now
            width = 30
            done = int(width * self.n / max(1, self.total))
            self.stream.write(f"\r{self.desc} [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} turns")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class LevelResult:
    phase: str
    concurrency: int
    conversations: int
    records: list[dict[str, Any]]
    not_sent: int
    duration_s: float
    server_before: dict[str, float] | None = None
    server_after: dict[str, float] | None = None


class Runner:
    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.root = root_url(cfg.base_url)
        self.chat_url = cfg.base_url.rstrip("/") + "/chat/completions"
        if cfg.metrics_url is None:
            self.metrics_url: str | None = self.root + "/metrics"
        else:
            self.metrics_url = cfg.metrics_url or None
        self.model: str = cfg.model or ""
        self.label: str = cfg.label or ""
        self.tok: Tokenizer | None = None
        self.overhead = TemplateOverhead(0, 0, 0)
        self.abort = asyncio.Event()
        self.abort_reason: str | None = None
        self.first_error: str | None = None
        self.levels: list[LevelResult] = []
        self.rows: list[dict[str, Any]] = []
        self.server_info: dict[str, Any] = {}
        self._jsonl: TextIO | None = None
        self._alive_lock = asyncio.Lock()

    # ------------------------------------------------------------------ logging

    @property
    def log_stream(self) -> TextIO:
        return self.cfg.log or sys.stderr

    def log(self, msg: str) -> None:
        self.log_stream.write(msg + "\n")
        self.log_stream.flush()

    # ------------------------------------------------------------------ setup

    async def setup(self, session: aiohttp.ClientSession) -> None:
        cfg = self.cfg
        spec = cfg.spec
        try:
            async with session.get(
                cfg.base_url.rstrip("/") + "/models",
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=30),
            ) as r:
                if r.status != 200:
                    raise SetupError(f"GET {cfg.base_url}/models returned HTTP {r.status}: {(await r.text())[:200]}")
                models = (await r.json(content_type=None)).get("data", [])
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise SetupError(f"cannot reach the server at {cfg.base_url}: {type(e).__name__}: {e}") from e
        ids = [m.get("id") for m in models]
        if not self.model:
            if not ids:
                raise SetupError(f"{cfg.base_url}/models lists no model; pass --model")
            self.model = ids[0]
        elif ids and self.model not in ids:
            raise SetupError(f"model {self.model!r} is not served at {cfg.base_url} (served: {', '.join(ids)})")
        if not self.label:
            self.label = self.model
        card = next((m for m in models if m.get("id") == self.model), {})
        max_len = card.get("max_model_len")
        # Fail before loading a tokenizer where even the lower bound of the need (no template tokens) is too long.
        if (msg := context_error(spec, max_len)) is not None:
            raise SetupError(msg)

        if cfg.tokenizer_dir:
            self.tok = HFTokenizer(
                cfg.tokenizer_dir,
                chat_template_kwargs=cfg.chat_template_kwargs,
                trust_remote_code=cfg.trust_remote_code,
            )
        else:
            self.tok = ServerTokenizer(
                session,
                self.root,
                self.model,
                headers=self.headers,
                chat_template_kwargs=cfg.chat_template_kwargs,
            )
        try:
            self.overhead = await template_overhead(self.tok)
        except TokenizerError as e:
            raise SetupError(
                f"cannot count tokens with the {self.tok.name}: {e}. "
                "Pass --tokenizer DIR (the served model's directory) to count locally."
            ) from e
        max_len = max_len or self.tok.max_model_len
        self.server_info = {
            "model": self.model,
            "max_model_len": max_len,
            "tokenizer": self.tok.name,
            "template_tokens_first_turn": self.overhead.first,
            "template_tokens_user_block": self.overhead.user_block,
            "template_tokens_reply_close": self.overhead.reply_close,
            "new_turn_sizing": "user-message proxy" if self.overhead.proxy_base is not None else "history count",
            "metrics_url": self.metrics_url,
        }
        if spec.first_turn_tokens <= self.overhead.first:
            raise SetupError(
                f"--first-turn-tokens {spec.first_turn_tokens} is not more than the chat template's "
                f"own {self.overhead.first} tokens"
            )
        if spec.turn_tokens <= self.overhead.user_block:
            raise SetupError(
                f"--turn-tokens {spec.turn_tokens} is not more than the {self.overhead.user_block} template "
                "tokens a later turn adds"
            )
        if (msg := context_error(spec, max_len, self.overhead.reply_close)) is not None:
            raise SetupError(msg)

    # ------------------------------------------------------------------ planning

    async def plan(self, keys: list[str]) -> list[ConversationPlan]:
        assert self.tok is not None
        plans = []
        for key in keys:
            plans.append(await plan_conversation(self.tok, self.cfg.spec, key, self.overhead))
        return plans

    # ------------------------------------------------------------------ records

    def _write_record(self, rec: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()

    def _record(
        self,
        *,
        phase: str,
        concurrency: int,
        plan: ConversationPlan,
        turn: int,
        res: TurnResult | None,
        error: str | None,
        planned_prompt: int | None,
        counted_prompt: int | None,
        history_tokens: int | None,
        level_start: float,
        prep_start: float,
        end: float,
        session_id: str | None = None,
        session_close: bool = False,
        think_s: float | None = None,
        prev_usage: tuple[int | None, int | None] = (None, None),
    ) -> dict[str, Any]:
        spec = self.cfg.spec
        status = M.FAILED
        if res is not None and res.ok:
            status = M.OK if (res.completion_tokens or 0) >= spec.max_output_tokens else M.TRUNCATED
        ttft_ms = res.ttft_s * 1000 if res is not None and res.ttft_s is not None else None
        lat_ms = res.latency_s * 1000 if res is not None and res.latency_s is not None else None
        rec: dict[str, Any] = {
            "phase": phase,
            "label": self.label,
            "concurrency": concurrency,
            "conversation": plan.conv_id,
            "turn": turn,
            "num_turns": plan.num_turns,
            "status": status,
            "error": error if status == M.FAILED else None,
            "start_s": round((res.start if res is not None and res.start else end) - level_start, 6),
            "prep_ms": round(((res.start if res is not None and res.start else end) - prep_start) * 1000, 3),
            "end_s": round(end - level_start, 6),
            "ttft_ms": ttft_ms,
            "latency_ms": lat_ms,
            "tpot_ms": (
                M.tpot_ms(lat_ms, ttft_ms, res.completion_tokens if res else None) if status != M.FAILED else None
            ),
            "prompt_tokens": res.prompt_tokens if res is not None else None,
            "planned_prompt_tokens": planned_prompt,
            "client_prompt_tokens": counted_prompt,
            "history_tokens": history_tokens,
            "new_tokens": spec.first_turn_tokens if turn == 1 else spec.turn_tokens,
            "completion_tokens": res.completion_tokens if res is not None else None,
            "max_tokens": spec.max_output_tokens,
            "cached_tokens": res.cached_tokens if res is not None else None,
            "cached_fraction": (
                M.cached_fraction(res.cached_tokens, *prev_usage) if res is not None and turn >= 2 else None
            ),
            "session_id": session_id,
            "session_close": session_close,
            "think_s": think_s,
            "finish_reason": res.finish_reason if res is not None else None,
            "chunks": res.chunks if res is not None else 0,
            "itl_ms": [round(x * 1000, 4) for x in res.itl_s] if res is not None and status != M.FAILED else [],
        }
        return rec

    def session_id(self, plan: ConversationPlan) -> str:
        """The conversation's X-Session-ID: stable over its turns, unique per conversation and per run."""
        return f"{self.cfg.session_prefix}-{plan.conv_id}" if self.cfg.session_prefix else plan.conv_id

    # ------------------------------------------------------------------ abort handling

    async def _check_server(self, error: str, concurrency: int | str) -> None:
        """After a connection-level failure: stop the whole run if the server is gone."""
        async with self._alive_lock:
            if self.abort.is_set():
                return
            if not await server_alive(self._session, self.cfg.base_url, self.headers):
                self.abort_reason = (
                    f"the server at {self.cfg.base_url} stopped answering during concurrency {concurrency} "
                    f"({error})"
                )
                self.abort.set()

    # ------------------------------------------------------------------ one conversation

    async def _fit_turn(
        self, messages: list[dict[str, Any]], plan: ConversationPlan, k: int
    ) -> tuple[int, int, str, int]:
        """Tool output of turn ``k + 1``: ``(history, planned prompt, text, counted prompt)``."""
        assert self.tok is not None
        spec, ov = self.cfg.spec, self.overhead
        ids, n0, guess = plan.tool_ids[k - 1], plan.tool_n[k - 1], plan.tool_texts[k - 1]
        if ov.proxy_base is not None:
            # Size the user message on a short proxy conversation (cheap, and no assistant
            # message in it), then count the real prompt once.
            text, added, _ = await fit_chat(
                self.tok, [PROXY_USER], ids, ov.proxy_base + spec.turn_tokens, n0, guess_text=guess
            )
            counted = await self.tok.count_chat(messages + [{"role": "user", "content": text}])
            history = counted - (added - ov.proxy_base)
            return history, history + spec.turn_tokens, text, counted
        history = await self.tok.count_chat(messages, add_generation_prompt=False)
        planned = history + spec.turn_tokens
        text, counted, _ = await fit_chat(self.tok, messages, ids, planned, n0, guess_text=guess)
        return history, planned, text, counted

    async def _conversation(
        self,
        plan: ConversationPlan,
        *,
        phase: str,
        concurrency: int,
        level_start: float,
        deadline: float | None,
        out: list[dict[str, Any]],
        counters: dict[str, int],
        pbar: _Progress,
    ) -> None:
        cfg, spec = self.cfg, self.cfg.spec
        assert self.tok is not None
        messages: list[dict[str, Any]] = []
        prev_prompt = prev_completion = 0
        prev_usage: tuple[int | None, int | None] = (None, None)
        session_id = self.session_id(plan) if cfg.session_id else None
        # Seeded per conversation (not per worker): the same pauses whatever the interleaving.
        think_rng = random.Random(f"{spec.seed}:think:{plan.conv_id}")
        think_s: float | None = None
        for k in range(plan.num_turns):
            if k > 0 and not cfg.think_time.zero:
                # Simulated tool execution: after the reply, before the next turn is prepared and sent.
                think_s = cfg.think_time.sample(think_rng)
                if deadline is not None:
                    think_s = max(0.0, min(think_s, deadline - time.perf_counter()))
                try:
                    await asyncio.wait_for(self.abort.wait(), timeout=think_s)
                except asyncio.TimeoutError:
                    pass
            if self.abort.is_set() or (deadline is not None and time.perf_counter() >= deadline):
                counters["not_sent"] += plan.num_turns - k
                return
            error = None
            prep_start = time.perf_counter()
            counted: int | None
            history: int | None = None
            if k == 0:
                turn_msgs = [{"role": "user", "content": plan.first_text}]
                planned = spec.first_turn_tokens
                counted = plan.first_tokens
            else:
                if cfg.runtime_fit:
                    # Exact: a tool output that adds exactly turn_tokens after the conversation
                    # so far, and the whole prompt counted as the server will count it.
                    try:
                        history, planned, text, counted = await self._fit_turn(messages, plan, k)
                    except TokenizerError as e:
                        error = f"counting the prompt failed: {e}"
                        planned, text, counted = None, "", None
                else:
                    # Planned only: assumes the reply re-tokenizes to the tokens generated.
                    history = prev_prompt + prev_completion + self.overhead.reply_close
                    planned = history + spec.turn_tokens
                    text, counted = plan.tool_texts[k - 1], None
                turn_msgs = messages + [{"role": "user", "content": text}]

            res: TurnResult | None = None
            if error is None:
                payload: dict[str, Any] = {
                    "model": self.model,
                    "messages": turn_msgs,
                    "max_tokens": spec.max_output_tokens,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                if cfg.chat_template_kwargs:
                    payload["chat_template_kwargs"] = cfg.chat_template_kwargs
                payload.update(cfg.extra_body)
                closing = cfg.session_close and k == plan.num_turns - 1
                if closing:
                    # The conversation's last turn: tell the server the session ended.
                    payload["vllm_xargs"] = {**(payload.get("vllm_xargs") or {}), "session_close": True}
                headers = dict(self.headers, **{SESSION_HEADER: session_id}) if session_id else self.headers
                req = asyncio.ensure_future(
                    stream_chat(
                        self._session, self.chat_url, payload, headers=headers, timeout_s=cfg.request_timeout_s
                    )
                )
                stop = asyncio.ensure_future(self.abort.wait())
                await asyncio.wait({req, stop}, return_when=asyncio.FIRST_COMPLETED)
                if req.done():
                    stop.cancel()
                    res = req.result()
                    if not res.ok:
                        error = res.error or "unknown error"
                else:
                    req.cancel()
                    try:
                        await req
                    except asyncio.CancelledError:
                        pass
                    error = f"cancelled, run aborted: {self.abort_reason}"
                    res = None
            end = time.perf_counter()
            rec = self._record(
                phase=phase,
                concurrency=concurrency,
                plan=plan,
                turn=k + 1,
                res=res,
                error=error,
                planned_prompt=planned,
                counted_prompt=counted,
                history_tokens=history,
                level_start=level_start,
                prep_start=prep_start,
                end=end,
                session_id=session_id,
                session_close=error is None and cfg.session_close and k == plan.num_turns - 1,
                think_s=round(think_s, 6) if think_s is not None else None,
                prev_usage=prev_usage,
            )
            out.append(rec)
            self._write_record(rec)
            pbar.update(rec["status"] == M.FAILED)
            if rec["status"] == M.FAILED:
                if self.first_error is None:
                    self.first_error = f"concurrency {concurrency}, {plan.conv_id} turn {k + 1}: {error}"
                if res is None or res.connection_error or res.timed_out or "counting the prompt" in (error or ""):
                    await self._check_server(error or "", concurrency)
                counters["not_sent"] += plan.num_turns - k - 1
                return
            assert res is not None
            reply = res.text if res.text else res.reasoning
            messages = turn_msgs + [{"role": "assistant", "content": reply}]
            prev_prompt = int(res.prompt_tokens or 0)
            prev_completion = int(res.completion_tokens or 0)
            prev_usage = (res.prompt_tokens, res.completion_tokens)

    # ------------------------------------------------------------------ one level

    async def run_level(self, phase: str, concurrency: int, plans: list[ConversationPlan]) -> LevelResult:
        cfg = self.cfg
        records: list[dict[str, Any]] = []
        counters = {"not_sent": 0}
        queue = deque(plans)
        desc = f"{self.label} c={concurrency}" if phase == "bench" else f"{self.label} warmup"
        pbar = _Progress(sum(p.num_turns for p in plans), desc, cfg.progress, self.log_stream)
        before = await scrape_metrics(self._session, self.metrics_url, self.headers) if phase == "bench" else None
        level_start = time.perf_counter()
        deadline = level_start + cfg.duration_s if (cfg.duration_s and phase == "bench") else None

        async def worker() -> None:
            while queue:
                plan = queue.popleft()
                if self.abort.is_set() or (deadline is not None and time.perf_counter() >= deadline):
                    counters["not_sent"] += plan.num_turns
                    continue
                await self._conversation(
                    plan,
                    phase=phase,
                    concurrency=concurrency,
                    level_start=level_start,
                    deadline=deadline,
                    out=records,
                    counters=counters,
                    pbar=pbar,
                )

        try:
            await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(plans))))))
        finally:
            pbar.close()
        after = None
        if phase == "bench" and not self.abort.is_set():
            after = await scrape_metrics(self._session, self.metrics_url, self.headers)
        if records:
            t0 = min(r["start_s"] for r in records)
            t1 = max(r["end_s"] for r in records)
            duration = max(0.0, t1 - t0)
        else:
            duration = 0.0
        return LevelResult(phase, concurrency, len(plans), records, counters["not_sent"], duration, before, after)

    # ------------------------------------------------------------------ outputs

    def write_summary_csv(self) -> Path:
        path = self.cfg.out_dir / "summary.csv"
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(M.SUMMARY_COLUMNS)
            for row in self.rows:
                w.writerow([M.format_cell(row.get(c)) for c in M.SUMMARY_COLUMNS])
        return path

    def write_summary_json(self, extra: dict[str, Any]) -> Path:
        path = self.cfg.out_dir / "summary.json"
        spec = asdict(self.cfg.spec)
        doc = {
            "label": self.label,
            "base_url": self.cfg.base_url,
            "server": self.server_info,
            "workload": spec,
            "concurrency": self.cfg.concurrency,
            "num_gpus": self.cfg.num_gpus,
            "hardware": self.cfg.hardware,
            "duration_limit_s": self.cfg.duration_s,
            "request_timeout_s": self.cfg.request_timeout_s,
            "warmup_conversations": self.cfg.warmup,
            "runtime_fit": self.cfg.runtime_fit,
            "session_id": self.cfg.session_id,
            "session_close": self.cfg.session_close,
            "session_prefix": self.cfg.session_prefix,
            "think_time": self.cfg.think_time.describe(),
            "run_nonce": self.cfg.spec.nonce,
            "levels": [
                {
                    **row,
                    "server_metrics": M.server_metrics(lv.server_before, lv.server_after),
                }
                for row, lv in zip(self.rows, [lv for lv in self.levels if lv.phase == "bench"], strict=False)
            ],
            **extra,
        }
        path.write_text(json.dumps(doc, indent=2) + "\n")
        return path

    # ------------------------------------------------------------------ main

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        async with aiohttp.ClientSession(connector=connector) as session:
            self._session = session
            await self.setup(session)
            spec = cfg.spec
            turns = str(spec.min_turns) if spec.min_turns == spec.max_turns else f"{spec.min_turns}-{spec.max_turns}"
            self.log(
                f"qwen4exp-bench: label={self.label!r} model={self.model!r} "
                f"tokenizer={self.tok.name if self.tok else '?'}; turn 1 = {spec.first_turn_tokens} tokens, "
                f"+{spec.turn_tokens} per turn, {turns} turns, {spec.max_output_tokens} output tokens"
            )
            with (cfg.out_dir / "turns.jsonl").open("w") as jf:
                self._jsonl = jf
                try:
                    await self._run_all()
                finally:
                    self._jsonl = None
        return {"rows": self.rows, "aborted": self.abort.is_set(), "abort_reason": self.abort_reason}

    async def _run_all(self) -> None:
        cfg = self.cfg
        if cfg.warmup > 0:
            self.log(f"planning {cfg.warmup} warm-up conversation(s)...")
            try:
                plans = await self.plan([f"warmup:{i}" for i in range(cfg.warmup)])
            except TokenizerError as e:
                self._abort_planning(e, "warm-up")
                return
            lv = await self.run_level("warmup", cfg.warmup, plans)
            self.levels.append(lv)
            failed = sum(1 for r in lv.records if r["status"] == M.FAILED)
            if failed:
                self.log(f"warning: {failed} warm-up turn(s) failed ({self.first_error})")
            if self.abort.is_set():
                return
        for i, c in enumerate(cfg.concurrency):
            n = cfg.conversations_for(i, c)
            self.log(f"planning {n} conversation(s) for concurrency {c}...")
            try:
                plans = await self.plan([f"c{c}:{j}" for j in range(n)])
            except TokenizerError as e:
                self._abort_planning(e, f"concurrency {c}")
                return
            lv = await self.run_level("bench", c, plans)
            self.levels.append(lv)
            row = M.summarize_level(
                lv.records,
                label=self.label,
                concurrency=c,
                num_gpus=cfg.num_gpus,
                conversations=lv.conversations,
                turns_not_sent=lv.not_sent,
                duration_s=lv.duration_s,
                server=M.server_metrics(lv.server_before, lv.server_after),
                hardware=cfg.hardware,
                workload=M.describe_workload(cfg.spec.first_turn_tokens, cfg.spec.turn_tokens, cfg.spec.min_turns,
                                             cfg.spec.max_turns, cfg.spec.max_output_tokens),
            )
            self.rows.append(row)
            self.write_summary_csv()
            if self.abort.is_set():
                return

    def _abort_planning(self, e: Exception, where: str) -> None:
        self.abort_reason = f"planning the {where} conversations failed: {e}"
        self.abort.set()
