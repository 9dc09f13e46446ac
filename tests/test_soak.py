"""``recipes/soak_cpu.py --quick`` (issue 28 item 1, the CI size): a served tiny-coder under steady mixed load at
concurrency 32, cancel storms and (MTP server, small KV cache) preemption; the recipe's own checks must all pass
(exit status 0), and its CSV must show that each phase did what it is there for: every steady request completed,
the storms cancelled streams, the small cache preempted, greedy requests were replayed alone with equal text, and
the KV cache (which holds the plugin's GDN/PLE state slots and QSA caches) went back to idle after every phase."""

import csv
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_soak_quick(tmp_path):
    out = tmp_path / "soak"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "soak_cpu.py"), "--quick", "--out", str(out),
                        "--time-limit", "400"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TMPDIR=str(tmp_path)))
    print(p.stdout[-6000:])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rows = {r["phase"]: r for r in csv.DictReader(open(out / "soak.csv"))}
    assert set(rows) == {"main/steady", "main/storm", "preempt-mtp/preempt"}, rows
    steady, storm, pre = rows["main/steady"], rows["main/storm"], rows["preempt-mtp/preempt"]
    assert int(steady["sent"]) == int(steady["completed"]) == 64
    assert int(storm["cancelled"]) > 0 and int(storm["completed"]) > 0
    assert int(storm["completed"]) + int(storm["cancelled"]) == int(storm["sent"])
    assert float(pre["preemptions"]) > 0 and int(pre["completed"]) == int(pre["sent"])
    for r in rows.values():
        assert float(r["kv_after"]) == 0.0 and int(r["leaks"]) == 0, r
        assert int(r["4xx"]) == int(r["5xx"]) == int(r["errors"]) == 0, r
        assert int(r["greedy_checked"]) > 0 and int(r["greedy_mismatch"]) == 0, r
        assert float(r["ttft_p50_ms"]) > 0 and float(r["rss_after_mb"]) > 0, r
