"""The start-up warm-up compiles every Triton kernel variant the QSA serving path can launch: ``launch_keys.py``
binds each launch of the warm-up (``QSAMixer._warm_up``'s calls) and of the serving call sites (prefill chunks at any
offset of a step, mixed-step decode rows, MTP verifications of up to 4 x max_num_seqs rows, draft steps, the block
keys a step completes) with Triton's own binder for sm_90, and asserts each serving launch's cache key (types,
constexprs, options, integer / pointer specialisation) is one the warm-up produced: at the real widths (FN-24L, bf16
and FP8 caches, vLLM's select loaded or not), a 4-KV-head / budget-4096 variant and a small model; the hyper-connection mixer's decode launches at every token count against vLLM's capture sizes.
No GPU: nothing
is compiled or launched. Needs the Triton beside the venv (``make test`` installs it in .cache/triton)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TRITON_DIR = os.environ.get("QWEN4EXP_TRITON_PATH", os.path.join(ROOT, ".cache", "triton"))

pytestmark = pytest.mark.skipif(
    not os.path.isdir(os.path.join(TRITON_DIR, "triton")),
    reason=f"no Triton for the offline kernel checks in {TRITON_DIR} (`make test` installs it there)")


def test_warm_up_covers_every_serving_launch_key(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TRITON_DIR, ROOT]), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, os.path.join(HERE, "launch_keys.py")], env=env, capture_output=True,
                       text=True, timeout=1200)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-12000:]
    assert "OK: 0 serving launch keys" in out, out[-4000:]
    # the kernels vLLM's JIT monitor named were among those checked
    for kernel in ("_qsa_merge_kernel", "_qsa_score_prefill_kernel", "_qsa_topk_small_kernel", "_rms_norm_kernel",
                   "_qsa_score_paged_kernel", "_qsa_attn_loop_kernel", "_qsa_attn_kernel"):
        assert f"FN-24L, vLLM select loaded: {kernel}:" in out, (kernel, out[-4000:])
    for kernel in ("_hc_down_kernel", "_hc_up_kernel"):  # (FN-24L's JIT monitor named both mid-serving)
        assert f"hyper-connection mixer: {kernel}:" in out, (kernel, out[-4000:])
