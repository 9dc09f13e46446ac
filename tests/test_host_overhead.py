"""``tools/host_overhead.py`` on CPU: the step-machinery timers of an in-process engine over the tiny checkpoint."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.vllm


def test_host_overhead_reports_groups_and_step_timers(tiny_ckpt):
    pytest.importorskip("vllm")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "host_overhead.py"), tiny_ckpt, "--batch", "2",
                        "--ctx", "40", "--tokens", "6"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["groups"] == 3  # GDN, PLE (with its pad), QSA: see test_vllm_offline's group test
    assert res["steps"] >= 6
    for k in ("Scheduler.schedule", "GPUModelRunner._prepare_inputs", "GPUModelRunner._build_attention_metadata"):
        assert 0 < res[k] < 1e6 * res["wall_ms_per_step"] / 1e3, (k, res)
