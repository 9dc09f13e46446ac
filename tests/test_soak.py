"""``recipes/soak_cpu.py --quick`` (issue 28 item 1, the CI size): a served tiny-coder under steady mixed load at
concurrency 32, cancel storms and (MTP server, small KV cache) preemption; the recipe's own checks must all pass
(exit status 0), and its CSV must show that each phase did what it is there for: every steady request completed,
the storms cancelled streams, the small cache preempted, greedy requests were replayed alone with equal text, and
the KV cache (which holds the plugin's GDN/PLE state slots and QSA caches) went back to idle after every phase, and
server RSS was sampled after every steady round (all processes, the worker apart) and passed its bound and its leak
check; ``rss_checks`` itself is tested on made-up series (a growing one must fail)."""

import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "recipes"))

from soak_cpu import rss_checks  # noqa: E402


def test_rss_checks():
    # settling then flat: passes; the growth over the second half is reported
    assert rss_checks([1100, 1150, 1160, 1162, 1163, 1165], 1000, 512, 64) == (5, [])
    late, fails = rss_checks([1100, 1200, 1300, 1400, 1500, 1600], 1000, 768, 64)  # +100 MiB a round: a leak
    assert late == 300 and len(fails) == 1 and "grew 300 MiB over the phase's last 3 of 6 rounds" in fails[0]
    late, fails = rss_checks([1100, 1600], 1000, 512, 64)  # too few rounds for the leak check; over the bound
    assert late is None and fails == ["RSS 1600 MiB > post-warm-up 1000 + 512 MiB"]
    assert rss_checks([1200, 1700, 1300, 1310], 1000, 512, 64)[1][0].startswith("RSS 1700 MiB")  # any round counts


@pytest.mark.vllm


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
    assert int(steady["rounds"]) == 4 and steady["rss_late_mb"] != "" and float(steady["rss_worker_mb"]) > 0
    # the worker's idle heap trim (qwen4exp/vllm/memory.py) is on by default: what keeps its RSS from growing
    assert "freed heap memory goes back to the OS after 0.5 s idle" in (out / "main" / "server.log").read_text()
    rss = list(csv.DictReader(open(out / "soak_rss.csv")))
    main = [r for r in rss if r["server"] == "main"]
    assert [(r["phase"], int(r["round"])) for r in main] == [("warm-up", 0), *(("steady", i) for i in range(1, 5)),
                                                             ("storm", 1), ("storm", 2)], main
    for r in rss:  # API server, engine core and worker are separate processes, each sampled
        assert all(float(r[k]) > 0 for k in ("api", "engine", "worker", "worker_peak")), r
        assert abs(float(r["total"]) - sum(float(r[k]) for k in ("api", "engine", "worker", "other"))) < 1, r
    for r in rows.values():
        assert float(r["kv_after"]) == 0.0 and int(r["leaks"]) == 0, r
        assert int(r["4xx"]) == int(r["5xx"]) == int(r["errors"]) == 0, r
        assert int(r["greedy_checked"]) > 0 and int(r["greedy_mismatch"]) == 0, r
        assert float(r["ttft_p50_ms"]) > 0 and float(r["rss_after_mb"]) > 0, r
