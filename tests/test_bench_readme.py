"""The docs' ``qwen4exp-bench`` examples run as written on the CPU setup (the README's details moved to docs/: the
constants keep their names).

``README_CPU_EXAMPLE`` is docs/benchmarks.md's benchmark line for ``make serve PORT=8000`` (tiny-coder on CPU, max
model length 2048), word for word: ``test_readme_shows_the_tested_examples`` checks that docs/benchmarks.md (and
``qwen4exp/bench/README.md``) hold it.
Here it runs against the fake server dressed as that server (tiny-coder's tokenizer and model name, max_model_len
2048, ChatML as tiny-coder's template renders plain messages); ``tests/test_bench.py::test_readme_cpu_example_on_
make_serve`` runs it against the real ``make serve`` server (marker ``vllm``, sharing that module's server).
``README_AB_EXAMPLE`` is docs/scheduling.md's ``--ab`` example: parsed as bash would, and its configurations planned
(ports pinned, each server's --max-model-len long enough), without starting servers (``tests/test_agent_ab.py`` runs
the same two configurations).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from bench_support import (AGENT, CKPT, README_AB_EXAMPLE, README_CPU_EXAMPLE, SRV, WORKLOAD,  # noqa: E402,F401
                           check_readme_cpu_run, fake_factory, replace_value, run_cli, run_readme_cpu_example,
                           shell_argv)

from qwen4exp.bench import ab as AB  # noqa: E402
from qwen4exp.bench import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
def test_readme_shows_the_tested_examples():
    for name, block, doc in (("README_CPU_EXAMPLE", README_CPU_EXAMPLE, "docs/benchmarks.md"),
                             ("README_AB_EXAMPLE", README_AB_EXAMPLE, "docs/scheduling.md")):
        flat = " ".join((ROOT / doc).read_text().split())  # (a block inside a list item is indented)
        assert " ".join(block.split()) in flat, f"{doc} should show {name} of tests/test_bench_readme.py"
    bench_readme = " ".join((ROOT / "qwen4exp" / "bench" / "README.md").read_text().split())
    assert " ".join(README_CPU_EXAMPLE.split()) in bench_readme and " ".join(README_AB_EXAMPLE.split()) in bench_readme
    for doc in ("README.md", "docs/benchmarks.md", "docs/scheduling.md"):
        assert "--ab default='ARGS'" not in (ROOT / doc).read_text()  # the placeholder is gone


def test_readme_cpu_example_runs_against_a_tiny_coder_sized_server(fake_factory, tmp_path):
    srv = fake_factory("--model", "tiny-coder", "--max-model-len", "2048", "--usage-details",
                       "--tokenizer-json", str(ROOT / CKPT / "tokenizer.json"))
    rc, _, err, dt = run_readme_cpu_example(srv.base_url, tmp_path / "out")
    check_readme_cpu_run(rc, err, tmp_path / "out")
    assert dt < 30


def test_readme_ab_example_is_concrete_and_fits_its_servers(monkeypatch):
    argv = shell_argv(README_AB_EXAMPLE)
    args = cli.build_parser().parse_args(argv)
    assert [n for n, _ in args.ab] == ["default", "agent"] and args.ab_ports == [8101, 8102]
    assert not any(re.search(r"\bARGS\b|\.\.\.", a) for a in argv), argv
    monkeypatch.setattr(AB, "port_taken", lambda port, host="127.0.0.1": None)  # 8101/8102 may be busy here
    plans = AB._plan_configs(args)  # also: the workload fits each server's --max-model-len
    assert not isinstance(plans, str), plans
    (dn, denv, dwords, dport), (an, aenv, awords, aport) = plans
    assert (dport, aport) == (8101, 8102) and denv == aenv == {}
    assert awords == dwords + ["--scheduler-cls", "qwen4exp.serving.scheduler.AgentScheduler"]
    assert dwords[0] == CKPT and (ROOT / CKPT / "config.json").exists()
    assert " ".join(dwords) == SRV and " ".join(awords) == SRV + AGENT  # the configurations CI runs
    for i in range(0, len(WORKLOAD), 2):
        assert argv[argv.index(WORKLOAD[i]) + 1] == WORKLOAD[i + 1], WORKLOAD[i]


@pytest.mark.parametrize("bad", ["--ab-ports 8101", "--ab-ports 8101,x"])
def test_readme_ab_example_with_bad_ports_is_refused(bad, tmp_path):
    argv = replace_value(shell_argv(README_AB_EXAMPLE), "--ab-ports", bad.split()[1]) + ["--out", str(tmp_path)]
    rc, _, err, _ = run_cli(argv, timeout=30)
    assert rc == cli.EXIT_SETUP and "--ab-ports" in err
