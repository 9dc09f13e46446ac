"""The GPU suite's parts sharing one GPU (``SUITE_SHARE=1`` in tools/gpu_device.sh sets QWEN4EXP_TEST_GPU_SHARE=1):
every test engine on CUDA then asks vLLM for a small share of the GPU and a fixed KV cache, which also skips vLLM's
memory profiling (its check fails when another process frees GPU memory meanwhile). Off the GPU, or unset: the
engine arguments are left as they are."""

import torch
import vllm_offline as V


def test_unset_or_cpu_leaves_the_engine_alone(monkeypatch):
    eng = {"dtype": "bfloat16", "gpu_memory_utilization": 0.5}
    monkeypatch.delenv("QWEN4EXP_TEST_GPU_SHARE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert V.shared_engine(eng) == eng and V.shared_serve_args(["--x"]) == ["--x"]
    monkeypatch.setenv("QWEN4EXP_TEST_GPU_SHARE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert V.shared_engine(eng) == eng and V.shared_serve_args(["--x"]) == ["--x"]


def test_share_on_cuda_takes_a_small_share_and_a_fixed_kv_cache(monkeypatch):
    monkeypatch.setenv("QWEN4EXP_TEST_GPU_SHARE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    eng = {"dtype": "bfloat16", "gpu_memory_utilization": 0.5, "num_gpu_blocks_override": 48}
    got = V.shared_engine(eng)
    assert got["gpu_memory_utilization"] == V.SHARE_GPU_UTIL < 0.5 and got["kv_cache_memory_bytes"] == V.SHARE_KV_BYTES
    assert got["num_gpu_blocks_override"] == 48 and eng["gpu_memory_utilization"] == 0.5  # (a copy)
    assert V.shared_engine({"gpu_memory_utilization": 0.1})["gpu_memory_utilization"] == 0.1  # never more
    args = V.shared_serve_args(["m", "--max-model-len", "2048"])
    i = args.index("--gpu-memory-utilization")
    assert float(args[i + 1]) == V.SHARE_GPU_UTIL and int(args[args.index("--kv-cache-memory-bytes") + 1]) > 0
