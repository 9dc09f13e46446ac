"""Shared by the qwen4exp-bench tests (test_bench, test_bench_sessions, test_bench_readme, test_agentic_gpu): the
miniature workload's sizes, the fake OpenAI server (``fake_openai_server.py``) and its fixture, the in-process CLI
runner with a time limit, and checks of what the benchmark writes (PNG, summary CSV). A helper module, not a test
module: test modules import it, never each other."""

from __future__ import annotations

import csv
import io
import json
import struct
import subprocess
import sys
import threading
import time
import zlib
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from qwen4exp.bench import cli
from qwen4exp.bench import metrics as M

FAKE = Path(__file__).with_name("fake_openai_server.py")

# The miniature workload CI runs (issue 6): first turn 200 tokens, +20 per turn,
# 3 turns, 16 output tokens, concurrency 1 and 2.
FIRST, TURN, TURNS, OUT = 200, 20, 3, 16
CONCURRENCY = [1, 2]


# ---------------------------------------------------------------------------
# servers


@dataclass
class Server:
    kind: str
    base_url: str
    model: str
    tokenizer: str | None = None  # --tokenizer DIR for the client (None: the server's /tokenize)
    reply_close: int | None = None  # template tokens closing a reply, when known (fake: 2)
    has_prefix_cache_metrics: bool = False
    proc: subprocess.Popen | None = None


def start_fake(*extra: str, timeout: float = 20.0) -> Server:
    proc = subprocess.Popen(
        [sys.executable, str(FAKE), "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not line or not line[0].startswith("READY "):
        stop_process(proc)
        raise RuntimeError(f"fake server did not start: {line!r}")
    port = int(line[0].split()[1])
    return Server(
        kind="fake",
        base_url=f"http://127.0.0.1:{port}/v1",
        model="fake-model",
        reply_close=2,
        has_prefix_cache_metrics=True,
        proc=proc,
    )


def stop_process(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture
def fake_factory():
    """Start fake servers with failure switches; all are stopped after the test."""
    started: list[Server] = []

    def make(*extra: str) -> Server:
        s = start_fake(*extra)
        started.append(s)
        return s

    yield make
    for s in started:
        stop_process(s.proc)


# ---------------------------------------------------------------------------
# running the CLI in-process, bounded


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    seconds: float
    out: Path

    @property
    def rows(self) -> list[dict[str, str]]:
        with (self.out / "summary.csv").open(newline="") as f:
            return list(csv.DictReader(f))

    @property
    def header(self) -> list[str]:
        with (self.out / "summary.csv").open(newline="") as f:
            return next(csv.reader(f))

    @property
    def turns(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in (self.out / "turns.jsonl").read_text().splitlines() if x.strip()]


def run_cli(argv: list[str], timeout: float = 90.0) -> tuple[int, str, str, float]:
    """Run ``qwen4exp-bench`` in this process (the package import is slow) with a hard time limit."""
    out, err = io.StringIO(), io.StringIO()
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            with redirect_stdout(out), redirect_stderr(err):
                result["rc"] = cli.main(argv)
        except SystemExit as e:  # --help
            result["rc"] = e.code
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            result["exc"] = e

    t0 = time.monotonic()
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout)
    elapsed = time.monotonic() - t0
    assert not th.is_alive(), f"qwen4exp-bench did not finish within {timeout} s (hang)"
    if "exc" in result:
        raise result["exc"]
    return result["rc"], out.getvalue(), err.getvalue(), elapsed


def mini_argv(server: Server, out: Path, *extra: str) -> list[str]:
    argv = [
        "--base-url", server.base_url,
        "--first-turn-tokens", str(FIRST),
        "--turn-tokens", str(TURN),
        "--turns", str(TURNS),
        "--max-output-tokens", str(OUT),
        "--concurrency", ",".join(map(str, CONCURRENCY)),
        "--num-gpus", "1",
        "--seed", "7",
        "--warmup", "1",
        "--request-timeout", "120",
        "--no-progress",
        "--out", str(out),
    ]  # fmt: skip
    if server.model:
        argv += ["--model", server.model]
    if server.tokenizer:
        argv += ["--tokenizer", server.tokenizer]
    return argv + list(extra)


def bench(argv: list[str], out: Path, timeout: float = 90.0) -> Run:
    rc, so, se, dt = run_cli(argv, timeout)
    return Run(rc, so, se, dt, out)


# ---------------------------------------------------------------------------
# helpers


def num(s: str) -> float | None:
    return float(s) if s not in ("", None) else None


def check_png(path: Path) -> tuple[int, int]:
    """Validate a PNG: signature, chunk CRCs, IHDR, IDAT inflating to the right size."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        tag = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF, f"bad CRC in {tag!r}"
        chunks.append((tag, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert w > 100 and h > 100 and depth == 8
    if color == 2 and interlace == 0:  # what our own writer produces: check the pixel data too
        raw = zlib.decompress(b"".join(b for t, b in chunks if t == b"IDAT"))
        assert len(raw) == h * (1 + 3 * w)
    return w, h




def write_csv(path: Path, rows: list[dict[str, str]], label: str, scale: float) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=M.SUMMARY_COLUMNS)
        w.writeheader()
        for r in rows:
            r = dict(r, label=label)
            r["tok_s_user"] = str(float(r["tok_s_user"]) * scale)
            r["tok_s_gpu"] = str(float(r["tok_s_gpu"]) / scale)
            w.writerow(r)


# -- the README examples (tests/test_bench_readme.py checks them against the docs; test_bench runs the CPU one against make serve)

CKPT = "qwen4exp/assets/tiny-coder"

README_CPU_EXAMPLE = """\
.venv/bin/qwen4exp-bench --base-url http://127.0.0.1:8000/v1 --tokenizer qwen4exp/assets/tiny-coder \\
    --first-turn-tokens 300 --turn-tokens 40 --turns 3 --max-output-tokens 16 --concurrency 1,2 \\
    --hardware CPU --label tiny-cpu --out bench_out/tiny-cpu"""

README_AB_EXAMPLE = """\
SRV='qwen4exp/assets/tiny-coder --max-model-len 2048 --enforce-eager --enable-prompt-tokens-details --num-gpu-blocks-override 96 --max-num-seqs 4'
.venv/bin/qwen4exp-bench --ab default="$SRV" \\
    --ab agent="$SRV --scheduler-cls qwen4exp.serving.scheduler.AgentScheduler" --ab-ports 8101,8102 \\
    --tokenizer qwen4exp/assets/tiny-coder --think-time lognormal:0.5,1,3 --first-turn-tokens 1000 \\
    --turn-tokens 100 --turns 4 --max-output-tokens 32 --concurrency 4 --conversations 8 --warmup 0 \\
    --out bench_out/ab-agent"""  # noqa: E501


def shell_argv(block: str) -> list[str]:
    """The arguments bash passes to ``.venv/bin/qwen4exp-bench`` when it runs ``block`` (variables expanded,
    quotes and line continuations removed)."""
    assert block.count(".venv/bin/qwen4exp-bench ") == 1
    script = "qb() { printf '%s\\0' \"$@\"; }\n" + block.replace(".venv/bin/qwen4exp-bench ", "qb ")
    out = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout.decode()
    return out.split("\0")[:-1]


def replace_value(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]

# The agent A/B's servers and workload (tests/test_agent_ab.py runs them; docs/scheduling.md shows them)
SRV = f"{CKPT} --max-model-len 2048 --enforce-eager --enable-prompt-tokens-details --num-gpu-blocks-override 96 " \
      "--max-num-seqs 4"
AGENT = " --scheduler-cls qwen4exp.serving.scheduler.AgentScheduler"
WORKLOAD = ["--first-turn-tokens", "1000", "--turn-tokens", "100", "--turns", "4", "--max-output-tokens", "32",
            "--concurrency", "4", "--conversations", "8", "--warmup", "0", "--think-time", "lognormal:0.5,1,3"]


def run_readme_cpu_example(base_url: str, out: Path, timeout: float = 90.0):
    argv = shell_argv(README_CPU_EXAMPLE)
    assert argv[argv.index("--base-url") + 1] == "http://127.0.0.1:8000/v1"  # make serve PORT=8000
    argv = replace_value(replace_value(argv, "--base-url", base_url), "--out", str(out))
    return run_cli(argv, timeout=timeout)


def check_readme_cpu_run(rc: int, err: str, out: Path) -> None:
    assert rc == 0, err
    assert "WARNING" not in err and "ERROR" not in err, err
    with (out / "summary.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["concurrency"] for r in rows] == ["1", "2"]
    for r in rows:
        assert r["label"] == "tiny-cpu" and r["hardware"] == "CPU"
        assert int(r["turns_ok"]) == int(r["turns_sent"]) == 4 * 3 and int(r["prompt_tokens_mismatch"]) == 0
