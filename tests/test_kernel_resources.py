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


def _w13_launch(shift: bool) -> dict:
    """The MoE decode's gate/up launch at the model's sizes (bf16; what ``experts_nvfp4_triton`` launches)."""
    sig = {"X": "*bf16", "W13": "*u8", "S13": "*u8", "GS13": "*fp32", "IDS": "*i64", "ACT": "*bf16", "D": "i32",
           "I": "i32", "stride_x": "i32", "TOP_K": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
           "BF16": "constexpr", "SHIFT": "constexpr"}
    return dict(module="qwen4exp.ops.moe_decode.triton_kernel", name="_w13_silu_kernel", signature=sig,
                constexprs=dict(TOP_K=10, BLOCK_N=8, BLOCK_K=512, BF16=True, SHIFT=shift),
                options=dict(num_warps=4), divisible=[k for k, v in sig.items() if v != "constexpr"])


def test_kernel_resources_sass_mix_counts_the_decode(tmp_path):
    """``--sass``: the instruction mix of the hottest loop. The MoE decode's shift decode of NVFP4 codes issues far
    fewer integer instructions a loop step than the select decode (the reason it exists), the same loads."""
    sub, out_csv = tmp_path / "w13.json", tmp_path / "mix.csv"
    sub.write_text(json.dumps([_w13_launch(True), _w13_launch(False)]))
    text = _python([os.path.join(ROOT, "tools", "kernel_resources.py"), str(sub), "--sass", "--csv", str(out_csv)],
                   False, tmp_path)
    assert "2 distinct launches" in text and "INT" in text and "MMA" in text, text
    with open(out_csv) as f:
        rows = {json.loads(r["constexprs"])["SHIFT"]: r for r in csv.DictReader(f)}
    shift, select = rows[True], rows[False]
    codes = 2 * 8 * 512 // 128  # gate and up codes a thread decodes a loop step
    for r in (shift, select):
        assert int(r["loop_all"]) == sum(int(r[f"loop_{c}"]) for c in ("INT", "FP32", "CVT", "MEM", "MMA", "OTHER"))
        assert int(r["loop_MEM"]) > 0 and int(r["loop_MMA"]) == 0, r
    assert int(shift["loop_INT"]) < 8 * codes < int(select["loop_INT"]), (shift, select)
    assert shift["loop_MEM"] == select["loop_MEM"], (shift, select)
