"""``qwen4exp-bench`` sessions, tool pauses, cached fraction and the A/B mode (issue 27, item 6).

Everything here runs against the fake server (``fake_openai_server.py``); its ``--request-log`` shows what the
bench sent (the ``X-Session-ID`` header, ``vllm_xargs``), its ``/metrics`` the preemption and computed-token
counters. The A/B tests use the fake server script as ``--serve-cmd``.
"""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from qwen4exp.bench import ab as AB
from qwen4exp.bench import cli
from qwen4exp.bench import metrics as M
from qwen4exp.bench import plot as P
from qwen4exp.bench.think import ThinkTime, parse_think_time

sys.path.insert(0, str(Path(__file__).parent))
from bench_support import FAKE, OUT, TURNS, bench, check_png, fake_factory, mini_argv, num, run_cli  # noqa: E402,F401


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def by_session(entries: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for e in sorted(entries, key=lambda e: e["n"]):
        out.setdefault(e["x_session_id"], []).append(e)
    return out


def bench_turns(run) -> list[dict[str, Any]]:
    return [r for r in run.turns if r["phase"] == "bench"]


def conversations(recs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        out.setdefault(r["conversation"], []).append(r)
    for v in out.values():
        v.sort(key=lambda r: r["turn"])
    return out


# ---------------------------------------------------------------------------
# sessions


def test_session_id_on_every_turn_and_close_on_the_last(fake_factory, tmp_path):
    log = tmp_path / "requests.jsonl"
    srv = fake_factory("--request-log", str(log))
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        run = bench(mini_argv(srv, out, "--extra-body", '{"vllm_xargs": {"keep": 1}}'), out)
        assert run.rc == 0, run.stderr
        runs.append(run)
    entries = read_log(log)
    assert entries and all(e["x_session_id"] for e in entries), "a turn went out without X-Session-ID"
    sessions = by_session(entries)
    # 1 warm-up + 4 + 4 conversations per run, each with its own id; two runs never share one
    assert len(sessions) == 2 * (1 + 4 + 4)
    for sid, reqs in sessions.items():
        # one id is one conversation: its TURNS requests, the history growing by reply + tool output each turn
        assert [e["messages"] for e in reqs] == [1 + 2 * k for k in range(TURNS)], sid
        # session_close on the last turn only, merged with the vllm_xargs of --extra-body
        assert [e["vllm_xargs"] for e in reqs] == [{"keep": 1}] * (TURNS - 1) + [{"keep": 1, "session_close": True}]
    # turns.jsonl names the same ids, one per conversation
    for run in runs:
        for conv, recs in conversations(run.turns).items():
            ids = {r["session_id"] for r in recs}
            assert len(ids) == 1 and ids.pop() in sessions, conv
            assert [r["session_close"] for r in recs] == [False] * (TURNS - 1) + [True]
    ids0 = {r["session_id"] for r in runs[0].turns}
    ids1 = {r["session_id"] for r in runs[1].turns}
    assert ids0.isdisjoint(ids1)


def test_no_session_id_and_no_session_close(fake_factory, tmp_path):
    log = tmp_path / "requests.jsonl"
    srv = fake_factory("--request-log", str(log))
    out = tmp_path / "off"
    run = bench(mini_argv(srv, out, "--no-session-id", "--no-session-close"), out)
    assert run.rc == 0, run.stderr
    entries = read_log(log)
    assert len(entries) == len(run.turns) > 0
    assert all(e["x_session_id"] is None and e["session_id"] is None and e["vllm_xargs"] is None for e in entries)
    assert all(r["session_id"] is None and not r["session_close"] for r in run.turns)

    log.unlink()
    out = tmp_path / "id-only"
    run = bench(mini_argv(srv, out, "--no-session-close"), out)
    entries = read_log(log)
    assert all(e["x_session_id"] for e in entries) and all(e["vllm_xargs"] is None for e in entries)


# ---------------------------------------------------------------------------
# --think-time


def test_think_time_parsing():
    assert parse_think_time("0") == ThinkTime("const", 0.0) and parse_think_time("0").zero
    assert parse_think_time("2.5") == ThinkTime("const", 2.5)
    assert parse_think_time("lognormal:0.5,1") == ThinkTime("lognormal", 0.5, 1.0, None)
    assert parse_think_time("lognormal:0.5,1,5") == ThinkTime("lognormal", 0.5, 1.0, 5.0)
    assert parse_think_time("uniform:1,3") == ThinkTime("uniform", 1.0, 3.0)
    rng = random.Random(1)
    logn = [parse_think_time("lognormal:0.5,1,5").sample(rng) for _ in range(4000)]
    assert max(logn) == 5.0 and min(logn) > 0  # clipped at MAX (sigma 1: some draws exceed 10 x median)
    assert 0.4 < sorted(logn)[len(logn) // 2] < 0.6  # the median is MEDIAN
    uni = [parse_think_time("uniform:1,3").sample(rng) for _ in range(1000)]
    assert 1 <= min(uni) < 1.1 and 2.9 < max(uni) <= 3
    assert parse_think_time("2.5").sample(rng) == 2.5


@pytest.mark.parametrize("bad", ["-1", "abc", "lognormal:1", "lognormal:0,1", "lognormal:1,-1", "lognormal:1,1,0",
                                 "uniform:3,1", "uniform:1", "gauss:1,2", "nan", "uniform:a,b"])
def test_bad_think_time_is_an_error_naming_the_flag(bad):
    with pytest.raises(ValueError):
        parse_think_time(bad)
    rc, _, err, _ = run_cli(["--think-time", bad], timeout=30)
    assert rc == 2 and "--think-time" in err, (bad, err)


def test_think_time_pauses_between_turns_outside_ttft(fake_factory, tmp_path):
    think = 0.4
    log = tmp_path / "requests.jsonl"
    srv = fake_factory("--request-log", str(log))
    out = tmp_path / "think"
    run = bench(mini_argv(srv, out, "--think-time", str(think), "--concurrency", "2", "--conversations", "2",
                          "--warmup", "0"), out)
    assert run.rc == 0, run.stderr
    recs = bench_turns(run)
    for conv in conversations(recs).values():
        assert conv[0]["think_s"] is None
        for prev, cur in zip(conv, conv[1:]):
            assert cur["think_s"] == think
            # the pause sits between the reply and the next send ...
            assert cur["start_s"] - prev["end_s"] >= think
            # ... and in no request's timing, nor in the client's preparation time
            assert cur["ttft_ms"] < cur["latency_ms"] < think * 1000
            assert cur["prep_ms"] < think * 1000
    # the server saw the pause too: a conversation's next request arrives >= think after the previous one
    for reqs in by_session(read_log(log)).values():
        assert all(b["t"] - a["t"] >= think for a, b in zip(reqs, reqs[1:]))
    row = run.rows[0]
    assert num(row["think_s_mean"]) == pytest.approx(think)
    assert num(row["ttft_later_p99_ms"]) < think * 1000
    assert json.loads((out / "summary.json").read_text())["think_time"] == f"{think:g}"


def test_think_time_draws_are_seeded_per_conversation(fake_factory, tmp_path):
    srv = fake_factory()

    def draws(seed: str, name: str) -> dict[tuple[str, int], float]:
        out = tmp_path / name
        run = bench(mini_argv(srv, out, "--think-time", "lognormal:0.02,1,0.08", "--seed", seed, "--warmup", "0",
                              "--concurrency", "2", "--conversations", "3"), out)
        assert run.rc == 0, run.stderr
        return {(r["conversation"], r["turn"]): r["think_s"] for r in bench_turns(run) if r["turn"] > 1}

    a, b, c = draws("11", "a"), draws("11", "b"), draws("12", "c")
    assert len(a) == 3 * (TURNS - 1) and all(0 < v <= 0.08 for v in a.values())
    assert a == b  # same seed, same pauses, whatever the interleaving
    assert a != c


# ---------------------------------------------------------------------------
# cached fraction, turn-1 vs later TTFT, preemptions, recomputed tokens


def test_cached_fraction_from_reported_usage(fake_factory, tmp_path):
    srv = fake_factory("--usage-details", "--block-size", "16")
    out = tmp_path / "cached"
    run = bench(mini_argv(srv, out), out)
    assert run.rc == 0, run.stderr
    recs = bench_turns(run)
    for conv in conversations(recs).values():
        assert conv[0]["cached_fraction"] is None
        for prev, cur in zip(conv, conv[1:]):
            processed = prev["prompt_tokens"] + prev["completion_tokens"]
            assert cur["cached_fraction"] == pytest.approx(cur["cached_tokens"] / processed)
            # the fake caches the previous prompt + reply in 16-token blocks: all but a partial block is found
            assert processed - 16 < cur["cached_tokens"] <= processed
    for row in run.rows:
        c = int(row["concurrency"])
        level = [r for r in recs if r["concurrency"] == c]
        fracs = [r["cached_fraction"] for r in level if r["turn"] >= 2]
        assert num(row["cached_fraction_mean"]) == pytest.approx(sum(fracs) / len(fracs), rel=1e-3)
        t1 = sorted(r["ttft_ms"] for r in level if r["turn"] == 1)
        later = sorted(r["ttft_ms"] for r in level if r["turn"] >= 2)
        assert num(row["ttft_turn1_p50_ms"]) == pytest.approx(M.percentile(t1, 50), rel=1e-3)
        assert num(row["ttft_later_p99_ms"]) == pytest.approx(M.percentile(later, 99), rel=1e-3)
        # /metrics: what the server computed = prompt tokens not found in the cache, over exactly this level
        assert num(row["recomputed_tokens"]) == sum(r["prompt_tokens"] - r["cached_tokens"] for r in level)
        assert num(row["preemptions"]) == 0
        # the fake's server-side times: no queue, prefill = its sleep (5 ms + uncached tokens at 200,000 a second)
        sleeps = [5.0 + (r["prompt_tokens"] - r["cached_tokens"]) / 200.0 for r in level]
        assert num(row["queue_mean_ms"]) == 0
        assert num(row["prefill_mean_ms"]) == pytest.approx(sum(sleeps) / len(sleeps), rel=1e-3)
        assert num(row["render_mean_ms"]) == pytest.approx(1.0, abs=0.01)  # the fake's server TTFT: prefill + 1 ms
        # the client's TTFT holds the server's and the HTTP round trip besides
        assert 0 < num(row["frontend_mean_ms"]) < num(row["ttft_mean_ms"])
        assert num(row["frontend_mean_ms"]) == pytest.approx(
            num(row["ttft_mean_ms"]) - num(row["prefill_mean_ms"]) - 1.0, abs=0.01)


def test_cached_fraction_blank_without_usage_details(fake_factory, tmp_path):
    srv = fake_factory()
    out = tmp_path / "nodetails"
    run = bench(mini_argv(srv, out, "--metrics-url", "none"), out)
    assert run.rc == 0, run.stderr
    assert all(r["cached_fraction"] is None for r in run.turns)
    for row in run.rows:
        assert row["cached_fraction_mean"] == "" and row["preemptions"] == "" and row["recomputed_tokens"] == ""
        assert row["queue_mean_ms"] == row["prefill_mean_ms"] == row["render_mean_ms"] == row["frontend_mean_ms"] == ""
        assert num(row["ttft_turn1_p50_ms"]) > 0 and num(row["ttft_later_p50_ms"]) > 0


def test_server_metrics_preemptions_and_recomputed_tokens():
    text0 = ('vllm:num_preemptions_total{engine="0"} 2\nvllm:num_preemptions_total{engine="1"} 1\n'
             'vllm:request_prefill_kv_computed_tokens_sum{engine="0"} 100\n'
             'vllm:request_prefill_kv_computed_tokens_count{engine="0"} 3\n')
    text1 = text0.replace(" 2\n", " 7\n").replace(" 100\n", " 350\n")
    sm = M.server_metrics(M.parse_prometheus(text0), M.parse_prometheus(text1))
    assert sm["preemptions"] == 5 and sm["recomputed_tokens"] == 250
    sm = M.server_metrics({}, M.parse_prometheus("vllm:prefix_cache_hits_total 1\n"))
    assert sm["preemptions"] is None and sm["recomputed_tokens"] is None
    hist = ('vllm:request_queue_time_seconds_sum{engine="0"} 0.5\nvllm:request_queue_time_seconds_count{engine="0"} 2\n'
            'vllm:request_queue_time_seconds_sum{engine="1"} 0.25\nvllm:request_queue_time_seconds_count{engine="1"} 1\n')
    before = M.parse_prometheus(hist)
    after = M.parse_prometheus(hist.replace("} 0.5\n", "} 1.7\n").replace("} 2\n", "} 5\n"))
    sm = M.server_metrics(before, after)
    assert sm["queue_ms"] == pytest.approx(400.0)  # 1.2 s over 3 more requests, both engines summed
    assert sm["prefill_ms"] is None and sm["server_ttft_ms"] is None
    assert M.server_metrics(before, before)["queue_ms"] is None  # nothing observed over the level
    # AgentScheduler's counters over the level, labels summed; its gauges left out
    agent0 = ('qwen4exp:capped_steps_total{engine="0"} 4\nqwen4exp:retained_blocks{engine="0"} 9\n'
              'qwen4exp:retention_evictions_total{reason="ttl"} 1\nqwen4exp:retention_evictions_total{reason="pressure"} 0\n')
    agent1 = agent0.replace("} 4\n", "} 10\n").replace("} 9\n", "} 3\n").replace('"pressure"} 0', '"pressure"} 2')
    sm = M.server_metrics(M.parse_prometheus(agent0), M.parse_prometheus(agent1))
    assert sm["qwen4exp_counters"] == {"qwen4exp:capped_steps": 6, "qwen4exp:retention_evictions": 2}
    assert M.server_metrics(None, M.parse_prometheus(text0))["qwen4exp_counters"] == {}
    assert M.cached_fraction(90, 80, 20) == 0.9 and M.cached_fraction(None, 80, 20) is None
    assert M.cached_fraction(5, 0, 0) is None


def test_bench_reads_every_agent_scheduler_counter():
    """The bench (which does not import vLLM) names the counters qwen4exp.serving.metrics exports."""
    from qwen4exp.serving import metrics as served

    assert M.AGENT_COUNTERS == {"qwen4exp:" + name for name in served.COUNTERS}


# ---------------------------------------------------------------------------
# --ab


def ab_argv(out: Path, *configs: str, extra: tuple[str, ...] = ()) -> list[str]:
    argv = [
        "--serve-cmd", f"{sys.executable} {FAKE} --usage-details",
        "--first-turn-tokens", "200", "--turn-tokens", "20", "--turns", str(TURNS),
        "--max-output-tokens", str(OUT), "--concurrency", "1,2", "--warmup", "0", "--seed", "5",
        "--no-progress", "--ab-stop-timeout", "5", "--out", str(out),
    ]  # fmt: skip
    for c in configs:
        argv += ["--ab", c]
    return argv + list(extra)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def pid_gone(pid: int) -> bool:
    """True if the process is gone; a process still there is killed (no test leaves a server behind)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return False


def test_ab_runs_each_config_and_writes_one_table(tmp_path):
    out = tmp_path / "ab"
    rc, so, se, _ = run_cli(ab_argv(out, "fast=--ttft 0.001", f"slow=--ttft 0.06 --request-log {tmp_path}/slow.log"),
                            timeout=120)
    assert rc == 0, se
    rows = read_csv(out / "ab.csv")
    with (out / "ab.csv").open() as f:
        assert next(csv.reader(f)) == AB.AB_COLUMNS
    assert [(r["config"], r["concurrency"]) for r in rows] == [("fast", "1"), ("fast", "2"), ("slow", "1"),
                                                               ("slow", "2")]
    for name in ("fast", "slow"):
        summary = read_csv(out / name / "summary.csv")
        mine = [r for r in rows if r["config"] == name]
        assert all(s["label"] == name for s in summary)
        for r, s in zip(mine, summary, strict=True):
            for col in AB.AB_COLUMNS[1:]:
                assert r[col] == s[col], (name, col)
        assert "READY" in (out / name / "server.log").read_text()
        assert 0.9 < num(mine[0]["cached_fraction_mean"]) <= 1
    # the slow server's extra 60 ms of prefill shows in its row, not the other's
    fast = {r["concurrency"]: num(r["ttft_later_p50_ms"]) for r in rows if r["config"] == "fast"}
    slow = {r["concurrency"]: num(r["ttft_later_p50_ms"]) for r in rows if r["config"] == "slow"}
    assert all(slow[c] > fast[c] + 40 for c in fast)
    # the same conversations on both servers: same prompts, same session ids (one run nonce)
    tf = {(r["conversation"], r["turn"]): (r["prompt_tokens"], r["session_id"])
          for r in (json.loads(x) for x in (out / "fast" / "turns.jsonl").read_text().splitlines())}
    ts = {(r["conversation"], r["turn"]): (r["prompt_tokens"], r["session_id"])
          for r in (json.loads(x) for x in (out / "slow" / "turns.jsonl").read_text().splitlines())}
    assert tf == ts and len(tf) == (4 + 4) * TURNS
    assert len(read_log(tmp_path / "slow.log")) == len(ts)  # the slow config's args reached its server only
    # the printed table and the plot
    assert "TTFT t>=2 p50" in so and "fast" in so and "slow" in so
    check_png(out / "ab.png")
    assert P.png_texts(out / "ab.png")["Legend"] == "fast\nslow"
    # both servers were stopped
    doc = json.loads((out / "ab.json").read_text())
    assert [c["name"] for c in doc["configs"]] == ["fast", "slow"]
    for c in doc["configs"]:
        assert c["status"] == "ran" and c["server_rc"] is not None and pid_gone(c["pid"])
        assert c["cmd"][-4:] == ["--host", "127.0.0.1", "--port", str(c["port"])]


@pytest.mark.parametrize("second", ["exits=--no-such-flag", "hangs=--start-delay 120"])
def test_ab_second_server_failing_to_start_stops_both(tmp_path, second):
    out = tmp_path / "ab"
    rc, _, se, dt = run_cli(ab_argv(out, "ok=", second, extra=("--ab-start-timeout", "3")), timeout=90)
    name = second.split("=")[0]
    assert rc == cli.EXIT_TURNS_FAILED, se  # the first config's results are there; the second did not run
    assert f"configuration {name}: failed to start" in se
    doc = json.loads((out / "ab.json").read_text())
    first, bad = doc["configs"]
    assert first["status"] == "ran" and bad["status"] == "failed to start"
    assert ("exited with status 2" if name == "exits" else "did not answer") in bad["error"]
    assert first["pid"] and bad["pid"] and pid_gone(first["pid"]) and pid_gone(bad["pid"])
    rows = read_csv(out / "ab.csv")
    assert {r["config"] for r in rows} == {"ok"} and len(rows) == 2
    assert dt < 60


def test_ab_interrupt_stops_the_server(tmp_path, monkeypatch):
    started: list[int] = []

    def interrupted_run(args, log=None):
        started.append(args.base_url)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_one", interrupted_run)
    out = tmp_path / "ab"
    rc, _, _, _ = run_cli(ab_argv(out, "a=", "b="), timeout=60)
    assert rc == cli.EXIT_SETUP  # nothing ran to the end
    doc = json.loads((out / "ab.json").read_text())
    assert doc["interrupted"] is True and len(started) == 1
    assert [c["name"] for c in doc["configs"]] == ["a"]  # b never started
    assert doc["configs"][0]["status"] == "interrupted" and pid_gone(doc["configs"][0]["pid"])


def test_ab_leading_assignments_set_that_servers_environment(tmp_path):
    assert AB.split_env("A_1=x B='y z' model --flag C=3") == ({"A_1": "x", "B": "y z"}, ["model", "--flag", "C=3"])
    assert AB.split_env("") == ({}, []) and AB.split_env("1A=x m") == ({}, ["1A=x", "m"])
    out = tmp_path / "ab"
    rc, _, se, _ = run_cli(ab_argv(out, "off=QWEN4EXP_CONTINUATION_CHUNK=0 --ttft 0.001", "on=--ttft 0.001"),
                           timeout=120)
    assert rc == 0, se
    env_lines = {n: [x for x in (out / n / "server.log").read_text().splitlines() if x.startswith("ENV ")]
                 for n in ("off", "on")}
    assert "ENV QWEN4EXP_CONTINUATION_CHUNK=0" in env_lines["off"]
    assert not any("QWEN4EXP_CONTINUATION_CHUNK" in x for x in env_lines["on"])  # only its own config's server
    doc = json.loads((out / "ab.json").read_text())
    assert [c["env"] for c in doc["configs"]] == [{"QWEN4EXP_CONTINUATION_CHUNK": "0"}, {}]
    assert "--ttft" == doc["configs"][0]["cmd"][-6]  # the assignment is not passed on as an argument
    assert "off: starting QWEN4EXP_CONTINUATION_CHUNK=0 " in se


def test_ab_needs_two_distinct_names(tmp_path):
    rc, _, err, _ = run_cli(ab_argv(tmp_path, "a="), timeout=30)
    assert rc == 2 and "two or more" in err
    rc, _, err, _ = run_cli(ab_argv(tmp_path, "a=", "a=--ttft 0"), timeout=30)
    assert rc == 2 and "must differ" in err
    rc, _, err, _ = run_cli(["--ab", "no name"], timeout=30)
    assert rc == 2 and "--ab" in err


# ---------------------------------------------------------------------------
# --ab ports


def test_ab_port_parsing():
    assert AB.pop_port(["m", "--port", "8101", "--x"]) == (8101, ["m", "--x"])
    assert AB.pop_port(["m", "--port=8101", "--port", "8102"]) == (8102, ["m"])  # the last one, as vLLM's parser
    assert AB.pop_port(["m", "--portable"]) == (None, ["m", "--portable"])
    for bad in (["--port", "x"], ["--port"], ["--port=0"], ["--port", "70000"]):
        with pytest.raises(ValueError, match="--port needs a port number"):
            AB.pop_port(bad)
    args = cli.build_parser().parse_args(["--ab-ports", "8101, 0"])
    assert args.ab_ports == [8101, 0]
    for bad in ("8101,x", "70000", "-1", ""):
        rc, _, err, _ = run_cli(["--ab-ports", bad], timeout=30)
        assert rc == 2 and "--ab-ports" in err, bad


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_ab_ports_pin_each_server(tmp_path):
    p1, p2 = free_ports(2)
    out = tmp_path / "ab"
    # one pinned by --ab-ports, one by a --port in its ARGS (0 in --ab-ports leaves it to the ARGS)
    rc, _, se, _ = run_cli(ab_argv(out, "a=--ttft 0.001", f"b=--port {p2} --ttft 0.001",
                                   extra=("--ab-ports", f"{p1},0")), timeout=120)
    assert rc == 0, se
    doc = json.loads((out / "ab.json").read_text())
    for c, p in zip(doc["configs"], (p1, p2), strict=True):
        assert c["port"] == p and c["cmd"][-4:] == ["--host", "127.0.0.1", "--port", str(p)]
        assert c["cmd"].count("--port") == 1  # ARGS' own --port is not passed on twice
        assert f"READY {p}" in (out / c["name"] / "server.log").read_text()  # the server listened there
    assert "up in" in se and f"on port {p1}" in se


def test_ab_taken_port_stops_before_any_server_starts(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = tmp_path / "ab"
        rc, _, se, dt = run_cli(ab_argv(out, "a=", "b=", extra=("--ab-ports", f"0,{port}")), timeout=30)
    assert rc == cli.EXIT_SETUP
    (line,) = se.strip().splitlines()
    assert f"--ab b: port {port} is taken on 127.0.0.1" in line and "--ab-ports" in line
    assert not (out / "a").exists()  # nothing started
    assert dt < 10


@pytest.mark.parametrize("configs,ports,msg", [
    (("a=--port 1234", "b="), "1235,0", "its ARGS say --port 1234 but --ab-ports gives it 1235"),
    (("a=", "b="), "1234", "--ab-ports lists 1 port(s) for 2 --ab configuration(s)"),
    (("a=--port=x", "b="), None, "--ab a: --port needs a port number"),
    (("a=--max-model-len 100", "b="), None, "but --ab a's --max-model-len is 100: lower --first-turn-tokens"),
], ids=["ports-disagree", "ports-count", "bad-port", "short-context"])
def test_ab_bad_ports_and_short_contexts_are_refused_before_starting(tmp_path, configs, ports, msg):
    out = tmp_path / "ab"
    rc, _, se, _ = run_cli(ab_argv(out, *configs, extra=("--ab-ports", ports) if ports else ()), timeout=30)
    assert rc == cli.EXIT_SETUP and msg in se, se
    assert not (out / "a").exists()


def test_ab_port_taken_after_the_first_server_fails_that_config_only(tmp_path, monkeypatch):
    p1, p2 = free_ports(2)
    calls: list[int] = []

    def taken(port, host="127.0.0.1"):
        calls.append(port)
        return "[Errno 98] Address already in use" if calls.count(p2) > 1 else None  # free at the first check

    monkeypatch.setattr(AB, "port_taken", taken)
    out = tmp_path / "ab"
    rc, _, se, _ = run_cli(ab_argv(out, "a=--ttft 0.001", "b=", extra=("--ab-ports", f"{p1},{p2}")), timeout=120)
    assert rc == cli.EXIT_TURNS_FAILED
    a, b = json.loads((out / "ab.json").read_text())["configs"]
    assert a["status"] == "ran" and b["status"] == "failed to start" and b["pid"] is None
    assert f"port {p2} is taken" in b["error"] and f"configuration b: failed to start: port {p2}" in se
