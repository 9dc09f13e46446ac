"""``--ab``: the same workload against two (or more) server configurations, one after the other.

For each ``NAME='ARGS'`` in turn: start ``SERVE_CMD ARGS --host 127.0.0.1 --port P`` (a free port, or the one
``--ab-ports P1,P2,...`` or a ``--port N`` in ARGS pins: checked free on 127.0.0.1 before any server starts, and
again just before its own; its own process group, output to ``OUT/NAME/server.log``; leading ``VAR=VALUE`` words of ARGS, as in a shell, set that
server's environment, e.g. ``--ab cap0='QWEN4EXP_CONTINUATION_CHUNK=0 MODEL ...'``), wait until ``/v1/models``
answers, run the benchmark with
``--base-url http://127.0.0.1:P/v1 --label NAME --out OUT/NAME`` (the same seed and run nonce for every
configuration, so the same conversations), stop the server (SIGTERM to its group, SIGKILL after
``--ab-stop-timeout``; also on errors and Ctrl-C). Then one table (printed, ``OUT/ab.csv``), ``OUT/ab.json``
(per configuration: command, port, pid, exit status, error) and ``OUT/ab.png``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from . import metrics as M
from .status import EXIT_OK, EXIT_SETUP, EXIT_TURNS_FAILED
from .status import run_nonce as _nonce

AB_COLUMNS = [
    "config",
    "concurrency",
    "turns_ok",
    "turns_failed",
    "ttft_turn1_p50_ms",
    "ttft_turn1_p99_ms",
    "ttft_later_p50_ms",
    "ttft_later_p99_ms",
    "tpot_mean_ms",
    "cached_fraction_mean",
    "preemptions",
    "recomputed_tokens",
    "queue_mean_ms",
    "prefill_mean_ms",
    "render_mean_ms",
    "frontend_mean_ms",
]
AB_HEADERS = {
    "config": "config",
    "concurrency": "conc",
    "turns_ok": "ok",
    "turns_failed": "failed",
    "ttft_turn1_p50_ms": "TTFT t1 p50",
    "ttft_turn1_p99_ms": "TTFT t1 p99",
    "ttft_later_p50_ms": "TTFT t>=2 p50",
    "ttft_later_p99_ms": "TTFT t>=2 p99",
    "tpot_mean_ms": "TPOT mean",
    "cached_fraction_mean": "cached frac",
    "preemptions": "preempt",
    "recomputed_tokens": "recomputed",
    "queue_mean_ms": "queue mean",
    "prefill_mean_ms": "prefill mean",
    "render_mean_ms": "render mean",
    "frontend_mean_ms": "frontend mean",
}


class StartError(RuntimeError):
    pass


def default_serve_cmd() -> list[str]:
    exe = shutil.which("qwen4exp-serve", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "qwen4exp.serve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(port: int, host: str = "127.0.0.1") -> str | None:
    """Why a server could not listen on ``host:port`` (e.g. ``[Errno 98] Address already in use``), None if it
    could. SO_REUSEADDR as uvicorn sets it: a port in TIME_WAIT counts as free, one something listens on as taken."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return str(e)
    return None


def pop_port(words: list[str]) -> tuple[int | None, list[str]]:
    """The ``--port N`` / ``--port=N`` of an --ab ARGS word list (the last one wins, as in vLLM's parser) and the
    words without it; ValueError if N is not a port number."""
    port, rest, i = None, [], 0
    while i < len(words):
        w = words[i]
        if w == "--port" or w.startswith("--port="):
            v = w.partition("=")[2] if "=" in w else (words[i + 1] if i + 1 < len(words) else "")
            i += 1 if "=" in w else 2
            port = _port_number(v, "--port")
            continue
        rest.append(w)
        i += 1
    return port, rest


def _port_number(v: str, what: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = -1
    if not 0 < n < 65536:
        raise ValueError(f"{what} needs a port number (1-65535), got {v!r}")
    return n


def _arg_value(words: list[str], name: str) -> str | None:
    """The value of the last ``name V`` / ``name=V`` in ``words``, None if absent."""
    out = None
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            out = words[i + 1]
        elif w.startswith(name + "="):
            out = w.partition("=")[2]
    return out


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """SIGTERM the server's process group, SIGKILL the group after ``timeout`` s; the exit status."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    # The leader may be gone with children left in its group (vLLM's engine core): kill what is left.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    return proc.returncode


def wait_models(proc: subprocess.Popen, port: int, timeout: float, log_path: Path) -> float:
    """Poll ``GET /v1/models`` until it answers 200; StartError if the server exits or takes too long."""
    t0 = time.monotonic()
    url = f"http://127.0.0.1:{port}/v1/models"
    while True:
        if proc.poll() is not None:
            raise StartError(f"the server exited with status {proc.returncode} during start-up "
                             f"(log: {log_path}):\n{_tail(log_path)}")
        if time.monotonic() - t0 > timeout:
            raise StartError(f"the server did not answer {url} within {timeout:g} s (log: {log_path}):\n"
                             f"{_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.2)


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def ab_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for res in results:
        for row in res.get("rows") or []:
            out.append({"config": res["name"], **{c: row.get(c) for c in AB_COLUMNS if c != "config"}})
    return out


def write_ab_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(AB_COLUMNS)
        for r in rows:
            w.writerow([M.format_cell(r.get(c)) for c in AB_COLUMNS])
    return path


def print_ab_table(rows: list[dict[str, Any]], stream=None) -> None:
    stream = stream or sys.stdout
    M.write_text_table(stream, [(c, AB_HEADERS[c]) for c in AB_COLUMNS], rows)


def plot_ab(rows: list[dict[str, Any]], path: Path, title: str | None = None) -> Path:
    """Two bar panels (built-in rasterizer): turn>=2 TTFT p50 (ms) and mean cached fraction, one bar per
    configuration and concurrency, one colour per configuration; texts in the PNG's metadata."""
    from .plot import PALETTE, Canvas, _fmt_tick, nice_ticks, write_png

    title = title or "A/B: turn>=2 TTFT p50 and cached fraction"
    configs = list(dict.fromkeys(str(r["config"]) for r in rows))
    width, height = 1000, 520
    cv = Canvas(width, height)
    black, grey = (0, 0, 0), (120, 120, 120)
    cv.text(20, 12, title, black)
    panels = [("ttft_later_p50_ms", "TTFT p50 of turns >= 2 (ms)"), ("cached_fraction_mean", "cached fraction")]
    pw = (width - 60) // 2
    for p, (key, label) in enumerate(panels):
        x0, x1 = 40 + p * (pw + 20) + 40, 40 + p * (pw + 20) + pw
        y0, y1 = 70, height - 90
        vals = [_num(r.get(key)) for r in rows]
        vmax, ticks = nice_ticks(max([v for v in vals if v is not None] or [1.0]))
        if key == "cached_fraction_mean":
            vmax, ticks = 1.0, [0.0, 0.25, 0.5, 0.75, 1.0]
        cv.text(x0, 44, label, black)
        for t in ticks:
            y = y1 - int((y1 - y0) * t / vmax)
            cv.dashed_hline(x0, x1, y, (210, 210, 210))
            s = _fmt_tick(t)
            cv.text(x0 - 6 - cv.text_width(s, 1), y - 3, s, grey, scale=1)
        cv.line(x0, y1, x1, y1, black)
        cv.line(x0, y0, x0, y1, black)
        n = max(1, len(rows))
        slot = (x1 - x0) // n
        for i, (r, v) in enumerate(zip(rows, vals)):
            color = PALETTE[configs.index(str(r["config"])) % len(PALETTE)]
            bx0 = x0 + i * slot + slot // 6
            bx1 = x0 + (i + 1) * slot - slot // 6
            if v is not None:
                cv.rect(bx0, y1 - int((y1 - y0) * min(v, vmax) / vmax), bx1, y1 - 1, color)
            cv.text(bx0, y1 + 6, f"c={r['concurrency']}", grey, scale=1)
    lx = 40
    for i, name in enumerate(configs):
        color = PALETTE[i % len(PALETTE)]
        cv.rect(lx, height - 40, lx + 14, height - 26, color)
        cv.text(lx + 20, height - 40, name, black)
        lx += 40 + cv.text_width(name)
    texts = {
        "Title": title,
        "Legend": "\n".join(configs),
        "Panels": "\n".join(label for _, label in panels),
        "Data": json.dumps([{k: rows[i].get(k) for k in ("config", "concurrency", "ttft_later_p50_ms",
                                                          "cached_fraction_mean")} for i in range(len(rows))]),
    }
    write_png(path, width, height, cv.px, texts)
    return path


def _num(v: Any) -> float | None:
    try:
        return None if v is None or v == "" else float(v)
    except (TypeError, ValueError):
        return None


_ENV_WORD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.S)


def split_env(extra: str) -> tuple[dict[str, str], list[str]]:
    """An --ab ARGS string -> (the environment its leading ``VAR=VALUE`` words set, the server arguments after
    them); as a shell reads ``VAR=VALUE cmd args``: only words before the first other word count."""
    words = shlex.split(extra)
    env: dict[str, str] = {}
    while words and (m := _ENV_WORD.fullmatch(words[0])):
        env[m.group(1)] = m.group(2)
        words.pop(0)
    return env, words


def _plan_configs(args: argparse.Namespace) -> list[tuple[str, dict[str, str], list[str], int | None]] | str:
    """Per --ab configuration (name, environment, server arguments without --port, pinned port or None), or the
    one-line reason the comparison cannot start: --ab-ports and ARGS' --port disagree, a pinned port is taken
    on 127.0.0.1, or a configuration's --max-model-len is shorter than the workload needs."""
    from .runner import context_error
    from .workload import WorkloadSpec

    ports = getattr(args, "ab_ports", None)
    if ports is not None and len(ports) != len(args.ab):
        return (f"--ab-ports lists {len(ports)} port(s) for {len(args.ab)} --ab configuration(s): give one each "
                "(0: any free port)")
    lo, hi = args.turns
    spec = WorkloadSpec(first_turn_tokens=args.first_turn_tokens, turn_tokens=args.turn_tokens, min_turns=lo,
                        max_turns=hi, max_output_tokens=args.max_output_tokens)
    plans: list[tuple[str, dict[str, str], list[str], int | None]] = []
    for i, (name, extra) in enumerate(args.ab):
        env, words = split_env(extra)
        try:
            in_args, words = pop_port(words)
        except ValueError as e:
            return f"--ab {name}: {e}"
        flag = ports[i] if ports else 0
        if flag and in_args and flag != in_args:
            return f"--ab {name}: its ARGS say --port {in_args} but --ab-ports gives it {flag}"
        pinned = flag or in_args
        plans.append((name, env, words, pinned))
        mml = _arg_value(words, "--max-model-len")
        if mml is not None and mml.isdigit():
            if (msg := context_error(spec, int(mml), source=f"--ab {name}'s --max-model-len")) is not None:
                return msg
    # (Two configurations may pin the same port: their servers run one after the other.)
    for name, _, _, p in plans:
        if p:
            if why := port_taken(p):
                return f"--ab {name}: port {p} is taken on 127.0.0.1 ({why}); stop what listens there or pin " \
                       "another with --ab-ports"
    return plans


def run_ab(args: argparse.Namespace, run_one) -> int:
    """Run the workload against each ``--ab`` configuration's server in turn; ``run_one(args) -> (status, rows)`` is
    the single-server run (``cli.run_one``, handed in: ``cli`` imports this module)."""
    names = [n for n, _ in args.ab]
    if len(names) < 2:
        print("qwen4exp-bench: --ab takes two or more configurations (give it twice)", file=sys.stderr)
        return EXIT_SETUP
    if len(set(names)) != len(names):
        print(f"qwen4exp-bench: --ab names must differ, got {', '.join(names)}", file=sys.stderr)
        return EXIT_SETUP
    if args.plot_from:
        print("qwen4exp-bench: --ab and --plot-from do not go together", file=sys.stderr)
        return EXIT_SETUP
    plans = _plan_configs(args)
    if isinstance(plans, str):
        print(f"qwen4exp-bench: {plans}", file=sys.stderr)
        return EXIT_SETUP
    out = Path(args.out or "bench_out/ab")
    out.mkdir(parents=True, exist_ok=True)
    serve_cmd = shlex.split(args.serve_cmd) if args.serve_cmd else default_serve_cmd()
    nonce = _nonce(args.run_nonce)  # one for all configurations: the same conversations on every server
    user_metrics = args.metrics_url
    # SIGTERM to the bench stops the servers too (a signal handler can only be set in the main thread).
    old_term = None
    if threading.current_thread() is threading.main_thread():
        def _term(signum, frame):  # noqa: ARG001
            raise KeyboardInterrupt

        old_term = signal.signal(signal.SIGTERM, _term)

    results: list[dict[str, Any]] = []
    interrupted = False
    try:
        for name, env, words, pinned in plans:
            d = out / name
            d.mkdir(parents=True, exist_ok=True)
            port = pinned or free_port()
            cmd = serve_cmd + words + ["--host", "127.0.0.1", "--port", str(port)]
            res: dict[str, Any] = {"name": name, "cmd": cmd, "env": env, "port": port, "pid": None, "rc": None,
                                   "status": "not started", "error": None, "rows": [], "server_rc": None}
            results.append(res)
            if pinned and (why := port_taken(pinned)):  # taken since the check before the first server
                res.update(status="failed to start", rc=EXIT_SETUP,
                           error=f"port {pinned} is taken on 127.0.0.1 ({why})")
                print(f"[ab] {name}: {res['error']}", file=sys.stderr)
                continue
            shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
            print(f"[ab] {name}: starting {shown + ' ' if shown else ''}{shlex.join(cmd)} (log {d / 'server.log'})",
                  file=sys.stderr)
            proc = None
            with (d / "server.log").open("w") as log:
                try:
                    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env={**os.environ, **env} if env else None)
                    res["pid"] = proc.pid
                    startup = wait_models(proc, port, args.ab_start_timeout, d / "server.log")
                    res["startup_s"] = round(startup, 3)
                    print(f"[ab] {name}: up in {startup:.1f} s on port {port}", file=sys.stderr)
                    a = copy.copy(args)
                    a.base_url = f"http://127.0.0.1:{port}/v1"
                    a.label = name
                    a.out = str(d)
                    a.plot_out = None  # --plot-out names ab.png; each configuration keeps its own tradeoff.png
                    a.run_nonce = nonce if nonce else "none"
                    a.metrics_url = user_metrics if user_metrics and user_metrics.lower() in ("none", "off") \
                        else None
                    a.reraise_interrupt = True
                    rc, rows = run_one(a)
                    res.update(rc=rc, rows=rows, status="ran" if rc == EXIT_OK else f"ran, exit status {rc}")
                except StartError as e:
                    res.update(status="failed to start", error=str(e), rc=EXIT_SETUP)
                    print(f"[ab] {name}: {e}", file=sys.stderr)
                except OSError as e:
                    res.update(status="failed to start", error=f"{type(e).__name__}: {e}", rc=EXIT_SETUP)
                    print(f"[ab] {name}: cannot start {cmd[0]}: {e}", file=sys.stderr)
                except KeyboardInterrupt:
                    res.update(status="interrupted", rc=EXIT_TURNS_FAILED)
                    interrupted = True
                    raise
                finally:
                    if proc is not None:
                        res["server_rc"] = stop_server(proc, args.ab_stop_timeout)
                        print(f"[ab] {name}: server stopped (status {res['server_rc']})", file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)

    rows = ab_rows(results)
    write_ab_csv(rows, out / "ab.csv")
    (out / "ab.json").write_text(json.dumps(
        {"run_nonce": nonce, "configs": [{k: v for k, v in r.items() if k != "rows"} for r in results],
         "interrupted": interrupted}, indent=2, default=str) + "\n")
    if rows:
        print_ab_table(rows)
        if not args.no_plot:
            plot_ab(rows, Path(args.plot_out) if args.plot_out else out / "ab.png", args.title)
    print(f"A/B results in {out}/ (ab.csv, ab.json" + (", ab.png" if rows and not args.no_plot else "")
          + "; per configuration " + ", ".join(f"{n}/" for n in names) + ")")
    bad = [r for r in results if r["rc"] != EXIT_OK]
    not_run = names[len(results):]
    for r in bad:
        print(f"ERROR: configuration {r['name']}: {r['status']}" + (f": {r['error'].splitlines()[0]}"
                                                                     if r.get("error") else ""), file=sys.stderr)
    if not_run:
        print(f"ERROR: configurations not run: {', '.join(not_run)}", file=sys.stderr)
    if interrupted or bad or not_run:
        return EXIT_TURNS_FAILED if rows else EXIT_SETUP
    return EXIT_OK
