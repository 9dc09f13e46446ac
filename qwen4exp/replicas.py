"""N ``qwen4exp-serve`` replicas (``AgentScheduler``) behind ``vllm-router`` with session affinity, on one host.

    python -m qwen4exp.replicas [--replicas 2] [--port 8000] [--policy sticky_least_loaded] [MODEL] [-- SERVE ARGS]

Starts N ``qwen4exp-serve`` processes on consecutive ports after ``--port`` (each with
``--scheduler-cls ...AgentScheduler --enable-prompt-tokens-details`` and the SERVE ARGS), waits for their
``/health``, then starts ``vllm-router`` on ``--port`` in front of them (its Prometheus metrics on
``--metrics-port``, default ``--port`` + 1000) and stays in the foreground until Ctrl-C / SIGTERM, which stops the
router and every replica (each runs in its own process group). ``vllm-router`` is the optional extra ``router``
(``make router``: ``requirements-router.lock`` into the venv).

Session affinity: our clients send the session id as the ``X-Session-ID`` header, which is the first key
``vllm-router``'s session policies read (then ``X-User-ID``, ..., the body's ``session_params.session_id``, ``user``,
``session_id``), and which the router passes on to the replica, where ``AgentScheduler`` keys its retention on it.
The router flags below make a dead replica leave the rotation within about a second (health check every second,
one failure marks it unhealthy, the circuit breaker opens on the first failed request) and retry a request that could
not reach its replica on another one; a stream cut mid-way by a replica's death is not retried by the router: the
client sees the stream end without ``[DONE]`` and re-sends the turn (docs/scale-out.md, "Failover").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .demo import free_port, stop_server

ASSET = os.path.join(os.path.dirname(__file__), "assets", "tiny-coder")
POLICIES = ("sticky_least_loaded", "consistent_hash", "round_robin", "power_of_two", "cache_aware", "random")
DEFAULT_POLICY = "sticky_least_loaded"
# the router's failover settings (see the module docstring)
ROUTER_FAILOVER_ARGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                        "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
                        "--cb-failure-threshold", "1", "--cb-success-threshold", "1",
                        "--cb-timeout-duration-secs", "5", "--retry-max-retries", "4",
                        "--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "2000"]
# CPU defaults of one replica (the tiny checkpoint); SERVE ARGS replace them
CPU_SERVE_ARGS = ["--max-model-len", "2048", "--enforce-eager"]


def scheduler_cls() -> str:
    """``AgentScheduler``'s import path (``qwen4exp.serving.scheduler`` once the serving modules moved there)."""
    for mod in ("qwen4exp.serving.scheduler", "qwen4exp.serving.scheduler"):
        try:
            if importlib.util.find_spec(mod) is not None:
                return mod + ".AgentScheduler"
        except ModuleNotFoundError:
            continue
    raise RuntimeError("AgentScheduler not found in qwen4exp.serving nor qwen4exp.vllm")


def router_exe() -> str:
    exe = shutil.which("vllm-router", path=os.path.dirname(sys.executable)) or shutil.which("vllm-router")
    if exe is None:
        raise SystemExit("qwen4exp.replicas: no vllm-router command: install the extra (`make router`, or "
                         "`pip install -e '.[router]'`)")
    return exe


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited rc={proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{what} not up in {timeout:.0f}s:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if _get(url)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)


@dataclass
class Replica:
    index: int
    port: int
    cmd: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "a") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    def wait(self, timeout: float) -> None:
        assert self.proc is not None
        _wait(self.url + "/health", self.proc, self.log, timeout, f"replica {self.index} (port {self.port})")

    def kill(self) -> None:
        """SIGKILL the whole replica (API server and engine core), as a crashed node."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        if self.proc is not None:
            stop_server(self.proc, timeout=5)  # anything of the group left

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)


@dataclass
class Fleet:
    """The replicas and the router; ``start()`` / ``stop()`` (or use :func:`fleet`)."""
    model: str
    replicas: int
    port: int
    policy: str
    workdir: Path
    serve_args: list[str] = field(default_factory=lambda: list(CPU_SERVE_ARGS))
    served_name: str = "tiny-coder"
    metrics_port: int | None = None
    router_args: list[str] = field(default_factory=list)
    replica_ports: list[int] | None = None
    env: dict[str, str] | None = None
    members: list[Replica] = field(default_factory=list)
    router: subprocess.Popen | None = None
    env_run: dict[str, str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def replica_cmd(self, port: int) -> list[str]:
        return [sys.executable, "-m", "qwen4exp.serve", self.model, "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", self.served_name, "--scheduler-cls", scheduler_cls(),
                "--enable-prompt-tokens-details", *self.serve_args]

    def router_cmd(self) -> list[str]:
        return [router_exe(), "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *(m.url for m in self.members), "--policy", self.policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                "--log-level", "warning", *ROUTER_FAILOVER_ARGS, *self.router_args]

    def start(self, timeout: float = 300.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.metrics_port is None:
            self.metrics_port = free_port()
        ports = self.replica_ports or [free_port() for _ in range(self.replicas)]
        env = dict(self.env if self.env is not None else os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        for i, port in enumerate(ports):
            self.members.append(Replica(i, port, self.replica_cmd(port), env, self.workdir / f"replica{i}.log"))
        for m in self.members:  # all at once: start-up is mostly waiting on imports and the engine core's hand-shake
            m.start()
        for m in self.members:
            m.wait(timeout)
        self.env_run = env
        self.start_router()

    def stop(self) -> None:
        if self.router is not None:
            stop_server(self.router, timeout=10)
        for m in self.members:
            with contextlib.suppress(Exception):
                m.stop()

    def start_router(self, policy: str | None = None) -> None:
        """(Re)start the router alone, with ``policy`` (default: the fleet's); the replicas keep running."""
        if self.router is not None:
            stop_server(self.router, timeout=10)
        self.policy = policy or self.policy
        log = self.workdir / "router.log"
        with open(log, "a") as f:
            f.write(f"--- vllm-router --policy {self.policy}\n")
            f.flush()
            self.router = subprocess.Popen(self.router_cmd(), stdout=f, stderr=subprocess.STDOUT, env=self.env_run,
                                           start_new_session=True)
        _wait(self.url + "/health", self.router, log, 60, "vllm-router")

    def worker_health(self) -> dict[str, float]:
        """The router's view of each replica (``vllm_router_worker_health``: 1 healthy, 0 not), by URL."""
        try:
            text = _get(self.metrics_url, timeout=5)[1]
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line.startswith("vllm_router_worker_health{"):
                url = line.split('worker="', 1)[1].split('"', 1)[0]
                out[url] = float(line.rsplit(" ", 1)[1])
        return out

    def restart(self, i: int, timeout: float = 300.0) -> float:
        """Start replica ``i`` again (same port) and wait for its ``/health``; returns the seconds it took."""
        t0 = time.monotonic()
        m = self.members[i]
        m.start()
        m.wait(timeout)
        return time.monotonic() - t0


@contextlib.contextmanager
def fleet(model: str = ASSET, replicas: int = 2, policy: str = DEFAULT_POLICY, workdir: str | Path = ".tmp/replicas",
          port: int | None = None, **kw):
    f = Fleet(model=model, replicas=replicas, port=port or free_port(), policy=policy, workdir=Path(workdir), **kw)
    try:
        f.start()
        yield f
    finally:
        f.stop()


def from_args(argv: list[str]) -> tuple[Fleet, argparse.Namespace]:
    """The :class:`Fleet` of a command line (nothing started)."""
    argv = list(argv)
    serve_args = None
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m qwen4exp.replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=ASSET, help="checkpoint directory (default: the tiny-coder asset)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--port", type=int, default=8000, help="the router's port; replicas on the next N ports")
    p.add_argument("--metrics-port", type=int, default=None, help="the router's Prometheus port (default port+1000)")
    p.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY)
    p.add_argument("--served-model-name", default="tiny-coder")
    p.add_argument("--workdir", default=".tmp/replicas", help="logs: replicaN.log, router.log")
    a = p.parse_args(argv)
    f = Fleet(model=a.model, replicas=a.replicas, port=a.port, policy=a.policy, workdir=Path(a.workdir),
              serve_args=CPU_SERVE_ARGS if serve_args is None else serve_args, served_name=a.served_model_name,
              metrics_port=a.metrics_port or a.port + 1000,
              replica_ports=[a.port + 1 + i for i in range(a.replicas)])
    return f, a


def main(argv: list[str] | None = None) -> int:
    f, a = from_args(sys.argv[1:] if argv is None else argv)

    def _term(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        t0 = time.monotonic()
        print(f"starting {a.replicas} replicas and vllm-router ({a.policy}); logs in {a.workdir}", flush=True)
        f.start()
        print(f"up in {time.monotonic() - t0:.1f} s: router {f.url}/v1 (metrics {f.metrics_url}); replicas "
              + ", ".join(m.url for m in f.members) + " (each /metrics)", flush=True)
        while True:
            time.sleep(1)
            if f.router is not None and f.router.poll() is not None:
                print(f"vllm-router exited rc={f.router.returncode}", flush=True)
                return 1
    except KeyboardInterrupt:
        return 0
    finally:
        f.stop()
        print("stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
