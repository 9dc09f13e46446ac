"""Nothing of ours compiles while serving: after vLLM's start-up (our QSA warm-up included) a batch of long and short
prompts, chunked prefill beside decodes, with MTP verifications and drafts, must make vLLM's kernel JIT monitor
report no Triton kernel of ``qwen4exp.ops`` ("Triton kernel JIT compilation during inference: NAME"). On the trained
tiny-coder with vLLM's GDN (its Triton prefill: FlashInfer's takes 128-wide heads only), so that FULL CUDA graphs
serve the decode and MTP steps as on the real model.

On a GPU machine with the gpu-vllm kit's venv:  python -m pytest -m gpu tests/gpu/test_warmup_gpu.py -q
"""

import importlib
import os
import pkgutil
import random
import re

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's CUDA build")]

CKPT = os.path.join(os.path.dirname(__file__), "..", "..", "qwen4exp", "assets", "tiny-coder")


def our_triton_kernels() -> set[str]:
    """Names of every Triton kernel defined anywhere under ``qwen4exp.ops`` (an op's kernels may sit in modules per
    stage beside its ``triton_kernel``, as QSA's do)."""
    import triton

    import qwen4exp.ops as ops

    names = set()
    for info in pkgutil.walk_packages(ops.__path__, prefix="qwen4exp.ops."):
        try:
            mod = importlib.import_module(info.name)
        except ImportError:
            continue
        for name, v in vars(mod).items():
            if isinstance(v, triton.runtime.KernelInterface):
                names.add(getattr(getattr(v, "fn", v), "__name__", name))
    return names


def jit_during_inference(log: str) -> list[str]:
    return re.findall(r"JIT compilation during inference: ([A-Za-z0-9_]+)", log)


def test_jit_parser_and_kernel_names():
    names = our_triton_kernels()
    assert {"_index_update_kernel", "_qsa_merge_kernel"} <= names, sorted(names)
    line = "WARNING [jit_monitor.py:140] Triton kernel JIT compilation during inference: _qsa_merge_kernel. This"
    assert jit_during_inference(line) == ["_qsa_merge_kernel"]


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp3"])
def test_no_plugin_kernel_compiles_while_serving(tmp_path, mtp):
    from vllm_offline import run_offline

    rng = random.Random(0)
    lens = [3000, 1777, 513, 64, 9, 1]  # past the QSA budget, odd lengths, a single token
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in lens]
    engine = dict(dtype="bfloat16", skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=8,
                  enable_chunked_prefill=True, max_num_batched_tokens=1024, gdn_prefill_backend="triton")
    if mtp:
        engine["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 3}
    spec = dict(model=CKPT, prompts=prompts, engine=engine, env={"QWEN4EXP_VLLM_GDN": "vllm"},
                sampling=dict(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False))
    out = run_offline(spec, str(tmp_path), timeout=600)
    log = out["log"]
    assert "Kernel JIT monitor activated" in log, log[-3000:]
    assert "qwen4exp QSA: prefill and eager decode kernels warmed up" in log, log[-3000:]
    ours = our_triton_kernels()
    compiled = jit_during_inference(log)
    print("compiled while serving:", compiled)
    assert not [k for k in compiled if k in ours], compiled
