"""``POST /v1/sessions/{session_id}/close`` as a ``vllm.endpoint_plugins`` entry (``qwen4exp.serving.session_api``'s
``SessionClosePlugin``), so that plain ``vllm serve`` has it: vLLM 0.32 loads an endpoint plugin only when
``VLLM_PLUGINS`` names it; with ``qwen4exp-serve``'s ``RequestGuard`` as well the route is there once. The served
test runs vLLM's own ``vllm serve`` (API server and engine core in processes of their own) with ``AgentScheduler``:
a session's turn, then its close over HTTP. ``qwen4exp-serve``'s close tests: ``tests/test_vllm_server_prefix_cache.py``
(served), ``tests/test_serve_env.py`` (in-process)."""

import importlib.metadata as md
import logging
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from served import free_port, post, vllm_serve_env, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
ENTRY = "qwen4exp.serving.session_api:SessionClosePlugin"
GROUP = "vllm.endpoint_plugins"
AGENT = "qwen4exp.serving.scheduler.AgentScheduler"
START_TIMEOUT = 240

pytestmark = pytest.mark.vllm


def test_the_entry_point_is_declared_and_installed():
    """pyproject.toml declares it, and the venv's (editable) install has it: an install made before the entry point
    was added lacks it, and vLLM would silently find nothing."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"][GROUP]
    assert declared == {"qwen4exp": ENTRY}, declared
    installed = {e.name: e.value for e in md.entry_points(group=GROUP)}
    assert installed.get("qwen4exp") == ENTRY, (
        f"the installed qwen4exp distribution has no {GROUP} entry {ENTRY!r} (installed: {installed}); its metadata "
        f"predates pyproject.toml: `make venv` reinstalls the package (pip install --no-deps -e .)")


@pytest.fixture
def vllm_envs(monkeypatch):
    """vllm.envs read afresh (an engine started earlier in this process may have cached them)."""
    import vllm.envs as envs

    cached = envs._is_envs_cache_enabled()
    envs.disable_envs_cache()
    yield monkeypatch
    if cached:
        envs.enable_envs_cache()


def test_vllm_loads_it_only_when_allowlisted(vllm_envs):
    """vLLM's own loader: nothing without VLLM_PLUGINS (vLLM's rule for routes), our plugin (vLLM's EndpointPlugin
    protocol) with VLLM_PLUGINS=qwen4exp on a generating server, nothing on the engine-less render server. Without
    VLLM_PLUGINS vLLM warns that it found ours and did not load it; qwen4exp-serve's log filter drops that line."""
    from vllm.plugins import load_endpoint_plugins
    from vllm.plugins.endpoint_plugins.interface import EndpointPlugin

    from qwen4exp.serve import _RouteAddedByTheGuard
    from qwen4exp.serving.session_api import SessionClosePlugin

    vllm_envs.delenv("VLLM_PLUGINS", raising=False)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("vllm.plugins").addHandler(handler)
    try:
        assert load_endpoint_plugins(("generate",)) == []
    finally:
        logging.getLogger("vllm.plugins").removeHandler(handler)
    (warning,) = [r for r in records if "VLLM_PLUGINS is not set" in r.getMessage()]
    assert "'qwen4exp'" in warning.getMessage()
    assert _RouteAddedByTheGuard.filter(warning) is False  # (qwen4exp-serve drops it: its RequestGuard adds the route)
    vllm_envs.setenv("VLLM_PLUGINS", "qwen4exp")
    (plugin,) = load_endpoint_plugins(("generate",))
    assert isinstance(plugin, SessionClosePlugin) and isinstance(plugin, EndpointPlugin) and plugin.name == "qwen4exp"
    assert load_endpoint_plugins(("render",)) == []
    vllm_envs.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")  # an allowlist without us
    assert load_endpoint_plugins(("generate",)) == []


def test_plugin_and_guard_add_the_route_once(vllm_envs):
    """vLLM's build-time attach (what ``build_app`` runs) adds the route; ``qwen4exp-serve``'s RequestGuard then
    finds it there and adds nothing; the route answers (404 here: no engine client, so no AgentScheduler)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.plugins.endpoint_plugins.interface import attach_endpoint_plugins

    from qwen4exp import serve
    from qwen4exp.serving.session_api import CLOSE_PATH, install

    vllm_envs.setenv("VLLM_PLUGINS", "qwen4exp")
    app = FastAPI()
    attach_endpoint_plugins(app, ("generate",))
    assert [type(p).__name__ for p in app.state.endpoint_plugins] == ["SessionClosePlugin"]
    assert app.state.qwen4exp_session_routes is True and install(app) is False
    app.add_middleware(serve.RequestGuard)
    client = TestClient(app)
    for _ in range(2):
        r = client.post("/v1/sessions/s-1/close")
        assert r.status_code == 404 and "--scheduler-cls " + AGENT in r.json()["error"]["message"], r.text
    assert [getattr(r, "path", None) for r in app.routes].count(CLOSE_PATH) == 1


def test_qwen4exp_serve_hides_only_vllms_not_loaded_warning_for_us():
    """Under ``qwen4exp-serve`` (VLLM_PLUGINS unset) vLLM warns that our endpoint plugin was found but not loaded,
    though RequestGuard adds the route: that line (ours alone) is dropped, any other plugin's kept."""
    from qwen4exp.serve import _RouteAddedByTheGuard as f

    def record(names):
        return logging.LogRecord("vllm.plugins", logging.WARNING, __file__, 1, "Found endpoint plugin(s) %s but "
                                 "VLLM_PLUGINS is not set.", (names,), None)

    assert f.filter(record(["qwen4exp"])) is False
    assert f.filter(record(["qwen4exp", "other"])) is True
    assert f.filter(logging.LogRecord("vllm.plugins", logging.INFO, __file__, 1, "Loaded endpoint plugin %s",
                                      ("qwen4exp",), None)) is True


def test_close_under_plain_vllm_serve(tmp_path_factory):
    """``VLLM_PLUGINS=qwen4exp vllm serve tiny-coder --scheduler-cls AgentScheduler`` (vLLM's command, no
    qwen4exp-serve, no RequestGuard): a session's turn leaves its state retained, the route releases it (200,
    ``released_blocks`` > 0), a second close finds nothing (``unknown``), a blank session id is a 400."""
    from qwen4exp.demo import stop_server

    tmp = tmp_path_factory.mktemp("ep")  # (short: vLLM's IPC socket paths under it must fit 107 characters)
    exe = shutil.which("vllm", path=os.path.dirname(sys.executable))
    assert exe, f"no `vllm` command beside {sys.executable}"
    port = free_port()
    env = vllm_serve_env(tmp, VLLM_PLUGINS="qwen4exp")
    cmd = [exe, "serve", "qwen4exp/assets/tiny-coder", "--served-model-name", "tiny-coder", "--max-model-len", "2048",
           "--enforce-eager", "--scheduler-cls", AGENT, "--host", "127.0.0.1", "--port", str(port)]
    log_path, base = tmp / "server.log", f"http://127.0.0.1:{port}"
    prompt = [(7 * i + 3) % 1900 + 100 for i in range(970)]  # token ids in the tiny-coder's 2,048: some full blocks
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_healthy(proc, base, log_path, t0, START_TIMEOUT, "`vllm serve`")
            print(f"vllm serve start-up: {time.time() - t0:.1f} s")
            code, r = post(base + "/v1/completions", dict(model="tiny-coder", prompt=prompt, max_tokens=8,
                                                          temperature=0), headers={"X-Session-ID": "ep-1"})
            assert code == 200 and r["usage"]["completion_tokens"] == 8, r
            code, r = post(base + "/v1/sessions/ep-1/close", {})
            assert code == 200, r
            assert r["session_id"] == "ep-1" and r["released"] is True and r["previous_state"] == "retained", r
            assert r["released_blocks"] > 0, r
            code, r = post(base + "/v1/sessions/ep-1/close", {})
            assert code == 200 and r["released"] is False and r["previous_state"] == "unknown", r
            code, r = post(base + "/v1/sessions/%20/close", {})
            assert code == 400 and "session id" in r["error"]["message"], r
            served = log_path.read_text()  # (what serving logged: at the stop below vLLM's API server may log the
            # engine core's exit racing its output handler, a traceback of vLLM's shutdown, not of serving)
        finally:
            stop_server(proc)
    assert "Loaded endpoint plugin qwen4exp" in served and "AgentScheduler: session TTL" in served
    assert "Traceback" not in served and "Failed to" not in served, served[-3000:]
