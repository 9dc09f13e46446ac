"""CPU throughput of the vLLM plugin vs the HF reference on the tiny test model (the numbers in README.md).

    python benchmarks/bench_vllm_cpu.py [--prompt-len 128] [--gen 64] [--server]

Greedy decoding, ignore EOS, bf16, same token prompts for both runtimes; batch 1 (requests one after another) and
batch 8 (one batch). With --server also times ``qwen4exp-serve`` start-up (launch to /health) and HTTP tokens/s.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))  # vllm_offline: the engine in a clean subprocess


def _hf(ckpt, prompts, gen, batch):
    import torch

    from qwen4exp import Qwen4ExpForCausalLM

    m = Qwen4ExpForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    ids = torch.tensor(prompts)
    with torch.no_grad():
        m.generate(ids[:batch, :16], max_new_tokens=4, do_sample=False)  # warm-up
        t = time.perf_counter()
        for s in range(0, len(prompts), batch):
            m.generate(ids[s: s + batch], max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
        dt = time.perf_counter() - t
    return len(prompts) * gen / dt


def _vllm(ckpt, prompts, gen, batch, work):
    from vllm_offline import run_offline

    n = len(prompts)
    spec = dict(model=ckpt, prompts=prompts, batches=[list(range(s, min(n, s + batch))) for s in range(0, n, batch)],
                engine=dict(dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=1024,
                            max_num_seqs=max(batch, 1)),
                sampling=dict(temperature=0.0, max_tokens=gen, ignore_eos=True, detokenize=False), warmup=True)
    res = run_offline(spec, os.path.join(work, f"vllm_b{batch}"))
    return n * gen / res["run_s"], res["startup_s"]


def _server(ckpt, prompts, gen, work):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("qwen4exp-serve", path=os.path.dirname(sys.executable))
    cmd = ([exe] if exe else [sys.executable, "-m", "qwen4exp.serve"]) + [
        ckpt, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny", "--enforce-eager",
        "--max-model-len", "1024"]
    env = dict(os.environ, QWEN4EXP_CACHE_DIR=os.path.join(work, "cache"), TMPDIR=work)
    log = open(os.path.join(work, "server.log"), "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None or time.time() - t0 > 300:
                raise RuntimeError("server did not start; see " + log.name)
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except Exception:
                time.sleep(0.5)
        startup = time.time() - t0

        def one(p):
            body = json.dumps(dict(model="tiny", prompt=p, max_tokens=gen, temperature=0, ignore_eos=True)).encode()
            req = urllib.request.Request(base + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())["usage"]["completion_tokens"]

        one(prompts[0][:8])
        t = time.perf_counter()
        n1 = sum(one(p) for p in prompts)
        b1 = n1 / (time.perf_counter() - t)
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            n8 = sum(ex.map(one, prompts))
        b8 = n8 / (time.perf_counter() - t)
        return startup, b1, b8
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--gen", type=int, default=64, help="generated tokens per prompt")
    ap.add_argument("--n", type=int, default=8, help="prompts (batch 8 runs them as one batch)")
    ap.add_argument("--server", action="store_true", help="also time qwen4exp-serve: start-up and HTTP tokens/s")
    ap.add_argument("--ckpt", default=None, help="default: a fresh tiny random checkpoint")
    a = ap.parse_args()
    import torch

    work = tempfile.mkdtemp(prefix="qwen4exp-bench-", dir=os.environ.get("QWEN4EXP_BENCH_DIR") or None)
    ckpt = a.ckpt
    if ckpt is None:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from tiny_checkpoint import build_checkpoint

        ckpt = build_checkpoint(os.path.join(work, "ckpt"))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 500, (a.n, a.prompt_len), generator=g).tolist()
    rows = {}
    for b in (1, 8):
        v, st = _vllm(ckpt, prompts, a.gen, b, work)
        h = _hf(ckpt, prompts, a.gen, b)
        rows[b] = (v, h, st)
        print(f"batch {b}: vLLM {v:.1f} tok/s (engine start {st:.1f}s), HF reference {h:.1f} tok/s")
    if a.server:
        st, b1, b8 = _server(ckpt, prompts, a.gen, work)
        print(f"server: start-up {st:.1f}s, batch 1 {b1:.1f} tok/s, 8 concurrent {b8:.1f} tok/s")


if __name__ == "__main__":
    main()
