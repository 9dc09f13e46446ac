"""Metric definitions of the agentic benchmark.

The definitions follow the ones the field publishes numbers with (TokenSpeed's
``bench.py`` / ``collect_outputs.py``, EvalScope ``perf``, vLLM ``bench serve``):

* TTFT: time from sending the request to the first streamed chunk that carries
  a token.
* latency: time from sending the request to the last streamed token chunk (the
  trailing usage-only chunk does not count).
* TPOT of one turn: ``(latency - TTFT) / (output_tokens - 1)``, defined only for
  turns with more than one output token; ``output_tokens`` is the server's
  ``usage.completion_tokens``.
* per-user rate (``tok_s_user``): ``1000 / mean TPOT in ms``, the mean taken over
  every completed turn of the level, each turn weighted equally.
* P90 interactivity (``tok_s_user_p90``): ``1000 / P90 TPOT in ms``, the per-user
  rate that 90 % of the turns reach or beat.
* output throughput: all output tokens of the level's completed turns divided by
  the level's busy time; per GPU it is divided by ``--num-gpus``; per GPU per
  minute it is multiplied by 60. Busy time is the union of the intervals in
  which at least one request of the level was in flight: the level's wall time
  (first request sent -> last response finished, ``duration_s``) minus the
  moments when every conversation was between turns on the client side. Our
  client counts tokens between turns (to keep the sizes exact) where the field's
  clients send at once; busy time removes that client time, so the number is
  the wall-time throughput of a zero-overhead client. At concurrency 1 the two
  are equal up to the client's gaps; ``prep_ms_mean`` shows the gap per turn.
* ITL: gaps between consecutive token chunks of a turn, pooled over all
  completed turns of the level (with speculative decoding one chunk may carry
  several tokens, exactly as in ``vllm bench serve``).
* prefix-cache hit rate: ``100 * d(vllm:prefix_cache_hits) /
  d(vllm:prefix_cache_queries)`` over the level, from the server's Prometheus
  ``/metrics``; blank when the server does not expose the counters.
* acceptance length: ``1 + d(vllm:spec_decode_num_accepted_tokens) /
  d(vllm:spec_decode_num_drafts)`` over the level; blank without speculative
  decoding.

Percentiles use linear interpolation (numpy's default), so they agree with the
numbers ``vllm bench serve`` prints.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Turn status values.
OK = "ok"
TRUNCATED = "truncated"
FAILED = "failed"

# Columns of summary.csv, in order.
SUMMARY_COLUMNS: list[str] = [
    "label",
    "concurrency",
    "num_gpus",
    "conversations",
    "turns_sent",
    "turns_ok",
    "turns_truncated",
    "turns_failed",
    "turns_not_sent",
    "tok_s_user",
    "tok_s_user_p90",
    "tok_s_gpu",
    "tok_min_gpu",
    "output_tok_s",
    "total_tok_s",
    "tpot_mean_ms",
    "tpot_p90_ms",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "ttft_mean_ms",
    "itl_p50_ms",
    "itl_p90_ms",
    "itl_p99_ms",
    "cache_hit_pct",
    "cache_hit_usage_pct",
    "acceptance_length",
    "ttft_turn1_p50_ms",
    "ttft_turn1_p99_ms",
    "ttft_later_p50_ms",
    "ttft_later_p99_ms",
    "cached_fraction_mean",
    "preemptions",
    "recomputed_tokens",
    "queue_mean_ms",
    "prefill_mean_ms",
    "render_mean_ms",
    "frontend_mean_ms",
    "think_s_mean",
    "prompt_tokens_mean",
    "prompt_tokens_max",
    "output_tokens",
    "prompt_tokens_mismatch",
    "prep_ms_mean",
    "busy_s",
    "duration_s",
    "hardware",
    "workload",
]

# What each column means (used for --help and the README-style note).
COLUMN_DOC: dict[str, str] = {
    "label": "the run's --label (one line per label in the plot)",
    "concurrency": "simultaneous conversations",
    "num_gpus": "--num-gpus (blank when not given: the per-GPU columns are then per server)",
    "conversations": "conversations started at this level",
    "turns_sent": "turns whose request was sent (ok + truncated + failed)",
    "turns_ok": "turns that returned exactly --max-output-tokens tokens",
    "turns_truncated": "turns that returned fewer tokens than asked",
    "turns_failed": "turns that errored (HTTP error, refused, reset, timeout)",
    "turns_not_sent": "planned turns never sent (conversation stopped, time limit, abort)",
    "tok_s_user": "per-user rate: 1000 / mean TPOT (ms)",
    "tok_s_user_p90": "P90 interactivity: 1000 / P90 TPOT (ms)",
    "tok_s_gpu": "output tokens/s / num_gpus (over busy_s)",
    "tok_min_gpu": "output tokens/min / num_gpus (over busy_s)",
    "output_tok_s": "output tokens/s, all GPUs (over busy_s)",
    "total_tok_s": "(prompt + output) tokens/s, all GPUs (over busy_s)",
    "tpot_mean_ms": "mean TPOT, (latency - TTFT) / (output tokens - 1)",
    "tpot_p90_ms": "P90 TPOT",
    "ttft_p50_ms": "TTFT P50",
    "ttft_p90_ms": "TTFT P90",
    "ttft_p99_ms": "TTFT P99",
    "ttft_mean_ms": "TTFT mean",
    "itl_p50_ms": "inter-token latency P50",
    "itl_p90_ms": "inter-token latency P90",
    "itl_p99_ms": "inter-token latency P99",
    "cache_hit_pct": "prefix-cache hit rate from /metrics (blank if not exposed)",
    "cache_hit_usage_pct": "cached prompt tokens from usage.prompt_tokens_details (blank if not sent)",
    "acceptance_length": "MTP/spec-decode mean acceptance length, 1 + accepted/drafts (blank if none)",
    "ttft_turn1_p50_ms": "TTFT P50 of turn 1 (nothing of the conversation cached yet)",
    "ttft_turn1_p99_ms": "TTFT P99 of turn 1",
    "ttft_later_p50_ms": "TTFT P50 of turns >= 2 (the previous turn's prompt and reply could be cached)",
    "ttft_later_p99_ms": "TTFT P99 of turns >= 2",
    "cached_fraction_mean": "mean over turns >= 2 of cached_tokens / (prompt + completion tokens of the previous "
                            "turn), from usage.prompt_tokens_details (blank if not sent)",
    "preemptions": "d(vllm:num_preemptions) over the level from /metrics (blank if not exposed)",
    "recomputed_tokens": "d(vllm:request_prefill_kv_computed_tokens sum) over the level: prompt tokens the server "
                         "computed rather than found cached (blank if not exposed)",
    "queue_mean_ms": "d(vllm:request_queue_time_seconds) sum / count over the level: mean time a request waited in "
                     "the engine's queue before its first step (blank if not exposed)",
    "prefill_mean_ms": "the same of vllm:request_prefill_time_seconds: mean time from a request's first step to its "
                       "first token, the prefill of what it did not find cached and the steps it shared",
    "render_mean_ms": "the server's mean TTFT (vllm:time_to_first_token_seconds, counted from the arrival time vLLM "
                      "0.32 takes before it renders the chat) minus queue and prefill: chat template, tokenization, "
                      "input processing, the way to the engine core and the first token's way back",
    "frontend_mean_ms": "ttft_mean_ms minus the server's mean TTFT: HTTP and request parsing before vLLM's arrival "
                        "time, and the streamed response's way to the client",
    "think_s_mean": "mean --think-time pause before turns >= 2 (outside every request's timing)",
    "prompt_tokens_mean": "mean prompt tokens per completed turn (server's usage)",
    "prompt_tokens_max": "largest prompt of the level (server's usage)",
    "output_tokens": "output tokens of the completed turns",
    "prompt_tokens_mismatch": "completed turns whose server prompt size differs from the plan",
    "prep_ms_mean": "client time per turn between deciding to send and sending (token counting)",
    "busy_s": "time with at least one request in flight (the throughput denominator)",
    "duration_s": "level wall time, first request sent to last response finished",
    "hardware": "--hardware, or N GPU(s) from --num-gpus (the plot's subtitle)",
    "workload": "the workload in short: first turn, tokens per turn, turns, output tokens (the plot's subtitle)",
}


def percentile(values: Sequence[float], q: float) -> float | None:
    """Percentile with linear interpolation (numpy's default method)."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * (q / 100.0)
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(xs[lo])
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def mean(values: Sequence[float]) -> float | None:
    return float(sum(values) / len(values)) if values else None


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals."""
    total = 0.0
    cur_s = cur_e = None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def tpot_ms(latency_ms: float | None, ttft_ms: float | None, output_tokens: int | None) -> float | None:
    """TPOT of one turn, ``(latency - TTFT) / (output_tokens - 1)``; None for <= 1 token."""
    if latency_ms is None or ttft_ms is None or output_tokens is None or output_tokens <= 1:
        return None
    return (latency_ms - ttft_ms) / (output_tokens - 1)


# ---------------------------------------------------------------------------
# Prometheus


_SAMPLE_RE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")

PREFIX_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
PREFIX_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
SPEC_ACCEPTED = ("vllm:spec_decode_num_accepted_tokens",)
SPEC_DRAFTS = ("vllm:spec_decode_num_drafts",)
PREEMPTIONS = ("vllm:num_preemptions",)
# Histogram of the prompt tokens each request computed (not from the prefix cache): its _sum series.
KV_COMPUTED = ("vllm:request_prefill_kv_computed_tokens_sum",)
# AgentScheduler's counters as parse_prometheus names them (labels summed, "_total" dropped)
AGENT_COUNTERS = frozenset("qwen4exp:" + n for n in (
    "retention_hits", "retention_evictions", "illegal_transitions", "exact_resumes", "preempted_tokens",
    "capped_steps", "continued_steps", "paused_steps"))
# Request-time histograms (seconds): TTFT counted from the engine's arrival time, queue, first step to first token
SERVER_TTFT = "vllm:time_to_first_token_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
PREFILL_TIME = "vllm:request_prefill_time_seconds"


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample of a Prometheus text exposition by metric name.

    Label sets are summed (one vLLM server with data parallelism exposes one
    series per engine). A ``_total`` suffix is removed so ``foo_total`` and
    ``foo`` read the same; ``_created`` series are skipped.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            continue
        name = m.group(1)
        if name.endswith("_created"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        if name.endswith("_total"):
            name = name[: -len("_total")]
        out[name] = out.get(name, 0.0) + value
    return out


def _first(sample: Mapping[str, float], names: Iterable[str]) -> tuple[str, float] | None:
    for n in names:
        if n in sample:
            return n, sample[n]
    return None


def counter_delta(
    before: Mapping[str, float] | None, after: Mapping[str, float] | None, names: Iterable[str]
) -> float | None:
    """Increase of the first of ``names`` found in ``after``; None when absent."""
    if after is None:
        return None
    hit = _first(after, names)
    if hit is None:
        return None
    name, value = hit
    start = (before or {}).get(name, 0.0)
    return value - start


def histogram_mean_ms(before: Mapping[str, float] | None, after: Mapping[str, float] | None,
                      name: str) -> float | None:
    """Mean of a seconds histogram's observations over a level, in ms (None when absent or nothing observed)."""
    total = counter_delta(before, after, (name + "_sum",))
    count = counter_delta(before, after, (name + "_count",))
    return 1000.0 * total / count if total is not None and count else None


def server_metrics(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict[str, Any]:
    """Prefix-cache hit rate (%), spec-decode acceptance length, preemptions, recomputed prompt tokens and the mean
    server-side TTFT, queue and prefill times over a level (None where the server does not expose them)."""
    hits = counter_delta(before, after, PREFIX_HITS)
    queries = counter_delta(before, after, PREFIX_QUERIES)
    accepted = counter_delta(before, after, SPEC_ACCEPTED)
    drafts = counter_delta(before, after, SPEC_DRAFTS)
    res: dict[str, Any] = {
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "spec_accepted_tokens": accepted,
        "spec_drafts": drafts,
        "cache_hit_pct": None,
        "acceptance_length": None,
        "preemptions": counter_delta(before, after, PREEMPTIONS),
        "recomputed_tokens": counter_delta(before, after, KV_COMPUTED),
        "server_ttft_ms": histogram_mean_ms(before, after, SERVER_TTFT),
        "queue_ms": histogram_mean_ms(before, after, QUEUE_TIME),
        "prefill_ms": histogram_mean_ms(before, after, PREFILL_TIME),
        # AgentScheduler's counters (qwen4exp.serving.metrics) over the level: retention hits, evictions, exact
        # resumes, capped and continued steps ... (summary.json only)
        "qwen4exp_counters": {k: v - (before or {}).get(k, 0.0) for k, v in (after or {}).items()
                              if k in AGENT_COUNTERS},
    }
    if hits is not None and queries:
        res["cache_hit_pct"] = 100.0 * hits / queries
    if accepted is not None and drafts:
        res["acceptance_length"] = 1.0 + accepted / drafts
    return res


# ---------------------------------------------------------------------------
# Aggregation


def summarize_level(
    turns: Sequence[Mapping[str, Any]],
    *,
    label: str,
    concurrency: int,
    num_gpus: float | None,
    conversations: int,
    turns_not_sent: int,
    duration_s: float,
    server: Mapping[str, Any] | None = None,
    hardware: str = "",
    workload: str = "",
) -> dict[str, Any]:
    """One summary row from the per-turn records of one concurrency level.

    ``turns`` holds every turn that was sent, with ``status`` one of ok /
    truncated / failed. Completed turns (ok + truncated) feed the latency and
    throughput metrics; failed turns only feed the counts. ``num_gpus`` None
    (not given) makes the per-GPU columns per server.
    """
    done = [t for t in turns if t["status"] in (OK, TRUNCATED)]
    n_ok = sum(1 for t in turns if t["status"] == OK)
    n_trunc = sum(1 for t in turns if t["status"] == TRUNCATED)
    n_fail = sum(1 for t in turns if t["status"] == FAILED)

    tpots = [t["tpot_ms"] for t in done if t.get("tpot_ms") is not None]
    ttfts = [t["ttft_ms"] for t in done if t.get("ttft_ms") is not None]
    itls = [x for t in done for x in (t.get("itl_ms") or [])]
    out_tokens = sum(int(t.get("completion_tokens") or 0) for t in done)
    prompt_tokens = [int(t["prompt_tokens"]) for t in done if t.get("prompt_tokens") is not None]
    cached = [t.get("cached_tokens") for t in done]
    mismatch = sum(
        1
        for t in done
        if t.get("prompt_tokens") is not None
        and t.get("planned_prompt_tokens") is not None
        and int(t["prompt_tokens"]) != int(t["planned_prompt_tokens"])
    )

    first = [t["ttft_ms"] for t in done if t.get("ttft_ms") is not None and int(t.get("turn") or 1) == 1]
    later = [t["ttft_ms"] for t in done if t.get("ttft_ms") is not None and int(t.get("turn") or 1) >= 2]
    fracs = [float(t["cached_fraction"]) for t in done if t.get("cached_fraction") is not None]
    thinks = [float(t["think_s"]) for t in turns if int(t.get("turn") or 1) >= 2 and t.get("think_s") is not None]

    tpot_mean = mean(tpots)
    tpot_p90 = percentile(tpots, 90)
    spans = [(float(t["start_s"]), float(t["end_s"])) for t in turns if t.get("start_s") is not None]
    busy_s = busy_time(spans) if len(spans) == len(turns) and spans else duration_s
    out_tps = out_tokens / busy_s if busy_s > 0 else None
    total_tps = (out_tokens + sum(prompt_tokens)) / busy_s if busy_s > 0 else None
    preps = [float(t["prep_ms"]) for t in turns if t.get("prep_ms") is not None]
    gpus = 1.0 if num_gpus is None else num_gpus
    per_gpu = out_tps / gpus if out_tps is not None and gpus > 0 else None

    cache_usage = None
    if done and all(c is not None for c in cached) and sum(prompt_tokens) > 0:
        cache_usage = 100.0 * sum(int(c) for c in cached) / sum(prompt_tokens)

    server = server or {}
    row: dict[str, Any] = {
        "label": label,
        "concurrency": concurrency,
        "num_gpus": num_gpus,
        "conversations": conversations,
        "turns_sent": len(turns),
        "turns_ok": n_ok,
        "turns_truncated": n_trunc,
        "turns_failed": n_fail,
        "turns_not_sent": turns_not_sent,
        "tok_s_user": 1000.0 / tpot_mean if tpot_mean else None,
        "tok_s_user_p90": 1000.0 / tpot_p90 if tpot_p90 else None,
        "tok_s_gpu": per_gpu,
        "tok_min_gpu": per_gpu * 60.0 if per_gpu is not None else None,
        "output_tok_s": out_tps,
        "total_tok_s": total_tps,
        "tpot_mean_ms": tpot_mean,
        "tpot_p90_ms": tpot_p90,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p90_ms": percentile(ttfts, 90),
        "ttft_p99_ms": percentile(ttfts, 99),
        "ttft_mean_ms": mean(ttfts),
        "itl_p50_ms": percentile(itls, 50),
        "itl_p90_ms": percentile(itls, 90),
        "itl_p99_ms": percentile(itls, 99),
        "cache_hit_pct": server.get("cache_hit_pct"),
        "cache_hit_usage_pct": cache_usage,
        "acceptance_length": server.get("acceptance_length"),
        "ttft_turn1_p50_ms": percentile(first, 50),
        "ttft_turn1_p99_ms": percentile(first, 99),
        "ttft_later_p50_ms": percentile(later, 50),
        "ttft_later_p99_ms": percentile(later, 99),
        "cached_fraction_mean": mean(fracs),
        "preemptions": server.get("preemptions"),
        "recomputed_tokens": server.get("recomputed_tokens"),
        "queue_mean_ms": server.get("queue_ms"),
        "prefill_mean_ms": server.get("prefill_ms"),
        "render_mean_ms": (server["server_ttft_ms"] - server["queue_ms"] - server["prefill_ms"]
                           if None not in (server.get("server_ttft_ms"), server.get("queue_ms"), server.get("prefill_ms"))
                           else None),
        "frontend_mean_ms": (mean(ttfts) - server["server_ttft_ms"]
                             if ttfts and server.get("server_ttft_ms") is not None else None),
        "think_s_mean": mean(thinks),
        "prompt_tokens_mean": mean(prompt_tokens),
        "prompt_tokens_max": max(prompt_tokens) if prompt_tokens else None,
        "output_tokens": out_tokens,
        "prompt_tokens_mismatch": mismatch,
        "prep_ms_mean": mean(preps),
        "busy_s": busy_s,
        "duration_s": duration_s,
        "hardware": hardware,
        "workload": workload,
    }
    return row


def cached_fraction(cached_tokens: int | None, prev_prompt_tokens: int | None,
                    prev_completion_tokens: int | None) -> float | None:
    """Share of what the previous turn processed (its prompt + its reply) that this turn found cached:
    ``cached_tokens(k) / (prompt_tokens(k-1) + completion_tokens(k-1))``; None for turn 1 or without usage."""
    if cached_tokens is None or prev_prompt_tokens is None or prev_completion_tokens is None:
        return None
    denom = int(prev_prompt_tokens) + int(prev_completion_tokens)
    return int(cached_tokens) / denom if denom > 0 else None


def describe_workload(first_turn_tokens: int, turn_tokens: int, min_turns: int, max_turns: int,
                      max_output_tokens: int) -> str:
    """The workload in one short line (summary.csv's ``workload``, the plot's subtitle)."""
    turns = str(min_turns) if min_turns == max_turns else f"{min_turns}-{max_turns}"
    return (f"{first_turn_tokens}-token first turn, +{turn_tokens} a turn, {turns} turns, "
            f"{max_output_tokens} output tokens")


def format_cell(value: Any) -> str:
    """CSV cell: blank for None, integers as-is, floats with sensible precision."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        if abs(value) >= 100:
            return f"{value:.2f}"
        return f"{value:.4g}" if abs(value) < 0.01 else f"{value:.3f}"
    return str(value)


def write_text_table(stream, columns: list[tuple[str, str]], rows: list[dict[str, Any]]) -> None:
    """``rows`` as an aligned text table: ``columns`` are (key, header) pairs; the first column left-aligned, the
    others right-aligned, a dash rule under the headers, blank cells as ``-``."""
    cells = [[h for _, h in columns]] + [[format_cell(r.get(k)) or "-" for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for j, row in enumerate(cells):
        stream.write("  ".join(c.rjust(widths[i]) if i else c.ljust(widths[i]) for i, c in enumerate(row)) + "\n")
        if j == 0:
            stream.write("  ".join("-" * w for w in widths) + "\n")
    stream.flush()
