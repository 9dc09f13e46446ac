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


def _python(args: list[str], interpret: bool, tmp, what: str, timeout: float = 1200) -> str:
    """Python with the Triton beside the venv (under its CPU interpreter or not) -> stdout; fails naming ``what``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TRITON_DIR, ROOT]), TRITON_CACHE_DIR=str(tmp / "cache"))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{what} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p.stdout


def _run(step: str, path: str, interpret: bool, tmp) -> str:
    return _python([SCRIPT, step, path], interpret, tmp, step)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton")
    path = str(tmp / "launches.json")
    out = _run("run", path, True, tmp)
    return path, out, tmp


def test_kernels_match_references_under_the_interpreter(launches):
    _, out, _ = launches
    for check in ("op_registration", "qsa_topk", "qsa_decode", "qsa_prefill", "qsa_fp8_caches", "qsa_cache_writes",
                  "hc", "norm_rope_ple", "ple_mix", "ngram_lookup_decode", "moe_combine", "real_widths"):
        assert f"ok check_{check}" in out, out


def test_every_launch_compiles_for_hopper(launches):
    path, _, tmp = launches
    out = _run("compile", path, False, tmp)
    for kernel in ("_qsa_topk_small_kernel", "_qsa_attn_loop_kernel", "_qsa_score_prefill_kernel", "_hc_up_kernel",
                   "_hc_down_kernel", "_ple_gather_kernel", "_index_update_kernel", "_write_paged_kernel",
                   "_shared_gate_combine_kernel", "_ple_mix_decode_kernel", "_ngram_gather_decode_kernel",
                   "_hc_finish_kernel", "_hc_inject_norm_kernel", "_norm_rope_kernel"):
        assert kernel in out, out
    assert "resources _ple_mix_decode_kernel" in out, out  # registers / spills read back (ptxas -v)
    assert "parameters not specialised on alignment" in out, out  # positions / block-table rows: no JIT mid-serving


def test_kernel_resources_recipe_reads_registers_and_spills(launches):
    """``tools/kernel_resources.py`` on two recorded launches: the table and CSV carry registers (> 0), spill
    bytes and shared memory per launch."""
    import csv
    import json
    path, _, tmp = launches
    with open(path) as f:
        picked = [d for d in json.load(f) if d["name"] in ("_ple_mix_decode_kernel", "_rms_norm_kernel")][:2]
    assert len(picked) == 2
    sub, out_csv = tmp / "two.json", tmp / "res.csv"
    sub.write_text(json.dumps(picked))
    out = _python([os.path.join(ROOT, "recipes", "kernel_resources.py"), str(sub), "--all", "--csv", str(out_csv)],
                  False, tmp, "kernel_resources")
    assert "2 distinct launches" in out, out
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(int(r["registers"]) > 0 and int(r["spill_bytes"]) == 0 for r in rows), rows


_FLA_CHECK = r"""
import torch
from qwen4exp.ops.gated_delta_rule import fla_kernel, reference

chunk, recurrent = fla_kernel.load()
torch.manual_seed(0)
for lens, hk, hv, d, with_state in [([20, 3, 1], 2, 4, 32, True), ([1, 1, 1, 1], 1, 3, 16, False)]:
    T = sum(lens)
    q, k, v = torch.randn(T, hk, d), torch.randn(T, hk, d), torch.randn(T, hv, d)
    g, beta = -torch.nn.functional.softplus(torch.randn(T, hv)), torch.sigmoid(torch.randn(T, hv))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    h0 = torch.randn(len(lens), hv, d, d) * 0.1 if with_state else None
    o, s = fla_kernel.run(recurrent, q, k, v, g, beta, cu, h0, None, True)
    ro, rs = reference.recurrent_gated_delta_rule(q, k, v, g, beta, cu, h0, None, True)
    eo, es = ((o - ro).norm() / ro.norm()).item(), ((s - rs).norm() / rs.norm()).item()
    print(f"lens {lens} heads {hk}/{hv} d {d}: rel err out {eo:.1e} state {es:.1e}")
    assert o.shape == ro.shape and s.shape == rs.shape and eo < 1e-5 and es < 1e-5, (eo, es)
"""


@pytest.mark.skipif(not os.path.isdir(os.path.join(TRITON_DIR, "fla")),
                    reason=f"no fla-core beside Triton in {TRITON_DIR} (`make test` installs it there)")
def test_gdn_through_fla_matches_reference_under_the_interpreter(tmp_path):
    """The GPU GDN path calls flash-linear-attention's kernels with our packed layout: its fused recurrent kernel
    under the CPU interpreter, fp32, against our reference (grouped value heads, L2-normalised q / k, carried and
    zero states). This pins the call's conventions without a GPU; the chunked kernels need one (the interpreter has
    no driver for their autotuner): ``tests/test_gpu_kernels.py``."""
    out = _python(["-c", _FLA_CHECK], True, tmp_path, "the fla check", timeout=600)
    assert out.count("rel err") == 2
