"""``benchmarks/agent_ab_gpu.py`` without a GPU: the KV bytes a token read from a vLLM server log, and the two A/B
phases it asks for (the model folder, the context length, the sampling restriction, the pressure phase's KV size
from the free phase's default server), with the A/B runs themselves stubbed out."""

from __future__ import annotations

import json
import os

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def ab():
    return load_script("agent_ab_gpu")


def _log(path, gib: str, tokens: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("INFO [gpu_worker.py] Available KV cache memory: 9.00 GiB\n"  # an earlier start: the last one counts
                "INFO [kv_cache_utils.py] GPU KV cache size: 1,000 tokens\n"
                f"INFO [gpu_worker.py] Available KV cache memory: {gib} GiB\n"
                f"INFO [kv_cache_utils.py] GPU KV cache size: {tokens} tokens\n")


def test_kv_bytes_per_token(ab, tmp_path):
    log = tmp_path / "server.log"
    _log(str(log), "63.74", "9,990,740")
    assert ab.kv_bytes_per_token(str(log)) == pytest.approx(63.74 * 2**30 / 9_990_740)
    log.write_text("INFO [gpu_worker.py:668] Initial free memory 120.5 GiB, reserved 2.0 GiB memory for KV Cache as "
                   "specified by kv_cache_memory_bytes config and skipped memory profiling.\n"
                   "INFO [kv_cache_utils.py] GPU KV cache size: 160,000 tokens, ...\n")  # a fixed KV size
    assert ab.kv_bytes_per_token(str(log)) == pytest.approx(2 * 2**30 / 160_000)
    log.write_text("no KV lines here\n")
    assert ab.kv_bytes_per_token(str(log)) is None
    assert ab.kv_bytes_per_token(str(tmp_path / "missing.log")) is None


def test_phases_and_pressure_size(ab, tmp_path, monkeypatch):
    calls = []

    def run_ab(args, phase, model, model_len, extra_serve, body):
        calls.append(dict(phase=phase, model=model, model_len=model_len, extra=extra_serve, body=body))
        if phase == "free":  # what the free phase's default server would have logged
            _log(os.path.join(args.out, "free", "default", "server.log"), "10.00", "400,000")
        return 0

    monkeypatch.setattr(ab, "run_ab", run_ab)
    out = str(tmp_path / "out")
    assert ab.main(["--out", out, "--first-turn-tokens", "5000", "--turn-tokens", "300", "--turns", "3",
                    "--max-output-tokens", "64", "--concurrency", "2", "--pressure-factor", "1.5"]) == 0
    assert [c["phase"] for c in calls] == ["free", "pressure"]
    longest = 5000 + 2 * (300 + 64) + 64 + 256
    assert all(c["model_len"] == 1024 * -(-longest // 1024) == 6144 for c in calls)
    cfg = json.load(open(os.path.join(calls[0]["model"], "config.json")))
    assert cfg["num_hidden_layers"] == 12 and cfg["hidden_size"] == 2560  # FN-12L: the real widths, 12 layers
    ids = calls[0]["body"]["allowed_token_ids"]  # the tokenizer is much smaller than FN's vocabulary
    assert 0 < len(ids) <= 1000 and calls[1]["body"] == calls[0]["body"]
    assert calls[0]["extra"] == ""
    bpt = 10.0 * 2**30 / 400_000
    assert calls[1]["extra"] == f"--kv-cache-memory-bytes {int(bpt * 1.5 * 2 * longest)}"


def test_pressure_needs_the_free_log(ab, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ab, "run_ab", lambda *a: 0)
    assert ab.main(["--out", str(tmp_path), "--first-turn-tokens", "2000"]) == 1
    assert "pressure phase skipped" in capsys.readouterr().out
    assert ab.main(["--out", str(tmp_path), "--first-turn-tokens", "2000", "--no-pressure"]) == 0


def test_gpu_util_default_follows_the_card(ab, monkeypatch):
    import torch

    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    assert ab.default_gpu_util() == 0.88 and ab.gpu_name() == "H100 80GB HBM3"
    Props.total_memory = 141 * 2**30
    assert ab.default_gpu_util() == 0.7


def test_serve_args_with_and_without_mtp(ab, tmp_path):
    import shlex

    args = ab.main.__globals__["argparse"].Namespace(gpu_util=0.7, mtp=0, acceptance_length=3.23)
    plain = shlex.split(ab.serve_args(args, "/m", 53248, "--kv-cache-memory-bytes 5"))
    assert "--speculative-config" not in plain and plain[-2:] == ["--kv-cache-memory-bytes", "5"]
    args.mtp = 3
    mtp = shlex.split(ab.serve_args(args, "/m", 53248, ""))
    spec = json.loads(mtp[mtp.index("--speculative-config") + 1])
    assert spec == {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
                    "synthetic_acceptance_length": 3.23}
    assert mtp[:mtp.index("--speculative-config")] == plain[:-2]
    with pytest.raises(SystemExit):  # 5 tokens a step cannot come from 3 drafts
        ab.main(["--out", str(tmp_path), "--mtp", "3", "--acceptance-length", "5"])


def test_probe_reads_the_kv_lines_then_stops_the_server(ab, tmp_path):
    import sys
    import time

    log = str(tmp_path / "server.log")
    fake = ("import sys, time\n"
            "print('INFO [gpu_worker.py] Initial free memory 9.1 GiB, reserved 2.00 GiB memory for KV Cache', "
            "flush=True)\n"
            "time.sleep(0.5)\n"
            "print('INFO [kv_cache_utils.py] GPU KV cache size: 160,000 tokens', flush=True)\n"
            "time.sleep(600)\n")  # a server that would run on: the probe stops it
    t0 = time.monotonic()
    assert ab.probe_bytes_per_token([sys.executable, "-c", fake], log, 60) == pytest.approx(2 * 2**30 / 160_000)
    assert time.monotonic() - t0 < 45
    assert ab.probe_bytes_per_token([sys.executable, "-c", "print('no KV lines')"], log, 60) is None  # exited


def test_pressure_phase_alone_sizes_its_cache_from_a_probe(ab, tmp_path, monkeypatch):
    calls, probes = [], []
    monkeypatch.setattr(ab, "run_ab", lambda args, phase, model, model_len, extra, body: calls.append((phase, extra))
                        or 0)
    monkeypatch.setattr(ab, "probe_bytes_per_token", lambda cmd, log, timeout, env=None: probes.append(cmd) or 1000.0)
    out = str(tmp_path / "out")
    assert ab.main(["--out", out, "--phases", "pressure", "--first-turn-tokens", "5000", "--turn-tokens", "300",
                    "--turns", "3", "--max-output-tokens", "64", "--concurrency", "2"]) == 0
    longest = 5000 + 2 * (300 + 64) + 64 + 256
    assert calls == [("pressure", f"--kv-cache-memory-bytes {int(1000.0 * 1.5 * 2 * longest)}")]
    (cmd,) = probes
    assert cmd[1:3] == ["-m", "qwen4exp.serve"] and f"--kv-cache-memory-bytes {ab.PROBE_KV_BYTES}" in " ".join(cmd)
    calls.clear()  # --bytes-per-token given: no probe
    assert ab.main(["--out", out, "--phases", "pressure", "--bytes-per-token", "500"]) == 0
    assert len(probes) == 1 and calls[0][0] == "pressure"


def test_several_pressure_factors_run_one_phase_each(ab, tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(ab, "run_ab", lambda args, phase, model, model_len, extra, body: calls.append((phase, extra))
                        or (3 if phase == "pressure-x1.2" else 0))
    out = str(tmp_path / "out")
    rc = ab.main(["--out", out, "--phases", "pressure", "--bytes-per-token", "1000", "--first-turn-tokens", "5000",
                  "--turn-tokens", "300", "--turns", "3", "--max-output-tokens", "64", "--concurrency", "2",
                  "--pressure-factor", "1.5,1.2,1"])
    longest = 5000 + 2 * (300 + 64) + 64 + 256
    assert calls == [(p, f"--kv-cache-memory-bytes {int(1000.0 * f * 2 * longest)}")
                     for p, f in (("pressure", 1.5), ("pressure-x1.2", 1.2), ("pressure-x1", 1.0))]
    assert rc == 3  # a failed phase is not hidden by a later one that passed
    for bad in ("1.5,x", "0", ""):
        with pytest.raises(SystemExit):
            ab.main(["--out", out, "--phases", "pressure", "--pressure-factor", bad])
    assert "--pressure-factor" in capsys.readouterr().err


def test_variants_are_the_agent_server_with_one_thing_changed(ab, tmp_path, monkeypatch):
    import shlex

    from qwen4exp.bench.ab import split_env

    seen = []

    class Proc:
        pid = 0

        def __init__(self, cmd, **kw):
            seen.append(cmd)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(ab.subprocess, "Popen", Proc)
    args = ab.main.__globals__["argparse"].Namespace(
        gpu_util=0.7, mtp=0, acceptance_length=3.23, configs="default,agent,nocap,notok,short,nopause", out=str(tmp_path),
        first_turn_tokens=5000, turn_tokens=300, turns="3", max_output_tokens=64, concurrency=2, conversations=4,
        think_time="0", start_timeout=10.0, phase_timeout=10.0)
    assert ab.run_ab(args, "free", "/m", 6144, "", None) == 0
    (cmd,) = seen
    specs = dict(cmd[i + 1].split("=", 1) for i, x in enumerate(cmd) if x == "--ab")
    assert list(specs) == ["default", "agent", "nocap", "notok", "short", "nopause"]
    env, words = split_env(specs["nocap"])
    assert env == {"QWEN4EXP_CONTINUATION_CHUNK": "0"} and words == shlex.split(specs["agent"])
    env, words = split_env(specs["notok"])
    assert env == {"QWEN4EXP_TOKENIZE_CACHE_TOKENS": "0"} and words == shlex.split(specs["agent"])
    env, words = split_env(specs["nopause"])
    assert env == {"QWEN4EXP_PAUSE_CHUNK": "0"} and words == shlex.split(specs["agent"])
    env, words = split_env(specs["short"])
    assert env == {} and words == shlex.split(specs["agent"]) + ["--max-num-batched-tokens", "4096"]
    assert "--max-num-batched-tokens 16384" in specs["short"]  # (vLLM's parser takes the last of a repeated flag)
    assert split_env(specs["agent"])[0] == {} and ab.AGENT in specs["agent"] and ab.AGENT not in specs["default"]
    for bad in ("default,agent,x", "agent,agent", ""):
        with pytest.raises(SystemExit):
            ab.main(["--out", str(tmp_path), "--configs", bad])
