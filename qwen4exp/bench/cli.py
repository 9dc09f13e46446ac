"""``qwen4exp-bench``: the agentic (SWE-Smith shaped) multi-turn benchmark."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from . import metrics as M
from .plot import plot_rows, plot_summary_csvs
from .runner import BenchConfig, Runner, SetupError
from .status import EXIT_OK, EXIT_SETUP, EXIT_TURNS_FAILED
from .status import run_nonce as _nonce
from .think import parse_think_time
from .workload import WorkloadSpec


DESCRIPTION = """\
Multi-turn agentic benchmark against an OpenAI-compatible server (vLLM).

Workload (seeded, synthetic, shaped like SWE-Smith agent traces): each
conversation has --turns turns; turn 1 is a --first-turn-tokens-token prompt
(chat template included, a code base being read); every later turn appends the
model's real reply and a tool output that adds exactly --turn-tokens tokens
after the conversation so far (user message with its template tokens and the
generation prompt), so each prompt reuses the previous one as its prefix.
Replies are --max-output-tokens tokens with ignore_eos.
Token counts are exact for the served model's tokenizer (the server's /tokenize
route, or --tokenizer DIR) and every turn's prompt size is checked against the
server's usage.

Sweep: for each --concurrency level, that many conversations run at once
(streaming chat completions) until --conversations have run or --duration
has passed. Each level uses fresh conversations, so no level reuses another
level's cache.

Metrics (as the field defines them): TTFT; TPOT = (latency - TTFT) /
(output tokens - 1) per turn; per-user rate = 1000 / mean TPOT in ms (every
completed turn weighted equally); P90 interactivity = 1000 / P90 TPOT;
output tok/s in all and per GPU (--num-gpus; per server without it), also per minute, over
the time requests were in flight (busy_s; client-side token counting between
turns excluded, wall time kept as duration_s); ITL
P50/P90/P99; prefix-cache hit rate and MTP acceptance length from the server's
Prometheus /metrics (blank when not exposed). Failed and truncated turns are
counted and reported.

Outputs in --out: summary.csv (one row per concurrency), summary.json,
turns.jsonl (one record per turn) and tradeoff.png (per-user tok/s against
per-GPU tok/s, one line per --label, workload and --hardware beneath the
title). Compare servers with
--plot-from a/summary.csv b/summary.csv.

Sessions: every turn sends X-Session-ID (one id per conversation, unique per
run) and the last turn of a conversation vllm_xargs {"session_close": true};
--think-time pauses between a reply and the next turn (simulated tool
execution, outside every request's timing). A/B: --ab NAME='SERVE ARGS' given
twice or more starts each server in turn (--serve-cmd, default qwen4exp-serve;
--ab-ports pins their ports), runs the same workload against it into
OUT/NAME/, stops it, and writes OUT/ab.csv and OUT/ab.png comparing turn-1
and later-turn TTFT, TPOT, cached fraction, preemptions and recomputed tokens.

Before any request, the workload's longest conversation is checked against
the server's max_model_len (GET /v1/models): a workload that cannot fit stops
with one line naming the flag to lower (on a CPU server serving tiny-coder,
max_model_len 2048, e.g. --first-turn-tokens 300 --turn-tokens 40 --turns 3
--max-output-tokens 16).

Exit status: 0 all turns completed, 1 some turns failed (results still
written), 2 the run could not start (server unreachable, bad flags, a
workload longer than the server's context).
"""

EPILOG = "summary.csv columns:\n" + "\n".join(f"  {c:24s} {M.COLUMN_DOC[c]}" for c in M.SUMMARY_COLUMNS)


def _int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in re.split(r"[,\s]+", s.strip()) if x]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def _turns(s: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*(?:[-:]\s*(\d+)\s*)?", s)
    if not m:
        raise argparse.ArgumentTypeError(f"expected N or MIN-MAX, got {s!r}")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {s!r}")
    return lo, hi


def _json_obj(s: str) -> dict[str, Any]:
    try:
        v = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return v


def _positive(kind):
    def conv(s: str):
        v = kind(s)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}")
        return v

    return conv


def _think_time(s: str):
    try:
        return parse_think_time(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _port_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in re.split(r"[,\s]+", s.strip()) if x]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated port numbers, got {s!r}") from e
    if not vals or any(not 0 <= v < 65536 for v in vals):
        raise argparse.ArgumentTypeError(f"expected port numbers 1-65535 (0: any free port), got {s!r}")
    return vals


def _ab_spec(s: str) -> tuple[str, str]:
    name, sep, rest = s.partition("=")
    name = name.strip()
    if not sep or not name or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise argparse.ArgumentTypeError(f"expected NAME='SERVER ARGS' with NAME of letters, digits, . _ -, got {s!r}")
    return name, rest.strip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qwen4exp-bench",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="OpenAI-compatible base URL, with /v1 (default: %(default)s)")
    g.add_argument("--model", default=None,
                   help="served model name (default: the first model GET {base-url}/models lists)")
    g.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="count tokens with the tokenizer in this model directory (transformers) instead of the "
                        "server's /tokenize route; keeps the counting load off the server")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="allow custom tokenizer code when loading --tokenizer")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for the server (default: $OPENAI_API_KEY if set)")
    g.add_argument("--metrics-url", default=None,
                   help="Prometheus endpoint (default: {base-url without /v1}/metrics; 'none' disables)")
    g.add_argument("--request-timeout", type=_positive(float), default=1800.0, metavar="S",
                   help="wall-clock limit of one turn's request, stream included; a turn past it fails "
                        "(default: %(default)s)")
    g.add_argument("--chat-template-kwargs", type=_json_obj, default=None, metavar="JSON",
                   help="chat_template_kwargs sent with every request and token count, "
                        "e.g. '{\"enable_thinking\": false}'")
    g.add_argument("--extra-body", type=_json_obj, default={}, metavar="JSON",
                   help="extra fields merged into every chat request body (e.g. '{\"temperature\": 0}')")
    g.add_argument("--no-session-id", dest="session_id", action="store_false",
                   help="do not send the X-Session-ID header (by default every turn sends one id per "
                        "conversation, stable over its turns and unique per run)")
    g.add_argument("--no-session-close", dest="session_close", action="store_false",
                   help="do not send vllm_xargs {\"session_close\": true} with a conversation's last turn")

    g = p.add_argument_group("workload")
    g.add_argument("--first-turn-tokens", type=_positive(int), default=50000, metavar="N",
                   help="prompt tokens of turn 1, chat template included (default: %(default)s)")
    g.add_argument("--turn-tokens", type=_positive(int), default=800, metavar="N",
                   help="new prompt tokens of every later turn (the tool output with its template tokens) "
                        "after the previous prompt and its reply (default: %(default)s)")
    g.add_argument("--turns", type=_turns, default=(10, 15), metavar="N|MIN-MAX",
                   help="turns per conversation, a number or a range drawn uniformly per conversation "
                        "(default: 10-15)")
    g.add_argument("--max-output-tokens", type=_positive(int), default=500, metavar="N",
                   help="output tokens per turn (max_tokens, with ignore_eos); fewer counts as truncated "
                        "(default: %(default)s)")
    g.add_argument("--seed", type=int, default=42,
                   help="workload seed; the same seed gives the same conversations on every server "
                        "(default: %(default)s)")
    g.add_argument("--run-nonce", default=None, metavar="TEXT",
                   help="text written at the start of every conversation so that a repeated run does not hit "
                        "the prefix cache an earlier run filled (default: random per run; 'none' for none)")
    g.add_argument("--think-time", type=_think_time, default=parse_think_time("0"), metavar="DIST",
                   help="pause between a turn's reply and the next turn's send (simulated tool execution, not "
                        "in any request's timing): 0 (default), seconds S, lognormal:MEDIAN,SIGMA[,MAX] (clipped "
                        "at MAX) or uniform:A,B; drawn per conversation from --seed")
    g.add_argument("--no-runtime-fit", dest="runtime_fit", action="store_false",
                   help="do not count the conversation before each later turn (saves one or two /tokenize "
                        "calls per turn); the tool output is then sized from the plan, which assumes the reply "
                        "re-tokenizes to the tokens generated; where it does not, the turn shows up in "
                        "prompt_tokens_mismatch")

    g = p.add_argument_group("sweep")
    g.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8, 16, 32], metavar="LIST",
                   help="simultaneous conversations per level, comma separated (default: 1,2,4,8,16,32)")
    g.add_argument("--conversations", type=_int_list, default=None, metavar="N|LIST",
                   help="conversations per level: one number for all, or one per --concurrency level "
                        "(default: max(4, 2 x concurrency))")
    g.add_argument("--duration", type=_positive(float), default=None, metavar="S",
                   help="time limit per level: no new turn starts after S seconds (default: none)")
    g.add_argument("--warmup", type=int, default=2, metavar="N",
                   help="warm-up conversations run at concurrency N before the sweep, not counted "
                        "(default: %(default)s)")
    g.add_argument("--num-gpus", type=_positive(float), default=None, metavar="N",
                   help="GPUs serving the model, for the per-GPU columns (default: not given; those columns and "
                        "the plot are then per server)")
    g.add_argument("--hardware", default=None, metavar="TEXT",
                   help="what serves the model, e.g. '1x H200' or '2-core CPU', for summary.csv and the plot's "
                        "subtitle (default: 'N GPU(s)' from --num-gpus, else not stated)")

    g = p.add_argument_group("A/B of server configurations")
    g.add_argument("--ab", action="append", type=_ab_spec, default=None, metavar="NAME='ARGS'",
                   help="give twice or more: for each in turn start '--serve-cmd ARGS --host 127.0.0.1 --port P' "
                        "(ARGS: the model directory and server flags; leading VAR=VALUE words set that server's "
                        "environment, as in a shell), wait for /v1/models, run the workload "
                        "into OUT/NAME/ (server log OUT/NAME/server.log), stop the server; then OUT/ab.csv and "
                        "OUT/ab.png (OUT: --out, default bench_out/ab; --plot-out names ab.png); --base-url is set per "
                        "configuration. P: a free port, or the one --ab-ports or a --port N in ARGS pins")
    g.add_argument("--ab-ports", type=_port_list, default=None, metavar="P1,P2,...",
                   help="pin each --ab server's port, one per --ab in order (0: any free port; a --port N in that "
                        "configuration's ARGS does the same); a pinned port that is taken on 127.0.0.1 stops the "
                        "comparison before any server starts (default: free ports)")
    g.add_argument("--serve-cmd", default=None, metavar="CMD",
                   help="server command of --ab (default: qwen4exp-serve next to this Python, else "
                        "'python -m qwen4exp.serve')")
    g.add_argument("--ab-start-timeout", type=_positive(float), default=900.0, metavar="S",
                   help="seconds an --ab server may take to answer /v1/models (default: %(default)s)")
    g.add_argument("--ab-stop-timeout", type=_positive(float), default=30.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping an --ab server (default: %(default)s)")

    g = p.add_argument_group("output")
    g.add_argument("--label", default=None,
                   help="name of this run in summary.csv and the plot legend (default: the model name)")
    g.add_argument("--out", metavar="DIR", default=None,
                   help="output directory (default: bench_out/<label>)")
    g.add_argument("--plot-from", nargs="+", metavar="CSV", default=None,
                   help="only plot: combine these summary.csv files into one chart (one line per label), "
                        "written to --plot-out or --out/tradeoff.png; no server needed")
    g.add_argument("--plot-out", metavar="PNG", default=None,
                   help="plot file (default: <out>/tradeoff.png)")
    g.add_argument("--title", default=None, help="plot title")
    g.add_argument("--no-plot", action="store_true", help="do not write tradeoff.png")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def _gpus_text(n: float | None) -> str:
    return "" if n is None else f"{n:g} GPU" + ("" if n == 1 else "s")


def _safe_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_") or "run"


def print_table(rows: list[dict[str, Any]], stream=None) -> None:
    stream = stream or sys.stdout
    cols = [
        ("label", "label"),
        ("concurrency", "conc"),
        ("tok_s_user", "tok/s/user"),
        ("tok_s_user_p90", "p90 int."),
        ("tok_s_gpu", "tok/s/GPU"),
        ("tok_min_gpu", "tok/min/GPU"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p90_ms", "TTFT p90 ms"),
        ("ttft_later_p50_ms", "TTFT t>=2 p50"),
        ("itl_p50_ms", "ITL p50 ms"),
        ("cache_hit_pct", "cache hit %"),
        ("acceptance_length", "accept len"),
        ("cached_fraction_mean", "cached frac"),
        ("turns_ok", "ok"),
        ("turns_truncated", "trunc"),
        ("turns_failed", "failed"),
        ("turns_not_sent", "not sent"),
    ]
    M.write_text_table(stream, cols, rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ab:
        from .ab import run_ab

        return run_ab(args, run_one)
    return run_one(args)[0]


def run_one(args: argparse.Namespace, log=None) -> tuple[int, list[dict[str, Any]]]:
    """One benchmark run against ``args.base_url``: ``(exit status, summary rows)``."""

    if args.plot_from:
        out_png = Path(args.plot_out) if args.plot_out else Path(args.out or "bench_out") / "tradeoff.png"
        out_png.parent.mkdir(parents=True, exist_ok=True)
        try:
            plot_summary_csvs(args.plot_from, out_png, args.title)
        except (OSError, KeyError, ValueError) as e:
            print(f"qwen4exp-bench: cannot plot: {e}", file=sys.stderr)
            return EXIT_SETUP, []
        print(f"wrote {out_png}")
        return EXIT_OK, []

    if args.warmup < 0:
        print("qwen4exp-bench: --warmup must be >= 0", file=sys.stderr)
        return EXIT_SETUP, []
    if args.conversations is not None and len(args.conversations) not in (1, len(args.concurrency)):
        print("qwen4exp-bench: --conversations takes one number or one per --concurrency level", file=sys.stderr)
        return EXIT_SETUP, []

    lo, hi = args.turns
    spec = WorkloadSpec(
        first_turn_tokens=args.first_turn_tokens,
        turn_tokens=args.turn_tokens,
        min_turns=lo,
        max_turns=hi,
        max_output_tokens=args.max_output_tokens,
        seed=args.seed,
        nonce=_nonce(args.run_nonce),
    )
    metrics_url = args.metrics_url
    if metrics_url is not None and metrics_url.lower() in ("none", "off", ""):
        metrics_url = ""
    label = args.label or args.model
    out_dir = Path(args.out) if args.out else None
    cfg = BenchConfig(
        base_url=args.base_url,
        model=args.model,
        label=label,
        spec=spec,
        concurrency=args.concurrency,
        conversations=args.conversations,
        duration_s=args.duration,
        num_gpus=args.num_gpus,
        hardware=args.hardware or _gpus_text(args.num_gpus),
        request_timeout_s=args.request_timeout,
        out_dir=out_dir or Path("bench_out"),
        warmup=args.warmup,
        runtime_fit=args.runtime_fit,
        metrics_url=metrics_url,
        api_key=args.api_key,
        extra_body=args.extra_body,
        chat_template_kwargs=args.chat_template_kwargs,
        tokenizer_dir=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
        progress=args.progress,
        log=log,
        session_id=args.session_id,
        session_close=args.session_close,
        session_prefix=spec.nonce or secrets.token_hex(4),
        think_time=args.think_time,
    )
    runner = Runner(cfg)
    if out_dir is None and label:
        cfg.out_dir = Path("bench_out") / _safe_name(label)

    t0 = time.time()
    interrupted = False
    try:
        if out_dir is None and not label:
            # The label (and so the default directory) is the served model name: resolve it first.
            asyncio.run(_resolve_label(runner))
            cfg.out_dir = Path("bench_out") / _safe_name(runner.label)
        outcome = asyncio.run(runner.run())
    except SetupError as e:
        print(f"qwen4exp-bench: {e}", file=sys.stderr)
        return EXIT_SETUP, []
    except KeyboardInterrupt:
        interrupted = True
        outcome = {"rows": runner.rows, "aborted": True, "abort_reason": "interrupted (Ctrl-C)"}
        runner.abort_reason = "interrupted (Ctrl-C)"

    rows = outcome["rows"]
    if rows:
        runner.write_summary_csv()
    all_bench = [r for lv in runner.levels if lv.phase == "bench" for r in lv.records]
    failed = sum(1 for r in all_bench if r["status"] == M.FAILED)
    truncated = sum(1 for r in all_bench if r["status"] == M.TRUNCATED)
    mismatched = sum(int(r.get("prompt_tokens_mismatch") or 0) for r in rows)
    not_sent = sum(int(r.get("turns_not_sent") or 0) for r in rows)
    levels_done = [r["concurrency"] for r in rows]
    levels_missing = [c for c in cfg.concurrency if c not in levels_done]

    plot_path = None
    if rows and not args.no_plot:
        plot_path = Path(args.plot_out) if args.plot_out else cfg.out_dir / "tradeoff.png"
        plot_rows(rows, plot_path, args.title)
    runner.write_summary_json(
        {
            "wall_time_s": round(time.time() - t0, 3),
            "aborted": bool(outcome["aborted"]),
            "abort_reason": outcome.get("abort_reason"),
            "first_error": runner.first_error,
            "levels_not_run": levels_missing,
        }
    )

    if rows:
        print_table(rows)
    print(f"results in {cfg.out_dir}/ (summary.csv, summary.json, turns.jsonl"
          + (", tradeoff.png)" if plot_path else ")"))
    if truncated:
        print(f"WARNING: {truncated} turn(s) returned fewer than {spec.max_output_tokens} tokens (truncated)",
              file=sys.stderr)
    if mismatched:
        print(f"WARNING: {mismatched} turn(s) had a server prompt size different from the plan "
              "(see planned_prompt_tokens vs prompt_tokens in turns.jsonl)", file=sys.stderr)
    if interrupted and getattr(args, "reraise_interrupt", False):
        raise KeyboardInterrupt  # --ab: results are written; stop the whole comparison (and its server)
    if outcome["aborted"]:
        print(f"ERROR: run stopped: {outcome.get('abort_reason')}", file=sys.stderr)
        print(f"ERROR: {failed} turn(s) failed, {not_sent} planned turn(s) not sent"
              + (f", concurrency levels not run: {','.join(map(str, levels_missing))}" if levels_missing else "")
              + f"; partial results in {cfg.out_dir}/", file=sys.stderr)
        return EXIT_TURNS_FAILED, rows
    if interrupted:
        return EXIT_TURNS_FAILED, rows
    if failed:
        print(f"ERROR: {failed} turn(s) failed; first: {runner.first_error}", file=sys.stderr)
        return EXIT_TURNS_FAILED, rows
    return EXIT_OK, rows


async def _resolve_label(runner: Runner) -> None:
    import aiohttp

    from .client import list_models

    async with aiohttp.ClientSession() as session:
        try:
            ids = await list_models(session, runner.cfg.base_url, runner.headers, timeout_s=30)
        except Exception as e:  # noqa: BLE001
            raise SetupError(f"cannot reach the server at {runner.cfg.base_url}: {type(e).__name__}: {e}") from e
    if not ids:
        raise SetupError(f"{runner.cfg.base_url}/models lists no model; pass --model")
    runner.model = runner.cfg.model = ids[0]
    runner.label = runner.cfg.label = ids[0]


if __name__ == "__main__":
    sys.exit(main())
