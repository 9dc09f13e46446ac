"""``tools/warm_modelinfo.py`` (run by ``tools/gpu_device.sh`` once a device machine) finds the classes an MTP engine
inspects, upstream's in-tree ones and ours, each once."""

import pytest

from script_loader import load_script

pytestmark = pytest.mark.vllm


def test_finds_upstream_and_our_target_and_draft_classes():
    import qwen4exp.vllm as plugin

    plugin.register()  # as any earlier test in the process may have: upstream's must still be found
    wm = load_script("warm_modelinfo")
    found = wm.entries()
    mods = {label: f"{e.module_name}:{e.class_name}" for label, e in found.items()}
    assert mods["ours Qwen4ExpForConditionalGeneration"] == "qwen4exp.vllm.model:Qwen4ExpForConditionalGeneration"
    assert mods["ours Qwen4ExpMTP"] == "qwen4exp.vllm.mtp:Qwen4ExpMTP"
    upstream = {k: v for k, v in mods.items() if k.startswith("upstream")}
    assert set(upstream) == {"upstream Qwen4ExpForConditionalGeneration", "upstream Qwen4ExpMTP"}, mods
    assert all(v.startswith("vllm.") for v in upstream.values()), upstream
    assert len(set(mods.values())) == len(mods)  # each class once
