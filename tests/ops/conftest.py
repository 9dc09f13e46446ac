"""Fixtures of the op tests (``tests/ops/test_<op>.py``, one file per op folder of ``qwen4exp.ops``).

Each op file holds three kinds of tests:

* the reference (``ops/<op>/reference.py``) against an independent per-token loop, and the CUDA path's host-side
  logic (``ops/<op>/host.py``: what the kernels cover, how the wrappers compose them) with the references plugged
  in: plain CPU tests;
* the GPU kernels against the reference at the real sizes, through the dispatcher, each asserting with
  ``op_helpers.expect_kernel`` (``_registry.record()``) that the kernel path ran: marked ``gpu``, skipped here
  (with the reason) on a machine without CUDA;
* the Triton checks without a GPU, one pytest item per check: ``@pytest.mark.triton_check(NAME)`` and the
  ``triton_checks`` fixture. The checks themselves are registered in ``interpreter.py`` (``@check(NAME)``; part of
  them in ``interpreter_qsa_ple.py``) and run ONCE per session under Triton's CPU interpreter, split over PARTS
  subprocesses at once; the kernels they launched are then compiled for sm_90 the same way (only when a compile
  item is selected).
  Only the checks named by the selected items' markers run.

Fixtures: ``device`` (each test on the CPU, and on CUDA as a ``gpu`` case), ``triton_checks``.
Helpers: ``op_helpers.py`` (``from op_helpers import ...``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TRITON_DIR = os.environ.get("QWEN4EXP_TRITON_PATH", os.path.join(ROOT, ".cache", "triton"))
SCRIPT = os.path.join(HERE, "interpreter.py")
TIMEOUT_S = float(os.environ.get("QWEN4EXP_INTERPRETER_TIMEOUT", "2400"))
PARTS = max(1, min(2, os.cpu_count() or 1))  # each step's subprocesses at once (the session only waits on them)
NO_CUDA = "needs a CUDA GPU (the Triton kernels); none here"


def pytest_configure(config):
    config.addinivalue_line("markers", "triton_check(*names): Triton checks (tests/ops/interpreter.py) this item "
                                       "reads; the session runs only the checks its items name")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if "gpu" in item.keywords and str(item.path).startswith(HERE + os.sep):
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Each test once on the CPU (the references) and once on CUDA (the kernels; a ``gpu`` case)."""
    return torch.device(request.param)


# ------------------------------------------------------------------------------------------------ Triton checks
def _load(path, default):
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


class TritonChecks:
    """The session's Triton checks: ``passed(name)`` asserts one interpreter check passed (showing its error),
    ``compiled(kernel)`` that every recorded launch of a kernel compiled for sm_90 (within shared memory, without
    register spills where required), ``compile_check(name)`` one check of the compile step. ``out``: the folder of
    the steps' JSON files (``launches.json``: the recorded launches); ``python(args)``: run a script the same way."""

    def __init__(self, tmp, names):
        self.tmp, self.names = tmp, names
        self.out = str(tmp / "out")
        os.makedirs(self.out, exist_ok=True)
        self.results, self.run_log = self._run_checks(list(names))
        self._compiled = None

    def _env(self, interpret):
        env = dict(os.environ, TRITON_CACHE_DIR=str(self.tmp / "cache"),
                   PYTHONPATH=os.pathsep.join([TRITON_DIR, ROOT, HERE, os.path.dirname(HERE)]))
        env.pop("TRITON_INTERPRET", None)
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        return env

    def python(self, args, interpret=False):
        """Python with the Triton beside the venv (under its CPU interpreter or not) -> (exit code, output tail)."""
        try:
            p = subprocess.run([sys.executable, *args], env=self._env(interpret), capture_output=True, text=True,
                               timeout=TIMEOUT_S)
            return p.returncode, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
        except subprocess.TimeoutExpired as e:
            tail = f"{(e.stdout or b'')[-3000:]!r}\n{(e.stderr or b'')[-6000:]!r}"
            return None, f"timed out after {TIMEOUT_S:.0f} s\n{tail}"

    def _all_at_once(self, runs, interpret):
        """The scripts (argument lists) in subprocesses at once, within TIMEOUT_S in all -> their output tails."""
        procs = []
        for i, args in enumerate(runs):
            log = open(os.path.join(self.out, f"{args[1]}-{i}.log"), "w+")
            procs.append((subprocess.Popen([sys.executable, *args], env=self._env(interpret), stdout=log,
                                           stderr=subprocess.STDOUT), log))
        deadline, tails = time.monotonic() + TIMEOUT_S, []
        for p, log in procs:
            try:
                head = f"exit {p.wait(timeout=max(1.0, deadline - time.monotonic()))}"
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                head = f"timed out after {TIMEOUT_S:.0f} s"
            log.seek(0)
            tails.append(f"{head}\n{log.read()[-9000:]}")
            log.close()
        return "\n".join(tails)

    def _run_checks(self, names):
        """The interpreter step: the named checks split over PARTS subprocesses (every PARTS-th name each), their
        results and recorded launches merged into OUT/checks.json and OUT/launches.json (the compile step's input)."""
        groups = [g for g in (names[i::PARTS] for i in range(PARTS)) if g] or [[]]
        dirs = [os.path.join(self.out, f"run-{i}") for i in range(len(groups))]
        log = self._all_at_once([[SCRIPT, "run", d, *g] for d, g in zip(dirs, groups)], True)
        results, launches = {}, {}
        for d in dirs:
            results.update(_load(os.path.join(d, "checks.json"), {}))
            for x in _load(os.path.join(d, "launches.json"), []):
                launches[json.dumps(x, sort_keys=True)] = x
        for name, data in (("checks.json", results), ("launches.json", list(launches.values()))):
            with open(os.path.join(self.out, name), "w") as f:
                json.dump(data, f)
        return results, log

    @staticmethod
    def _assert(res, what, log, missing="no result (the subprocess stopped before it?)"):
        if res is None:
            pytest.fail(f"{what}: {missing}\n{log}", pytrace=False)
        if res["status"] == "skipped":
            pytest.skip(f"{what}: {res['message']}")
        if res["status"] != "passed":
            pytest.fail(f"{what} failed:\n{res['message']}", pytrace=False)

    def passed(self, name):
        self._assert(self.results.get(name), f"interpreter check {name!r}", self.run_log)

    def _compile(self):
        """The compile step, the launches split over PARTS subprocesses (the compile checks in the first), their
        results merged: a kernel fails if any part's launches of it failed."""
        if self._compiled is None:
            log = self._all_at_once([[SCRIPT, "compile", self.out, str(i), str(PARTS)] for i in range(PARTS)], False)
            kernels, checks = {}, {}
            for i in range(PARTS):
                got = _load(os.path.join(self.out, f"compiled-{i}.json"), {})
                checks.update(got.get("checks", {}))
                for k, r in got.get("kernels", {}).items():
                    old = kernels.setdefault(k, dict(status="passed", message=""))
                    if r["status"] != "passed":
                        old["status"] = "failed"
                        old["message"] = "\n".join(m for m in (old["message"], r["message"]) if m)
            self._compiled = (dict(kernels=kernels, checks=checks), log)
        return self._compiled

    def compiled(self, kernel):
        results, log = self._compile()
        self._assert(results.get("kernels", {}).get(kernel), f"sm_90 compile of {kernel}", log,
                     "no launch of it recorded (the checks named by this item's triton_check marker launch it?)")

    def compile_check(self, name):
        results, log = self._compile()
        self._assert(results.get("checks", {}).get(name), f"compile check {name!r}", log)


@pytest.fixture(scope="session")
def triton_checks(request, tmp_path_factory):
    if not os.path.isdir(os.path.join(TRITON_DIR, "triton")):
        pytest.skip(f"no Triton for the offline kernel checks in {TRITON_DIR} (`make test` installs it there)")
    names = sorted({n for item in request.session.items for m in item.iter_markers("triton_check")
                    for n in m.args})
    return TritonChecks(tmp_path_factory.mktemp("triton"), names)
