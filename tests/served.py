"""``qwen4exp-serve`` in a subprocess for tests: started in its own session, up when ``/health`` answers, stopped by
PID (API server + engine core) on exit."""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from qwen4exp.demo import stop_server

START_TIMEOUT = 180

# the README's plain `vllm serve` line: tests/test_newcomer.py runs it, tests/test_readme_commands.py checks that the
# README holds it
README_VLLM_SERVE = (".venv/bin/vllm serve qwen4exp/assets/tiny-coder --served-model-name tiny-coder "
                     "--max-model-len 2048")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def post(url, body, timeout=120, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "{}")


def vllm_serve_env(tmp, drop=(), **extra) -> dict:
    """The environment of a plain ``vllm serve`` under test: this one without ``drop`` and
    VLLM_ENABLE_V1_MULTIPROCESSING, vLLM's caches, IPC sockets and TMPDIR under ``tmp`` (short: socket paths must fit
    107 characters), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", *drop)}
    for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("VLLM_RPC_BASE_PATH", "rpc"), ("TORCHINDUCTOR_CACHE_DIR", "ind")):
        env[var] = str(tmp / sub)
        os.makedirs(env[var])
    env.update(TMPDIR=str(tmp), **extra)
    return env


def wait_healthy(proc, base: str, log_path, t0: float, timeout: float, what: str = "server") -> None:
    """Until ``base``/health answers 200; RuntimeError with the log's tail when ``proc`` exits or ``timeout`` s
    after ``t0`` pass."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited rc={proc.returncode}:\n{log_path.read_text()[-4000:]}")
        if time.time() - t0 > timeout:
            raise RuntimeError(f"{what} not up in {timeout}s:\n{log_path.read_text()[-4000:]}")
        try:
            if get(base + "/health")[0] == 200:
                return
        except Exception:
            pass
        time.sleep(1)


@contextlib.contextmanager
def serve(ckpt: str, work, *args: str, name: str = "tiny", timeout: float = START_TIMEOUT, port: int | None = None):
    """Yield {base, proc, log, startup, ckpt, work} for ``qwen4exp-serve ckpt --served-model-name name *args`` (on
    ``port``, default a free one)."""
    port = port or free_port()
    exe = shutil.which("qwen4exp-serve", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "qwen4exp.serve"]
    from vllm_offline import shared_serve_args  # (tools/: the GPU suite's parts sharing one GPU)

    cmd += [ckpt, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name, *shared_serve_args(list(args))]
    env = dict(os.environ, QWEN4EXP_CACHE_DIR=str(work / "cache"), TMPDIR=str(work))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log = open(work / "server.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, work / "server.log", t0, timeout)
        startup = time.time() - t0
        print(f"server start-up: {startup:.1f}s")
        yield dict(base=base, proc=proc, log=work / "server.log", startup=startup, ckpt=ckpt, work=work)
    finally:
        stop_server(proc)
        log.close()
