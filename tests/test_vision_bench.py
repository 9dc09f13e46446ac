"""``benchmarks/bench_vision.py`` on CPU with a small image and a shallow tower (the real run is on the GPU)."""

import json

from script_loader import load_script

bench = load_script("bench_vision")


def test_bench_vision_smoke(tmp_path, capsys):
    out = tmp_path / "r.json"
    r = bench.main(["--size", "64", "--depth", "2", "--reps", "2", "--warmup", "1", "--device", "cpu",
                    "--json", str(out)])
    assert r["patches"] == 16 and r["tokens_out"] == 4 and r["width"] == 1152
    assert r["ours_ms"] > 0 and r["upstream_ms"] > 0
    assert r["rel_diff"] <= 1e-5  # fp32: the same function
    assert json.loads(out.read_text()) == r
    assert "ours" in capsys.readouterr().out
