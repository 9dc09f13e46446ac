"""The main job: serve the embedded trained tiny Qwen4Exp with vLLM (CPU, our plugin) and chat with it.

    python -m qwen4exp.demo            # start the server, stream one chat answer, print TTFT and tok/s, stop
    python -m qwen4exp.demo --serve    # keep the server running for other clients (Ctrl-C stops it)
    python -m qwen4exp.demo --hf       # no server: generate with the HF reference (MTP speculative decoding)

The checkpoint is ``qwen4exp/assets/tiny-coder`` (3.8M parameters, trained on the Python standard library; see its
README): every mechanism is active (GDN + QSA layers, 4 HC streams, PLE, MoE + shared expert, MTP head).

The server listens on 127.0.0.1 only. Ctrl-C, SIGTERM, SIGHUP (a closed terminal) and the death of the parent
process (``make serve`` killed) all stop it with every process it started (its own process group).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ASSET = os.path.join(os.path.dirname(__file__), "assets", "tiny-coder")
DEFAULT_PROMPT = "Write a Python function `is_prime(n)`: Return True if n is a prime number."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, extra: list[str] | None = None, log=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "qwen4exp.serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "tiny-coder", "--max-model-len", "2048", "--dtype", "bfloat16",
           "--enforce-eager", *(extra or [])]
    return subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, timeout: float = 300.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server not ready after {timeout:.0f} s")


def group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid`` (Linux: from /proc; elsewhere [pgid] while the group
    answers a signal)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the server's process group (API server, engine core, workers: it was started in its own session) and
    wait for all of it; SIGKILL what is left after ``timeout`` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None and not group_alive(proc.pid):
            return
        time.sleep(0.2)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


class Stop(Exception):
    """SIGTERM or SIGHUP arrived: stop the server and exit."""


def _on_stop_signal(signum, _frame):
    for sig in STOP_SIGNALS:  # one stop: a second signal (make forwards SIGTERM, then the parent-death one) must
        signal.signal(sig, signal.SIG_IGN)  # not interrupt the clean-up
    raise Stop(signal.Signals(signum).name)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# a started server shuts down in a few seconds; during start-up vLLM's API server does not act on SIGTERM until
# its engine handshake ends, so the group is SIGKILLed after this grace
STOP_GRACE_S = 10.0


def stop_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux ``PR_SET_PDEATHSIG``): ``make serve`` killed by a signal it
    does not forward (SIGHUP, SIGKILL) must not leave the server behind."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl
        os.kill(os.getpid(), signal.SIGTERM)


def chat(port: int, prompt: str, max_tokens: int, out=sys.stdout) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    t0 = time.perf_counter()
    ttft, n, text = None, 0, []
    stream = client.chat.completions.create(
        model="tiny-coder", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0.0, stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
            out.write(chunk.choices[0].delta.content)
            out.flush()
    total = time.perf_counter() - t0
    n = usage.completion_tokens if usage is not None else len(text)
    out.write("\n")
    rate = (n - 1) / (total - ttft) if ttft is not None and n > 1 and total > ttft else float("nan")
    return {"ttft_s": ttft, "tokens": n, "decode_tok_s": rate, "text": "".join(text)}


def run_hf(prompt: str, max_tokens: int) -> int:
    import torch
    from transformers import AutoTokenizer

    from .hf import Qwen4ExpForCausalLM

    tok = AutoTokenizer.from_pretrained(ASSET)
    model = Qwen4ExpForCausalLM.from_pretrained(ASSET, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_tokens, use_mtp=True, eos_token_id=tok.eos_token_id)
    dt = time.perf_counter() - t0
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    st = model.last_mtp_stats
    print(f"[HF reference, MTP 3] {st['new_tokens']} tokens in {dt:.2f} s ({st['new_tokens'] / dt:.1f} tok/s), "
          f"{st['target_forward_passes']} target passes, mean acceptance length {st['mean_acceptance_length']:.2f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=ASSET, help="checkpoint directory (default: the embedded tiny-coder)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--serve", action="store_true", help="keep the server running until Ctrl-C")
    ap.add_argument("--hf", action="store_true", help="use the HF reference instead of a vLLM server")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    if args.hf:
        return run_hf(args.prompt, args.max_tokens)
    from .checkpoint import missing_checkpoint

    if (missing := missing_checkpoint(args.model, hub=True)) is not None:  # one line, not the server's start-up log
        print(f"qwen4exp.demo: {missing}", file=sys.stderr, flush=True)
        return 1
    port = args.port or free_port()
    log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"qwen4exp-demo-{port}.log")
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)
    proc = None
    with open(log_path, "w") as log:
        try:
            stop_with_parent()
            print(f"starting the vLLM CPU server (qwen4exp plugin) on 127.0.0.1:{port} (log: {log_path}) ...",
                  flush=True)
            proc = start_server(args.model, port, log=log)
            ready = wait_ready(proc, port, args.startup_timeout)
            print(f"server ready in {ready:.1f} s", flush=True)
            if args.serve:
                print(f"serving at http://127.0.0.1:{port}/v1 (model name 'tiny-coder'); Ctrl-C stops it", flush=True)
                while proc.poll() is None:
                    time.sleep(1.0)
                return proc.returncode or 0
            print(f"\nuser> {args.prompt}\nassistant> ", end="", flush=True)
            r = chat(port, args.prompt, args.max_tokens)
            print(f"\nTTFT {r['ttft_s'] * 1000:.0f} ms, {r['tokens']} tokens, {r['decode_tok_s']:.1f} tok/s decode")
            return 0
        except KeyboardInterrupt:
            print("\ninterrupted", flush=True)
            return 130
        except Stop as e:
            print(f"\n{e}: stopping the server", flush=True)
            return 128 + int(getattr(signal, str(e)))
        except Exception as e:  # noqa: BLE001 - report and stop the server
            print(f"\ndemo failed: {e}; last server log lines:", file=sys.stderr)
            log.flush()
            with open(log_path) as f:
                sys.stderr.write("".join(f.readlines()[-30:]))
            return 1
        finally:
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            if proc is not None:
                stop_server(proc, timeout=STOP_GRACE_S)
                print("server stopped", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
