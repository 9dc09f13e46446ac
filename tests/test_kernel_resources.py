"""``tools/kernel_resources.py`` on two launches the Triton interpreter recorded (``tests/ops/interpreter.py run``):
the table and CSV carry registers (> 0), spill bytes and shared memory per launch, compiled for sm_90 without a
GPU. Needs the Triton beside the venv (``make test`` installs it in .cache/triton)."""

import csv
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON_DIR = os.environ.get("QWEN4EXP_TRITON_PATH", os.path.join(ROOT, ".cache", "triton"))

pytestmark = pytest.mark.skipif(
    not os.path.isdir(os.path.join(TRITON_DIR, "triton")),
    reason=f"no Triton for the offline kernel checks in {TRITON_DIR} (`make test` installs it there)")


def _python(args, interpret: bool, tmp) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TRITON_DIR, ROOT]), TRITON_CACHE_DIR=str(tmp / "cache"))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, f"{args[0]} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p.stdout


def test_kernel_resources_reads_registers_and_spills(tmp_path):
    out = tmp_path / "checks"
    _python([os.path.join(ROOT, "tests", "ops", "interpreter.py"), "run", str(out), "rms_norm", "ple_mix"], True,
            tmp_path)
    with open(out / "launches.json") as f:
        launches = json.load(f)
    picked = [next(d for d in launches if d["name"] == k) for k in ("_ple_mix_decode_kernel", "_rms_norm_kernel")]
    sub, out_csv = tmp_path / "two.json", tmp_path / "res.csv"
    sub.write_text(json.dumps(picked))
    text = _python([os.path.join(ROOT, "tools", "kernel_resources.py"), str(sub), "--all", "--csv", str(out_csv)],
                   False, tmp_path)
    assert "2 distinct launches" in text and "_ple_mix_decode_kernel" in text, text
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(int(r["registers"]) > 0 and int(r["spill_bytes"]) == 0 for r in rows), rows
    assert {r["kernel"] for r in rows} == {"_ple_mix_decode_kernel", "_rms_norm_kernel"}
