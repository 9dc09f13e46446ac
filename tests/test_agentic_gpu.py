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
from bench_support import write_csv

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
    write_csv(up, _summary_rows(ttft=50.0), "upstream", 1.0)
    write_csv(ours, _summary_rows(ttft=100.0), "ours", 0.25)  # a quarter of upstream's per-user rate
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
    write_csv(ours, _summary_rows(ttft=100.0), "ours", 1.0)
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


def test_replies_from_the_allowed_ids_re_tokenize_to_themselves(agentic, tmp_path):
    """The next turn resends a reply as text: the chat template's turn N+1 must start with turn N's prompt and the
    reply's own ids, or no scheduler can find turn N's output cached. Arbitrary clean tokens fail that (merges across
    token boundaries); the allowed ids must not."""
    import random

    from transformers import AutoTokenizer

    path = agentic.build_model_dir(str(tmp_path), "fn", 4, 4096)
    tok = AutoTokenizer.from_pretrained(path)
    ids = agentic.allowed_ids(path)
    rng = random.Random(0)
    user = [{"role": "user", "content": "Fix the failing test in utils.py."}]

    def resent_intact(reply_ids):
        first = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
        text = tok.decode(reply_ids, skip_special_tokens=True)
        nxt = tok.apply_chat_template(user + [{"role": "assistant", "content": text},
                                              {"role": "user", "content": "tool output: 3 passed"}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(nxt[:len(first) + len(reply_ids)]) == list(first) + reply_ids

    assert all(resent_intact([rng.choice(ids) for _ in range(128)]) for _ in range(50))
    special = set(tok.all_special_ids)
    arbitrary = [i for i in range(3, 2048) if i not in special and "\ufffd" not in tok.decode([i])]
    assert sum(resent_intact([rng.choice(arbitrary) for _ in range(128)]) for _ in range(50)) < 5


# ------------------------------------------------------------------------------------------------- fn-nvfp4, MTP, chart
def test_fn_nvfp4_preset_is_full_depth_nvfp4_with_the_swe_smith_shape(agentic, tmp_path):
    import json

    from qwen4exp import presets

    a = agentic.parse_args(["--preset", "fn-nvfp4"])
    assert (a.layers, a.gpu_util, a.gpu_util_ours) == (48, 0.92, 0.92)
    assert (a.first_turn_tokens, a.turn_tokens, a.max_output_tokens, a.turns) == (50_000, 800, 500, "3")
    assert a.concurrency == "1,32" and a.conversations == "2,32" and a.timeout <= 570
    # one wave a level for the whole curve too; explicit flags win over the preset
    b = agentic.parse_args(["--preset", "fn-nvfp4", "--concurrency", "1,2,4,8,16,32", "--gpu-util", "0.9"])
    assert b.conversations == "2,2,4,8,16,32" and b.gpu_util == 0.9 and b.gpu_util_ours == 0.92
    fn = agentic.parse_args([])  # the fn preset keeps its depth and memory settings
    assert (fn.layers, fn.gpu_util, fn.gpu_util_ours, fn.first_turn_tokens) == (12, 0.85, 0.7, 8000)
    n = agentic.max_model_len(a)
    assert 50_000 + 2 * (800 + 500) + 500 < n <= 56 * 1024 and n % 1024 == 0

    path = Path(agentic.build_model_dir(str(tmp_path), "fn-nvfp4", a.layers, n))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 48 and len(cfg["layer_types"]) == 48
    assert cfg["hidden_size"] == presets.fn12l().hidden_size
    assert cfg["quantization_config"] == presets.anchor_nvfp4_quantization_config()
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] >= n
    fn_cfg = json.loads((Path(agentic.build_model_dir(str(tmp_path), "fn", 12, 10240)) / "config.json").read_text())
    assert "quantization_config" not in fn_cfg and path.name != "fn12l"  # the two presets' folders stay apart

    for impl in ("upstream", "ours"):
        cmd = agentic.server_cmd(agentic.Job(impl, "0", str(tmp_path)), a, str(path), 8000, n)
        assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.92"
        assert cmd[cmd.index("--load-format") + 1] == "dummy" and cmd[cmd.index("--max-model-len") + 1] == str(n)
        assert "--speculative-config" not in cmd and "--enforce-eager" not in cmd


def test_mtp_gives_both_servers_bench_vllm_gpus_speculative_config(agentic, tmp_path):
    import json

    gpu_bench = load_script("bench_vllm_gpu")
    a = agentic.parse_args(["--preset", "fn-nvfp4", "--mtp", "3"])
    want = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 3.23}
    for impl in ("upstream", "ours"):
        job = agentic.Job(impl, "0", str(tmp_path), a.mtp)
        assert job.label == f"{impl}+mtp3" and job.dir == str(tmp_path / f"{impl}+mtp3")
        cmd = agentic.server_cmd(job, a, "model", 8000, 54272)
        assert cmd.count("--speculative-config") == 1
        got = json.loads(cmd[cmd.index("--speculative-config") + 1])
        assert got == gpu_bench.mtp_config(3, 3.23) == want
        bench = agentic.bench_cmd(job, a, "model", 8000, 300.0, None)
        assert bench[bench.index("--label") + 1] == f"{impl}+mtp3"
        assert bench[bench.index("--num-gpus") + 1] == "1"  # the bench's per-GPU columns: one GPU per server
    b = agentic.parse_args(["--preset", "fn", "--mtp", "2", "--acceptance-length", "2.5"])
    cmd = agentic.server_cmd(agentic.Job("ours", None, str(tmp_path), 2), b, "model", 8000, 10240)
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == gpu_bench.mtp_config(2, 2.5)


def test_mtp_refused_on_the_cpu_preset_and_outside_the_acceptance_range(agentic, capsys):
    with pytest.raises(SystemExit):
        agentic.parse_args(["--preset", "tiny", "--impls", "ours", "--mtp", "3"])
    assert "CUDA only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        agentic.parse_args(["--preset", "fn-nvfp4", "--mtp", "3", "--acceptance-length", "4.5"])  # > K + 1
    assert "--acceptance-length 4.5" in capsys.readouterr().err
    assert agentic.parse_args(["--preset", "tiny", "--impls", "ours"]).speculative_config is None


def _bench_summary(path: Path, label: str, concurrency: int, out_tokens: int, busy_s: float, tpot_ms: float) -> None:
    """A summary.csv row made by the bench's own code from made-up turns: ``out_tokens`` over ``busy_s`` s."""
    turns = [dict(status=M.OK, turn=1, ttft_ms=500.0, tpot_ms=tpot_ms, itl_ms=[tpot_ms], prompt_tokens=50_000,
                  completion_tokens=out_tokens // 2, start_s=0.0, end_s=busy_s / 2),
             dict(status=M.OK, turn=2, ttft_ms=80.0, tpot_ms=tpot_ms, itl_ms=[tpot_ms], prompt_tokens=51_300,
                  completion_tokens=out_tokens - out_tokens // 2, start_s=busy_s / 2, end_s=busy_s)]
    row = M.summarize_level(turns, label=label, concurrency=concurrency, num_gpus=1.0, conversations=concurrency,
                            turns_not_sent=0, duration_s=busy_s)
    with path.open("a" if path.exists() else "w", newline="") as f:
        w = csv.writer(f)
        if f.tell() == 0:
            w.writerow(M.SUMMARY_COLUMNS)
        w.writerow([M.format_cell(row.get(c)) for c in M.SUMMARY_COLUMNS])


def test_tokens_per_minute_per_gpu_column_is_the_benchs_and_ratios(agentic, tmp_path):
    up, ours = tmp_path / "up.csv", tmp_path / "ours.csv"
    _bench_summary(up, "upstream", 1, 1000, 8.0, 8.0)  # 1,000 tokens in 8 s on one GPU: 7,500 tokens/min
    _bench_summary(up, "upstream", 32, 16_000, 32.0, 40.0)  # 30,000 tokens/min
    _bench_summary(ours, "ours", 1, 1000, 10.0, 10.0)  # 6,000 tokens/min
    _bench_summary(ours, "ours", 32, 16_000, 24.0, 30.0)  # 40,000 tokens/min
    rows = agentic.combine([dict(label="upstream", gpu="0", summary=str(up), startup_s=150.0, error=""),
                            dict(label="ours", gpu="0", summary=str(ours), startup_s=110.0, error="")])
    got = {(r["label"], r["concurrency"]): r for r in rows}
    assert float(got[("upstream", "1")]["tok_min_gpu"]) == pytest.approx(7500.0)
    assert float(got[("ours", "32")]["tok_min_gpu"]) == pytest.approx(40_000.0)
    out_tok_s = float(got[("ours", "32")]["output_tok_s"])  # (as written: rounded)
    assert float(got[("ours", "32")]["tok_min_gpu"]) == pytest.approx(out_tok_s * 60, rel=1e-4)
    assert float(got[("ours/upstream", "1")]["tok_min_gpu"]) == pytest.approx(0.8)
    assert float(got[("ours/upstream", "32")]["tok_min_gpu"]) == pytest.approx(4 / 3, rel=1e-3)
    md = agentic.markdown(rows)
    assert "| 40000 |" in md and "e+04" not in md  # whole numbers from 10,000 on, not 4e+04


def test_earlier_calls_are_merged_and_mtp_labels_get_their_own_ratio(agentic, tmp_path):
    early, now, up = tmp_path / "early.csv", tmp_path / "now.csv", tmp_path / "up.csv"
    _bench_summary(early, "ours+mtp3", 1, 1000, 4.0, 4.0)
    _bench_summary(early, "ours+mtp3", 32, 16_000, 20.0, 25.0)
    _bench_summary(now, "ours+mtp3", 1, 1000, 5.0, 5.0)  # this call's concurrency 1 replaces the earlier one
    _bench_summary(now, "ours+mtp3", 8, 4000, 10.0, 12.0)
    _bench_summary(up, "upstream+mtp3", 32, 16_000, 25.0, 25.0)
    folder = tmp_path / "earlier"
    (folder / "upstream+mtp3").mkdir(parents=True)
    up.rename(folder / "upstream+mtp3" / "summary.csv")
    results = agentic.added_results([str(early), str(folder)])
    assert [r["label"] for r in results] == ["ours+mtp3", "upstream+mtp3"]  # the bench's own labels
    rows = agentic.combine(results + [dict(label="ours+mtp3", gpu="0", summary=str(now), startup_s=100.0,
                                           error="")])
    assert [(r["label"], r["concurrency"]) for r in rows] == [
        ("ours+mtp3", "1"), ("ours+mtp3", "8"), ("ours+mtp3", "32"), ("upstream+mtp3", "32"),
        ("ours+mtp3/upstream+mtp3", "32")]
    assert float(rows[0]["tok_min_gpu"]) == pytest.approx(12_000.0) and rows[0]["startup_s"] == "100.0"
    assert float(rows[-1]["tok_min_gpu"]) == pytest.approx(48_000 / 38_400)
    notes = agentic.table_notes(rows, agentic.parse_args(["--preset", "fn-nvfp4"]), reference=False)
    assert any("NOT the model's" in n for n in notes)  # +mtp rows: synthetic acceptance stated


def test_chart_has_the_tokenspeed_reference_beside_the_measured_curves(agentic, tmp_path):
    from qwen4exp.bench import plot as P

    ours, up = tmp_path / "ours.csv", tmp_path / "up.csv"
    _bench_summary(ours, "ours+mtp3", 1, 1000, 4.0, 4.0)
    _bench_summary(ours, "ours+mtp3", 32, 16_000, 20.0, 25.0)
    _bench_summary(up, "upstream+mtp3", 1, 1000, 5.0, 5.0)
    rows = agentic.combine([dict(label="ours+mtp3", gpu="0", summary=str(ours), startup_s=1.0, error=""),
                            dict(label="upstream+mtp3", gpu="0", summary=str(up), startup_s=1.0, error="")])
    series = agentic.chart_series(rows, reference=True)
    assert list(series) == ["ours+mtp3", "upstream+mtp3", "TokenSpeed (published, 4xGB300)"]  # no ratio series
    assert series["TokenSpeed (published, 4xGB300)"] == [(685.9, 7321.5, 1), (95.7, 29005.5, 32)]
    assert series["ours+mtp3"] == [(pytest.approx(250.0), pytest.approx(15_000.0), 1),
                                   (pytest.approx(40.0), pytest.approx(48_000.0), 32)]
    assert "TokenSpeed (published, 4xGB300)" not in agentic.chart_series(rows)

    png = agentic.write_chart(rows, [str(ours), str(up)], str(tmp_path / "a.png"), "t", True,
                              agentic.chart_notes(rows, agentic.parse_args(["--preset", "fn-nvfp4"]), True),
                              backend="builtin")
    texts = P.png_texts(png)
    assert texts["Legend"].split("\n") == ["ours+mtp3", "upstream+mtp3", "TokenSpeed (published, 4xGB300)"]
    assert texts["Y label"] == "Throughput (output tokens/min per GPU)"
    assert "not measured here" in texts["Description"] and "not the model's" in texts["Description"]


def test_no_server_run_tabulates_and_plots_earlier_calls(agentic, tmp_path, capsys):
    import signal

    from qwen4exp.bench import plot as P

    (tmp_path / "a" / "ours").mkdir(parents=True)
    _bench_summary(tmp_path / "a" / "ours" / "summary.csv", "ours", 1, 1000, 8.0, 8.0)
    out = tmp_path / "out"
    handler = signal.getsignal(signal.SIGTERM)
    try:
        rc = agentic.main(["--preset", "fn-nvfp4", "--impls", "none", "--add", str(tmp_path / "a"), "--out",
                           str(out)])
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert rc == 0 and not (out / "fn48l-nvfp4").exists()  # no server, so no model folder
    with (out / "agentic.csv").open(newline="") as f:
        back = list(csv.DictReader(f))
    assert [(r["label"], r["concurrency"]) for r in back] == [("ours", "1")]
    assert float(back[0]["tok_min_gpu"]) == pytest.approx(7500.0)
    assert "published figures, not measured here" in capsys.readouterr().out
    legend = P.png_texts(out / "agentic.png")["Legend"].split("\n")
    assert legend == ["ours", "TokenSpeed (published, 4xGB300)"]


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
