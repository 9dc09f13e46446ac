"""`make demo`'s path: the embedded trained checkpoint served by vLLM (our CPU plugin) answers a streamed chat
request, the server stops afterwards, and its greedy answer equals the HF reference's on the same checkpoint."""

import os
import re
import subprocess
import sys

import pytest
import torch

from qwen4exp.demo import ASSET, DEFAULT_PROMPT

pytestmark = pytest.mark.vllm


def hf_greedy_text(n):
    from transformers import AutoTokenizer

    from qwen4exp import Qwen4ExpForCausalLM

    tok = AutoTokenizer.from_pretrained(ASSET)
    m = Qwen4ExpForCausalLM.from_pretrained(ASSET, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": DEFAULT_PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_demo_serves_streams_and_stops():
    n = 40
    p = subprocess.run([sys.executable, "-m", "qwen4exp.demo", "--max-tokens", str(n)], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ))
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    assert "server ready in" in out and "server stopped" in out
    m = re.search(r"TTFT (\d+) ms, (\d+) tokens, ([\d.]+) tok/s decode", out)
    assert m and int(m.group(2)) > 0 and float(m.group(3)) > 0
    port = int(re.search(r"127\.0\.0\.1:(\d+)", out).group(1))
    import socket

    with socket.socket() as s:  # nothing listens there any more
        assert s.connect_ex(("127.0.0.1", port)) != 0
    answer = out.split("assistant> ", 1)[1].split("\nTTFT", 1)[0].strip()
    assert answer == hf_greedy_text(n).strip()
