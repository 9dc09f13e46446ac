"""tools/pick_hc_variant.py: the fastest QWEN4EXP_HC_DECODE value at T tokens from bench_ops' hc_step rows."""

import os

import pytest
from script_loader import load_script

ROOT = os.path.join(os.path.dirname(__file__), "..")



def test_picks_the_fastest_at_the_asked_size_and_honours_exclusions():
    pick = load_script("pick_hc_variant").pick
    r = [dict(op="hc_step", case="T=4,inject_norm+mix", kernel_us="30"),
         dict(op="hc_step", case="T=4,inject_norm+mix,ticket", kernel_us="12"),
         dict(op="hc_step", case="T=4,inject_norm+mix,ticket,BD16", kernel_us="5"),  # not a default tile: ignored
         dict(op="hc_step", case="T=4,inject_norm+gemm-path", kernel_us="14"),
         dict(op="hc_step", case="T=2,inject_norm+mix", kernel_us="1"),
         dict(op="hc_mix", case="T=4,inject_norm+mix,ticket", kernel_us="1"),  # another op: ignored
         dict(op="hc_step", case="T=4,inject_norm+gemm-path", kernel_us="nan")]
    assert pick(r, 4)[0] == "fused-ticket"
    assert pick(r, 4, ["fused-ticket"])[0] == "cublas"
    assert pick(r, 2)[0] == "fused"
    with pytest.raises(SystemExit, match="T=8"):
        pick(r, 8)


def test_every_case_it_reads_is_one_bench_ops_builds():
    cases = load_script("pick_hc_variant").CASES
    src = open(os.path.join(ROOT, "benchmarks", "bench_ops.py")).read()
    for value, case in cases.items():
        assert f'f"T={{T}},{case}"' in src, (value, case)
    envs = open(os.path.join(ROOT, "qwen4exp", "envs.py")).read()
    for value in cases:
        assert f'"{value}"' in envs, value
