"""``benchmarks/agentic_gpu.py``: the combined table from the bench's summary.csv files (fast), and the whole script on
CPU with the embedded tiny-coder checkpoint behind our plugin's server (``--preset tiny --impls ours``, a miniature
workload at concurrency 1 and 8)."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest
from script_loader import load_script
from test_bench import _write_csv

from qwen4exp.bench import metrics as M
from qwen4exp.demo import stop_server

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "agentic_gpu.py"


@pytest.fixture(scope="module")
def agentic():
    return load_script("agentic_gpu")


def _summary_rows(ttft: float) -> list[dict[str, str]]:
    rows = []
    for c in (1, 8):
        r = {k: "" for k in M.SUMMARY_COLUMNS}
        r.update(concurrency=str(c), num_gpus="1", conversations=str(max(4, 2 * c)), turns_sent="12", turns_ok="12",
                 tok_s_user=str(100.0 / c), tok_s_gpu=str(20.0 * c), output_tok_s=str(20.0 * c),
                 total_tok_s=str(900.0 * c), ttft_p50_ms=str(ttft * c), tpot_mean_ms=str(10.0 * c),
                 itl_p50_ms=str(9.5 * c), cache_hit_pct="")
        rows.append(r)
    return rows


def test_table_and_ratios_from_two_summaries(agentic, tmp_path):
    up, ours = tmp_path / "upstream.csv", tmp_path / "ours.csv"
    _write_csv(up, _summary_rows(ttft=50.0), "upstream", 1.0)
    _write_csv(ours, _summary_rows(ttft=100.0), "ours", 0.25)  # a quarter of upstream's per-user rate
    rows = agentic.combine([
        dict(label="upstream", gpu="0", summary=str(up), startup_s=180.0, error=""),
        dict(label="ours", gpu="1", summary=str(ours), startup_s=95.5, error=""),
    ])
    assert [(r["label"], r["concurrency"]) for r in rows] == [
        ("upstream", "1"), ("upstream", "8"), ("ours", "1"), ("ours", "8"), ("ours/upstream", "1"),
        ("ours/upstream", "8")]
    assert rows[0]["gpu"] == "0" and rows[0]["startup_s"] == "180.0" and rows[2]["startup_s"] == "95.5"
    assert rows[3]["tok_s_user"] == "3.125" and rows[3]["turns_ok"] == "12"  # the bench's values, as written
    for ratio in rows[4:]:
        assert float(ratio["tok_s_user"]) == pytest.approx(0.25)
        assert float(ratio["ttft_p50_ms"]) == pytest.approx(2.0)
        for k in ("output_tok_s", "total_tok_s", "tpot_mean_ms", "itl_p50_ms"):
            assert float(ratio[k]) == pytest.approx(1.0), k
        assert ratio["turns_ok"] == "" and ratio["cache_hit_pct"] == ""
    path = tmp_path / "agentic.csv"
    agentic.write_csv(rows, str(path))
    with path.open(newline="") as f:
        back = list(csv.DictReader(f))
    assert list(back[0]) == agentic.COLUMNS and len(back) == 6
    md = agentic.markdown(rows)
    assert md.count("\n") == 7 and "| ours/upstream | - | 8 |" in md and "| 0.25 |" in md


def test_a_failed_server_keeps_the_other_and_says_why(agentic, tmp_path):
    ours = tmp_path / "ours.csv"
    _write_csv(ours, _summary_rows(ttft=100.0), "ours", 1.0)
    rows = agentic.combine([
        dict(label="upstream", gpu="0", summary=str(tmp_path / "missing.csv"), startup_s=None,
             error="server did not start: server exited with code 1 during start-up (ValueError: no)"),
        dict(label="ours", gpu="1", summary=str(ours), startup_s=90.0, error=""),
    ])
    assert [(r["label"], r["concurrency"]) for r in rows] == [("upstream", ""), ("ours", "1"), ("ours", "8")]
    assert "ValueError: no" in rows[0]["error"]
    assert "* upstream: server did not start" in agentic.markdown(rows)


def test_fn_model_dir_has_the_fn12l_config_and_a_chat_tokenizer(agentic, tmp_path):
    import json

    from qwen4exp import presets

    path = agentic.build_model_dir(str(tmp_path), "fn", 12, 10240)
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 12 and cfg["hidden_size"] == presets.fn12l().hidden_size
    tc = json.loads((Path(path) / "tokenizer_config.json").read_text())
    assert "chat_template" in tc and tc["model_max_length"] >= 10240
    assert not (Path(path) / "model.safetensors").exists()
    ids = agentic.allowed_ids(path)
    assert 500 < len(ids) <= 1000 and min(ids) > 2 and max(ids) < 2048  # no special tokens, all decodable
    assert agentic.allowed_ids(agentic.ASSET) is None  # tiny-coder's tokenizer covers its vocabulary


@pytest.mark.vllm
def test_end_to_end_on_cpu(tmp_path):
    out, log = tmp_path / "agentic", tmp_path / "agentic.log"
    cmd = [sys.executable, str(SCRIPT), "--preset", "tiny", "--impls", "ours", "--out", str(out),
           "--first-turn-tokens", "128", "--turn-tokens", "16", "--turns", "2", "--max-output-tokens", "8",
           "--conversations", "1,8", "--warmup", "0", "--timeout", "240"]
    t0 = time.monotonic()
    with log.open("w") as f:  # a file, not a pipe: nothing the servers inherit can hold the test up
        p = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        rc = p.wait(timeout=300)
    finally:
        stop_server(p, timeout=40)  # SIGTERM: the script stops its servers itself
    text = log.read_text()
    print(f"agentic_gpu: {time.monotonic() - t0:.0f} s\n{text[-3000:]}")
    assert rc == 0, text[-4000:]
    with (out / "agentic.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["label"] == "ours"]
    assert sorted(r["concurrency"] for r in rows) == ["1", "8"]
    for r in rows:
        assert int(r["turns_ok"]) > 0 and float(r["tok_s_user"]) > 0 and float(r["ttft_p50_ms"]) > 0, r
        assert r["error"] == "", r
    assert "| ours | - | 8 |" in text
    assert (out / "ours" / "summary.csv").is_file() and (out / "ours" / "server.log").is_file()
