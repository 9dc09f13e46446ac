"""The Triton GPU kernels, checked on a machine without a GPU (CI): against their torch references under Triton's
CPU interpreter, then every launch that exercised compiled ahead of time for Hopper (sm_90) down to a cubin, so a
kernel that would not compile on the H200 fails here (``tests/triton_offline.py`` does the work, in subprocesses:
the interpreter is chosen when Triton is imported, and the venv itself keeps vLLM's CPU build free of Triton)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON_DIR = os.environ.get("QWEN4EXP_TRITON_PATH", os.path.join(ROOT, ".cache", "triton"))
SCRIPT = os.path.join(ROOT, "tests", "triton_offline.py")

pytestmark = pytest.mark.skipif(
    not os.path.isdir(os.path.join(TRITON_DIR, "triton")),
    reason=f"no Triton for the offline kernel checks in {TRITON_DIR} (`make test` installs it there)")


def _run(step: str, path: str, interpret: bool, tmp) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TRITON_DIR, ROOT]), TRITON_CACHE_DIR=str(tmp / "cache"))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, SCRIPT, step, path], env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, f"{step} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton")
    path = str(tmp / "launches.json")
    out = _run("run", path, True, tmp)
    return path, out, tmp


def test_kernels_match_references_under_the_interpreter(launches):
    _, out, _ = launches
    for check in ("qsa_topk", "qsa_decode", "qsa_prefill", "qsa_fp8_caches", "qsa_cache_writes", "hc", "norm_rope_ple",
                  "real_widths"):
        assert f"ok check_{check}" in out, out


def test_every_launch_compiles_for_hopper(launches):
    path, _, tmp = launches
    out = _run("compile", path, False, tmp)
    for kernel in ("_qsa_topk_small_kernel", "_qsa_attn_loop_kernel", "_qsa_score_prefill_kernel", "_hc_up_kernel",
                   "_hc_down_kernel", "_ple_gather_kernel", "_index_update_kernel", "_write_paged_kernel"):
        assert kernel in out, out
    assert "parameters not specialised on alignment" in out, out  # positions / block-table rows: no JIT mid-serving
