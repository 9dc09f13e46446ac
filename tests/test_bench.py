"""Tests of the agentic benchmark ``qwen4exp-bench`` (issue 6).

The server under test is the ``server`` fixture. It defaults to the fake
OpenAI-compatible server in ``fake_openai_server.py``; setting
``QWEN4EXP_BENCH_BASE_URL`` (and optionally ``QWEN4EXP_BENCH_MODEL``,
``QWEN4EXP_BENCH_TOKENIZER``) adds an ``external`` parameter that runs the same
miniature-workload assertions against that server (e.g. ``qwen4exp-serve`` on
CPU). To start a real server from the fixture, add a parameter to ``SERVERS``
and a branch in ``server``.

The failure-injection tests (server dies, stream stalls, truncation, MTP) need
the fake server's switches and always use it.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from qwen4exp.bench import cli
from qwen4exp.bench import metrics as M
from qwen4exp.bench import plot as P
from qwen4exp.bench.plot import render_builtin, series_from_csvs

from bench_support import (CONCURRENCY, FIRST, OUT, TURN, TURNS, Run, Server, bench, check_png,  # noqa: F401
                           fake_factory, mini_argv, num, run_cli, start_fake, stop_process, write_csv)

# "qwen4exp": our vLLM CPU server (the qwen4exp plugin) serving the embedded trained tiny checkpoint.
SERVERS = ["fake", pytest.param("qwen4exp", marks=pytest.mark.vllm)] + (
    ["external"] if os.environ.get("QWEN4EXP_BENCH_BASE_URL") else [])


@pytest.fixture(scope="module", params=SERVERS)
def server(request):
    """The server the miniature workload runs against (see the module docstring)."""
    if request.param == "fake":
        s = start_fake()
        try:
            yield s
        finally:
            stop_process(s.proc)
    elif request.param == "qwen4exp":
        from qwen4exp.demo import ASSET, free_port, start_server, stop_server, wait_ready

        port = free_port()
        proc = start_server(ASSET, port)
        try:
            wait_ready(proc, port, timeout=300)
            yield Server(kind="qwen4exp", base_url=f"http://127.0.0.1:{port}/v1", model="tiny-coder",
                         tokenizer=ASSET)
        finally:
            stop_server(proc)
    elif request.param == "external":
        yield Server(
            kind="external",
            base_url=os.environ["QWEN4EXP_BENCH_BASE_URL"],
            model=os.environ.get("QWEN4EXP_BENCH_MODEL", ""),
            tokenizer=os.environ.get("QWEN4EXP_BENCH_TOKENIZER") or None,
        )
    else:  # pragma: no cover
        raise ValueError(request.param)


@pytest.fixture(scope="module")
def mini(server, tmp_path_factory) -> Run:
    out = tmp_path_factory.mktemp(f"mini-{server.kind}")
    return bench(mini_argv(server, out, "--label", f"mini-{server.kind}"), out, timeout=600)


# ---------------------------------------------------------------------------
# the miniature run


def test_mini_run_succeeds(mini: Run):
    assert mini.rc == 0, mini.stderr
    sizing = json.loads((mini.out / "summary.json").read_text())["server"]["new_turn_sizing"]
    assert sizing == "user-message proxy"
    assert "ERROR" not in mini.stderr
    assert "WARNING" not in mini.stderr, mini.stderr
    assert "tok/s/user" in mini.stdout and "tok/s/GPU" in mini.stdout
    for name in ("summary.csv", "summary.json", "turns.jsonl", "tradeoff.png"):
        assert (mini.out / name).is_file(), name


def test_readme_cpu_example_on_make_serve(server: Server, tmp_path):
    """docs/benchmarks.md's CPU benchmark line (tests/test_bench_readme.py) against ``make serve``'s server: the
    ``qwen4exp`` server here is started as ``make serve`` starts it (``qwen4exp.demo.start_server``)."""
    if server.kind != "qwen4exp":
        pytest.skip("needs the make-serve server (tiny-coder); the fake one: tests/test_bench_readme.py")
    from bench_support import check_readme_cpu_run, run_readme_cpu_example

    rc, _, err, dt = run_readme_cpu_example(server.base_url, tmp_path / "out", timeout=120)
    check_readme_cpu_run(rc, err, tmp_path / "out")
    print(f"README CPU example: {dt:.1f} s")


def test_summary_csv_columns_and_sane_values(mini: Run, server: Server):
    assert mini.header == M.SUMMARY_COLUMNS
    rows = mini.rows
    assert [int(r["concurrency"]) for r in rows] == CONCURRENCY
    for r in rows:
        c = int(r["concurrency"])
        conversations = int(r["conversations"])
        assert conversations == max(4, 2 * c)
        assert r["label"] == f"mini-{server.kind}"
        # every turn sent came back whole; nothing dropped
        assert int(r["turns_sent"]) == conversations * TURNS
        assert int(r["turns_ok"]) == int(r["turns_sent"])
        assert int(r["turns_failed"]) == 0 and int(r["turns_truncated"]) == 0 and int(r["turns_not_sent"]) == 0
        assert int(r["output_tokens"]) == conversations * TURNS * OUT
        assert int(r["prompt_tokens_mismatch"]) == 0
        # latency metrics
        tpot = num(r["tpot_mean_ms"])
        assert tpot is not None and tpot > 0
        assert num(r["tok_s_user"]) == pytest.approx(1000.0 / tpot, rel=1e-2)
        assert num(r["tok_s_user_p90"]) > 0
        assert 0 < num(r["ttft_p50_ms"]) <= num(r["ttft_p90_ms"]) <= num(r["ttft_p99_ms"])
        assert 0 <= num(r["itl_p50_ms"]) <= num(r["itl_p90_ms"]) <= num(r["itl_p99_ms"])
        # throughput
        dur, busy = num(r["duration_s"]), num(r["busy_s"])
        assert 0 < busy <= dur * 1.001
        assert num(r["prep_ms_mean"]) >= 0
        assert num(r["output_tok_s"]) == pytest.approx(int(r["output_tokens"]) / busy, rel=2e-2)
        assert num(r["tok_s_gpu"]) == pytest.approx(num(r["output_tok_s"]) / float(r["num_gpus"]), rel=1e-3)
        assert num(r["tok_min_gpu"]) == pytest.approx(60 * num(r["tok_s_gpu"]), rel=1e-3)
        assert num(r["total_tok_s"]) > num(r["output_tok_s"])
        # server metrics
        hit = num(r["cache_hit_pct"])
        if server.has_prefix_cache_metrics:
            # later turns reuse the earlier prompt and reply: well above zero
            assert hit is not None and 30 < hit < 100
        if hit is not None:
            assert 0 <= hit <= 100
        acc = num(r["acceptance_length"])
        assert acc is None or acc >= 1
        assert int(r["prompt_tokens_max"]) >= FIRST + (TURNS - 1) * (TURN + OUT)


def test_token_counts_exact(mini: Run, server: Server):
    recs = mini.turns
    warm = [r for r in recs if r["phase"] == "warmup"]
    recs = [r for r in recs if r["phase"] == "bench"]
    assert len(warm) == TURNS  # one warm-up conversation, not in the summary
    assert sum(int(r["turns_sent"]) for r in mini.rows) == len(recs)
    by_conv: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by_conv.setdefault(r["conversation"], []).append(r)
    for conv in by_conv.values():
        conv.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in conv] == list(range(1, TURNS + 1))
        # sessions (on by default): one X-Session-ID for the conversation, session_close sent with its last turn
        # (the real server accepted it: that turn is ok like the others)
        assert len({r["session_id"] for r in conv}) == 1 and conv[0]["session_id"]
        assert [r["session_close"] for r in conv] == [False] * (TURNS - 1) + [True]
        for i, r in enumerate(conv):
            assert r["status"] == "ok"
            assert r["completion_tokens"] == OUT
            # the server's count is the plan's and the client's
            assert r["prompt_tokens"] == r["planned_prompt_tokens"] == r["client_prompt_tokens"]
            if i == 0:
                assert r["prompt_tokens"] == FIRST
                continue
            prev = conv[i - 1]
            # exactly TURN new tokens after the conversation so far
            assert r["prompt_tokens"] - r["history_tokens"] == TURN
            assert r["history_tokens"] >= prev["prompt_tokens"] + 1
            if server.reply_close is not None:
                assert r["history_tokens"] == prev["prompt_tokens"] + OUT + server.reply_close
            assert r["tpot_ms"] > 0 and r["ttft_ms"] > 0
            assert len(r["itl_ms"]) == r["chunks"] - 1


def test_plot_is_valid_png(mini: Run):
    check_png(mini.out / "tradeoff.png")
    texts = P.png_texts(mini.out / "tradeoff.png")
    # the legend is the run's --label; --num-gpus was given: per GPU; workload and hardware in the subtitle
    assert {r["label"] for r in mini.rows} == {texts["Legend"]} and texts["Legend"].startswith("mini-")
    assert texts["Y label"] == P.Y_LABEL and "per GPU" in texts["Y label"]
    assert texts["X label"] == P.X_LABEL
    assert texts["Description"] == (
        f"workload: {FIRST}-token first turn, +{TURN} a turn, {TURNS} turns, {OUT} output tokens | hardware: 1 GPU")
    assert all(r["hardware"] == "1 GPU" and r["workload"] in texts["Description"] for r in mini.rows)


# ---------------------------------------------------------------------------
# CLI surface


REQUIRED_FLAGS = [
    "--base-url", "--model", "--first-turn-tokens", "--turn-tokens", "--turns", "--max-output-tokens",
    "--concurrency", "--num-gpus", "--label", "--seed", "--out", "--request-timeout", "--tokenizer",
    "--conversations", "--duration", "--plot-from",
]  # fmt: skip


def test_help_documents_every_flag():
    rc, out, _, _ = run_cli(["--help"], timeout=30)
    assert rc == 0
    for flag in REQUIRED_FLAGS:
        assert flag in out, flag
    parser = cli.build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"
        for opt in action.option_strings:
            assert opt in out
    for col in M.SUMMARY_COLUMNS:
        assert col in out  # the epilog documents the CSV


def test_main_is_the_console_entry_point():
    from qwen4exp.bench import main

    assert main is cli.main


def test_unreachable_server_is_a_clear_setup_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, _, err, dt = run_cli(["--base-url", f"http://127.0.0.1:{port}/v1", "--out", str(tmp_path), "--no-progress"])
    assert rc == cli.EXIT_SETUP
    assert "cannot reach the server" in err
    assert dt < 30


def test_bad_flag_values_are_rejected():
    for argv in (["--turns", "5-3"], ["--concurrency", "0"], ["--extra-body", "[1]"], ["--num-gpus", "-1"]):
        rc, _, err, _ = run_cli(argv, timeout=30)
        assert rc == 2, argv


# ---------------------------------------------------------------------------
# the workload against the server's context length


def test_context_error_names_the_flag_to_lower():
    from qwen4exp.bench.runner import context_error
    from qwen4exp.bench.workload import WorkloadSpec

    def err(max_len, reply_close=0, **kw):
        return context_error(WorkloadSpec(**kw), max_len, reply_close)

    # the README's CPU example fits tiny-coder's 2048 (make serve); the defaults (50k first turns) do not
    assert err(2048, 2, first_turn_tokens=300, turn_tokens=40, min_turns=3, max_turns=3, max_output_tokens=16) is None
    assert err(None) is None and err(0) is None
    msg = err(2048)
    assert msg.count("\n") == 0 and "needs 68700 tokens" in msg and "max_model_len is 2048" in msg
    assert "lower --first-turn-tokens to at most 1548 with --turns 1" in msg
    # the first turn is what to cut: the largest one that fits, and the other way out
    kw = dict(first_turn_tokens=1000, turn_tokens=100, min_turns=15, max_turns=15, max_output_tokens=32)
    assert "lower --first-turn-tokens to at most 168 (or --turns to at most 8)" in err(2048, **kw)
    assert "to at most 140 (or --turns to at most 8)" in err(2048, 2, **kw)  # template tokens of each reply count
    assert err(1000 + 32 + 14 * 134, 2, **kw) is None  # exactly full fits
    # the later turns alone overflow: fewer turns
    kw = dict(first_turn_tokens=300, turn_tokens=400, min_turns=3, max_turns=8, max_output_tokens=32)
    assert "lower --turns to at most 4 " in err(2048, **kw)
    assert "lower --max-output-tokens below 100" in err(100, first_turn_tokens=200, max_output_tokens=500)


def test_workload_longer_than_max_model_len_stops_before_any_request(fake_factory, tmp_path):
    log = tmp_path / "requests.jsonl"
    srv = fake_factory("--max-model-len", "2048", "--request-log", str(log))
    # the README's GPU-sized line (defaults: 50k-token first turns) against a CPU-sized server
    rc, out, err, dt = run_cli(["--base-url", srv.base_url, "--concurrency", "1,2,4,8", "--num-gpus", "1",
                                "--label", "mine", "--out", str(tmp_path / "o"), "--no-progress"], timeout=30)
    assert rc == cli.EXIT_SETUP, err
    (line,) = err.strip().splitlines()  # one line, naming the flag and the server's limit
    assert "max_model_len is 2048" in line and "lower --first-turn-tokens" in line
    assert not log.exists() or not log.read_text().strip()  # no chat request was sent
    assert dt < 15


# ---------------------------------------------------------------------------
# failure handling


def test_server_dying_mid_run_fails_turns_with_a_clear_message(fake_factory, tmp_path):
    srv = fake_factory("--die-after", "5")  # dies in the middle of the 5th chat stream
    run = bench(mini_argv(srv, tmp_path, "--warmup", "0", "--request-timeout", "20"), tmp_path, timeout=60)
    assert run.seconds < 30, "a dead server must not stall the run"
    assert run.rc == cli.EXIT_TURNS_FAILED
    assert "stopped answering" in run.stderr and srv.base_url in run.stderr
    assert "turn(s) failed" in run.stderr
    rows = run.rows
    assert [int(r["concurrency"]) for r in rows] == [1]  # level 2 never started
    assert "concurrency levels not run: 2" in run.stderr
    r = rows[0]
    assert int(r["turns_failed"]) >= 1
    assert int(r["turns_sent"]) == int(r["turns_ok"]) + int(r["turns_truncated"]) + int(r["turns_failed"])
    assert int(r["turns_sent"]) + int(r["turns_not_sent"]) == int(r["conversations"]) * TURNS
    failed = [t for t in run.turns if t["status"] == "failed"]
    assert failed and all(t["error"] for t in failed)
    check_png(tmp_path / "tradeoff.png")
    assert json.loads((tmp_path / "summary.json").read_text())["aborted"] is True


def test_stalled_stream_hits_the_request_timeout(fake_factory, tmp_path):
    srv = fake_factory("--stall-after", "2")
    run = bench(mini_argv(srv, tmp_path, "--warmup", "0", "--request-timeout", "1"), tmp_path, timeout=60)
    assert run.seconds < 30
    assert run.rc == cli.EXIT_TURNS_FAILED
    assert "timed out" in run.stderr
    rows = run.rows
    assert [int(r["concurrency"]) for r in rows] == CONCURRENCY  # the server still answers: the run goes on
    assert sum(int(r["turns_failed"]) for r in rows) == 1
    assert int(rows[1]["turns_ok"]) == int(rows[1]["turns_sent"])


def test_truncated_turns_are_counted(fake_factory, tmp_path):
    srv = fake_factory("--truncate-after", "8")
    run = bench(mini_argv(srv, tmp_path, "--warmup", "0", "--concurrency", "2"), tmp_path)
    assert run.rc == 0
    (r,) = run.rows
    assert int(r["turns_truncated"]) == int(r["turns_sent"]) > 0
    assert int(r["turns_ok"]) == 0
    assert "truncated" in run.stderr


def test_duration_limit_bounds_a_level(fake_factory, tmp_path):
    srv = fake_factory("--token-delay", "0.02")  # ~0.3 s per turn
    argv = mini_argv(srv, tmp_path, "--warmup", "0", "--concurrency", "2", "--conversations", "12", "--duration", "0.4")
    run = bench(argv, tmp_path)
    assert run.rc == 0
    (r,) = run.rows
    assert int(r["turns_not_sent"]) > 0
    assert int(r["turns_failed"]) == 0
    assert run.seconds < 30


def test_missing_tokenize_route_asks_for_a_tokenizer(fake_factory, tmp_path):
    srv = fake_factory("--no-tokenize")
    run = bench(mini_argv(srv, tmp_path), tmp_path)
    assert run.rc == cli.EXIT_SETUP
    assert "--tokenizer" in run.stderr


# ---------------------------------------------------------------------------
# server metrics


def test_mtp_acceptance_length_and_usage_cache(fake_factory, tmp_path):
    srv = fake_factory("--mtp", "3", "--usage-details")
    run = bench(mini_argv(srv, tmp_path, "--warmup", "0"), tmp_path)
    assert run.rc == 0, run.stderr
    for r in run.rows:
        acc = num(r["acceptance_length"])
        assert acc is not None and 1.5 < acc < 3.5  # fake accepts uniform 0..3 drafts: mean 2.5
        assert num(r["cache_hit_usage_pct"]) > 0
        assert int(r["prompt_tokens_mismatch"]) == 0
    # several tokens per chunk: fewer chunks than tokens, TPOT still per token
    recs = [t for t in run.turns if t["phase"] == "bench"]
    assert all(t["chunks"] < t["completion_tokens"] for t in recs)


def test_metrics_flag_none_leaves_server_columns_blank(fake_factory, tmp_path):
    srv = fake_factory()
    run = bench(mini_argv(srv, tmp_path, "--warmup", "0", "--concurrency", "1", "--metrics-url", "none"), tmp_path)
    assert run.rc == 0
    (r,) = run.rows
    assert r["cache_hit_pct"] == "" and r["acceptance_length"] == ""


# ---------------------------------------------------------------------------
# exact counts with a real BPE tokenizer (replies re-tokenize differently)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """A tiny byte-level BPE tokenizer with a ChatML template, saved as a model directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from qwen4exp.bench.workload import CodeText

    gen = CodeText(random.Random(0))
    texts = [gen.chunk(4000, "code") for _ in range(10)] + [gen.chunk(4000, "tool") for _ in range(10)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    d = tmp_path_factory.mktemp("bpe")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "clean_up_tokenization_spaces": False,
                "model_max_length": 1000000,
                "chat_template": CHATML,
            }
        )
    )
    return d


@pytest.mark.parametrize("counting", ["local", "server"])
def test_exact_counts_with_bpe_tokenizer(fake_factory, bpe_dir, tmp_path, counting):
    srv = fake_factory("--tokenizer-json", str(bpe_dir / "tokenizer.json"))
    if counting == "local":
        srv.tokenizer = str(bpe_dir)
    srv.reply_close = None  # random BPE replies need not re-tokenize to 16 tokens
    run = bench(mini_argv(srv, tmp_path, "--warmup", "0", "--turns", "3-5", "--concurrency", "2"), tmp_path)
    assert run.rc == 0, run.stderr
    assert "WARNING" not in run.stderr
    for r in run.rows:
        assert int(r["prompt_tokens_mismatch"]) == 0
        assert int(r["turns_ok"]) == int(r["turns_sent"])
    recs = [t for t in run.turns if t["phase"] == "bench"]
    assert {t["num_turns"] for t in recs} <= {3, 4, 5}
    for t in recs:
        assert t["prompt_tokens"] == t["planned_prompt_tokens"] == t["client_prompt_tokens"]
        if t["turn"] == 1:
            assert t["prompt_tokens"] == FIRST
        else:
            assert t["prompt_tokens"] - t["history_tokens"] == TURN


def test_exact_counts_when_the_template_insists_on_alternating_roles(fake_factory, tmp_path):
    srv = fake_factory("--strict-alternation")  # no two user messages in a row: history-count fallback
    run = bench(mini_argv(srv, tmp_path, "--warmup", "0", "--concurrency", "2"), tmp_path)
    assert run.rc == 0, run.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["server"]["new_turn_sizing"] == "history count"
    (r,) = run.rows
    assert int(r["prompt_tokens_mismatch"]) == 0 and int(r["turns_ok"]) == int(r["turns_sent"])
    for t in run.turns:
        if t["turn"] > 1:
            assert t["prompt_tokens"] - t["history_tokens"] == TURN


# ---------------------------------------------------------------------------
# plotting


def test_plot_from_combines_labels(mini: Run, tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    write_csv(a, mini.rows, "server-a", 1.0)
    write_csv(b, mini.rows, "server-b", 0.6)
    series = series_from_csvs([a, b])
    assert list(series) == ["server-a", "server-b"]
    assert [p[2] for p in series["server-b"]] == CONCURRENCY
    png = tmp_path / "cmp.png"
    rc, out, _, _ = run_cli(["--plot-from", str(a), str(b), "--plot-out", str(png)], timeout=30)
    assert rc == 0 and str(png) in out
    check_png(png)


def _pixels(path: Path) -> tuple[int, int, bytes]:
    """RGB pixels of a PNG our writer produced (8-bit RGB, filter 0 on every row)."""
    w, h = check_png(path)
    data, pos, idat = path.read_bytes(), 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        if data[pos + 4 : pos + 8] == b"IDAT":
            idat += data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    raw = zlib.decompress(idat)
    rows = [raw[y * (1 + 3 * w) : (y + 1) * (1 + 3 * w)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)
    return w, h, b"".join(r[1:] for r in rows)


def test_plot_texts_and_nothing_outside_the_axes(mini: Run, tmp_path):
    # a CPU run without --num-gpus: per server; --hardware in the subtitle; two labels in the legend
    rows = [dict(r, num_gpus="", hardware="2-core CPU") for r in mini.rows]
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    write_csv(a, rows, "cpu-a", 1.0)
    write_csv(b, rows, "cpu-b", 0.6)
    png = P.plot_summary_csvs([a, b], tmp_path / "cpu.png", backend="builtin")
    texts = P.png_texts(png)
    assert texts["Legend"].split("\n") == ["cpu-a", "cpu-b"]
    assert texts["Y label"] == P.Y_LABEL_SERVER and "GPU" not in texts["Y label"]
    assert texts["Description"].endswith("| hardware: 2-core CPU") and f"{FIRST}-token first turn" in texts["Description"]
    assert texts["Title"] == P.DEFAULT_TITLE
    # one run per GPU, one per server: the axis says both
    write_csv(b, mini.rows, "gpu-b", 1.0)
    assert P.png_texts(P.plot_summary_csvs([a, b], tmp_path / "mixed.png", backend="builtin"))["Y label"] == (
        P.Y_LABEL_MIXED)
    # every pixel of a series colour (lines, points, their c=N labels) lies inside the plot box
    w, h, px = _pixels(png)
    x0, y0, x1, y1 = 110, 40 + 21 + 22 * 2, w - 40, h - 90  # render_builtin's box: title + a two-line subtitle
    colours = {bytes(c) for c in P.PALETTE[:2]}
    outside = [(x, y) for y in range(h) for x in range(w)
               if not (x0 <= x <= x1 and y0 <= y <= y1) and px[3 * (y * w + x) : 3 * (y * w + x) + 3] in colours]
    assert not outside, f"{len(outside)} series pixels outside the axes, e.g. {outside[:3]}"


def test_subtitle_wraps_instead_of_clipping():
    sub = P.subtitle([{"workload": M.describe_workload(50000, 800, 10, 15, 500),
                       "hardware": "4x GB300, TP4 + EP4, MTP 3, FP8 KV"}])
    lines = P.wrap_text(sub, 40)
    assert " ".join(lines).replace("  ", " ") == sub.replace(" | ", " ") and all(len(x) <= 40 for x in lines)
    assert lines[0].startswith("workload: 50000-token") and any(x.startswith("hardware: 4x GB300") for x in lines)


def test_point_labels_stay_inside_the_box():
    box = (100, 50, 900, 600)
    for px, py in [(898, 300), (899, 52), (101, 598), (500, 300), (101, 51)]:
        x, y = P.label_position(px, py, 36, 14, box)
        assert box[0] < x and x + 36 < box[2] and box[1] < y and y + 14 < box[3]
    assert P.label_position(500, 300, 36, 14, box) == (509, 277)  # default: above right of the point
    assert P.label_position(898, 300, 36, 14, box)[0] < 898 - 36  # at the right edge: left of the point


def test_builtin_renderer_writes_a_valid_png(tmp_path):
    series = {"x": [(10.0, 100.0, 1), (8.0, 180.0, 2), (5.5, 300.0, 4)], "label (gpjqy)": [(12.0, 90.0, 1)]}
    w, h = check_png(render_builtin(series, tmp_path / "p.png", "Title: 1/2 (%)"))
    assert (w, h) == (1000, 680)
    check_png(render_builtin({}, tmp_path / "empty.png", "empty"))


# ---------------------------------------------------------------------------
# metric definitions


PROM = """\
# HELP vllm:prefix_cache_queries Prefix cache queries
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 300.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 77.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 180.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 90.0
vllm:num_requests_running{engine="0",model_name="m"} NaN
"""


def test_parse_prometheus_sums_engines_and_strips_total():
    s = M.parse_prometheus(PROM)
    assert s["vllm:prefix_cache_queries"] == 1500.0
    assert s["vllm:prefix_cache_hits"] == 900.0
    assert s["vllm:spec_decode_num_accepted_tokens"] == 180.0
    assert "vllm:prefix_cache_queries_created" not in s
    assert "vllm:num_requests_running" not in s  # NaN dropped


def test_server_metrics_deltas():
    before = M.parse_prometheus(PROM)
    after = dict(before)
    after["vllm:prefix_cache_queries"] += 200
    after["vllm:prefix_cache_hits"] += 150
    after["vllm:spec_decode_num_drafts"] += 10
    after["vllm:spec_decode_num_accepted_tokens"] += 25
    sm = M.server_metrics(before, after)
    assert sm["cache_hit_pct"] == pytest.approx(75.0)
    assert sm["acceptance_length"] == pytest.approx(3.5)
    none = M.server_metrics(None, {"vllm:other": 1.0})
    assert none["cache_hit_pct"] is None and none["acceptance_length"] is None
    assert M.server_metrics(None, None)["cache_hit_pct"] is None


def test_busy_time_is_the_union_of_in_flight_intervals():
    assert M.busy_time([]) == 0
    assert M.busy_time([(0, 1), (0.5, 2), (3, 4), (3.5, 3.6)]) == pytest.approx(3.0)


def test_tpot_and_percentiles():
    assert M.tpot_ms(1100.0, 100.0, 501) == pytest.approx(2.0)
    assert M.tpot_ms(100.0, 100.0, 1) is None
    import numpy as np

    rng = random.Random(1)
    xs = [rng.random() * 100 for _ in range(37)]
    for q in (50, 90, 99):
        assert M.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert M.percentile([], 50) is None


def test_summarize_level_weights_turns_equally_and_counts_failures():
    def turn(status, tpot, ttft, itl, out):
        return {"status": status, "tpot_ms": tpot, "ttft_ms": ttft, "itl_ms": itl, "completion_tokens": out,
                "prompt_tokens": 50 if out else None}  # fmt: skip

    turns = [
        turn("ok", 10.0, 100.0, [10.0], 100),
        turn("ok", 30.0, 300.0, [30.0], 100),
        turn("truncated", 20.0, 200.0, [], 50),
        turn("failed", None, None, [], None),
    ]
    row = M.summarize_level(
        turns, label="x", concurrency=2, num_gpus=2, conversations=2, turns_not_sent=3, duration_s=10.0
    )
    assert row["tpot_mean_ms"] == pytest.approx(20.0)
    assert row["tok_s_user"] == pytest.approx(50.0)  # 1000 / mean TPOT, not mean of 1000/TPOT
    assert row["output_tok_s"] == pytest.approx(25.0)
    assert row["tok_s_gpu"] == pytest.approx(12.5)
    assert row["tok_min_gpu"] == pytest.approx(750.0)
    assert (row["turns_sent"], row["turns_ok"], row["turns_truncated"], row["turns_failed"]) == (4, 2, 1, 1)
    assert row["turns_not_sent"] == 3
    assert row["cache_hit_pct"] is None
    assert math.isclose(row["tok_s_user_p90"], 1000.0 / M.percentile([10.0, 30.0, 20.0], 90))


class _JumpyTokenizer:
    """Counts words; ids decode to words, every third id to two words, so prefix counts jump by two there."""

    name = "jumpy"

    async def decode(self, ids):
        return " ".join(f"w{i}" if i % 3 else f"w{i} v{i}" for i in ids)

    async def encode(self, text):
        return list(range(len(text.split())))

    async def count_chat(self, messages, add_generation_prompt=True):
        return 3 + sum(len(m["content"].split()) for m in messages)


def test_fit_chat_pads_when_no_prefix_fits_exactly():
    """The count jumps over the target between two prefixes (a BPE merge): the closest shorter prefix is padded
    with filler characters to the exact target instead of giving up one token short."""
    import asyncio

    from qwen4exp.bench.workload import fit_chat

    tok = _JumpyTokenizer()
    ids = list(range(1, 60))
    for target in range(8, 60):
        text, counted, n = asyncio.run(fit_chat(tok, [], ids, target, n_guess=target // 2))
        assert counted == target == asyncio.run(tok.count_chat([{"role": "user", "content": text}])), target
        assert text.startswith(asyncio.run(tok.decode(ids[:n])))
