"""Plugin registration (idempotent, opt-out) and load-time checkpoint validation."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.vllm

_PROBE = """
import qwen4exp.vllm as plugin
from vllm.plugins import load_general_plugins
load_general_plugins()
a = plugin.register(); b = plugin.register()
from vllm import ModelRegistry
m = ModelRegistry.models
print(a, b, m["Qwen4ExpForCausalLM"].module_name, m["Qwen4ExpForConditionalGeneration"].module_name)
"""


def _probe(env_extra):
    env = dict(os.environ, **env_extra)
    p = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1].split()


def test_register_idempotent_and_replaces_in_tree():
    a, b, m1, m2 = _probe({})
    assert (a, b) == ("True", "True")
    assert m1 == m2 == "qwen4exp.vllm.model"


_HOOK = """
import types
import qwen4exp.vllm as plugin
plugin.register(); plugin._install_config_hooks()  # twice: chained once
import vllm.model_executor.models.config as mc
from vllm.config import CUDAGraphMode
from vllm.platforms import current_platform
hook = mc.MODELS_CONFIG_MAP["Qwen4ExpForCausalLM"]
assert hook._qwen4exp_hook and not getattr(hook._base, "_qwen4exp_hook", False), hook
calls = []
hook._base = type("B", (), {"verify_and_update_config": staticmethod(lambda c: calls.append(c))})
out = []
for gpu in (True, False):
    current_platform.is_cuda_alike = lambda gpu=gpu: gpu
    for mode in (None, CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL, CUDAGraphMode.NONE):
        cfg = types.SimpleNamespace(compilation_config=types.SimpleNamespace(cudagraph_mode=mode))
        hook.verify_and_update_config(cfg)
        m = cfg.compilation_config.cudagraph_mode
        out.append(m.name if m is not None else "None")
print(len(calls), " ".join(out))
"""


def test_gpu_graph_mode_hook_chains_vllm_hook_and_forces_piecewise():
    """Our eager graph segments only survive PIECEWISE (breakable) capture: the config hook turns FULL* and the
    default into PIECEWISE on GPUs, leaves NONE alone, changes nothing on CPU, and still runs vLLM's own hook."""
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-c", _HOOK], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    n, *modes = p.stdout.strip().splitlines()[-1].split()
    assert n == "8"
    assert modes == ["PIECEWISE", "PIECEWISE", "PIECEWISE", "NONE", "None", "FULL_AND_PIECEWISE", "FULL", "NONE"]


def test_opt_out_keeps_vllm_classes():
    a, b, m1, m2 = _probe({"QWEN4EXP_VLLM": "0"})
    assert (a, b) == ("False", "False")
    assert m1.startswith("vllm.") and m2.startswith("vllm.")


def _broken_checkpoint(src, dst, edit):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    sd = load_file(f)
    edit(sd)
    save_file(sd, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("kind", ["missing", "misshaped"])
def test_bad_checkpoint_fails_with_tensor_name(tiny_ckpt, tmp_path, kind):
    from qwen4exp.vllm.offline import run_offline

    name = "model.layers.1.self_attn.indexer.index_qk_proj.weight"
    if kind == "missing":
        edit = lambda sd: sd.pop(name)  # noqa: E731
    else:
        edit = lambda sd: sd.__setitem__(name, torch.zeros(sd[name].shape[0] + 1, sd[name].shape[1]))  # noqa: E731
    ck = _broken_checkpoint(tiny_ckpt, str(tmp_path / "ck"), edit)
    spec = dict(model=ck, prompts=[[2, 3]], engine=dict(dtype="bfloat16", enforce_eager=True,
                                                         skip_tokenizer_init=True, max_model_len=128),
                sampling=dict(max_tokens=1))
    with pytest.raises(RuntimeError) as e:
        run_offline(spec, str(tmp_path / "run"))
    msg = str(e.value)
    assert name in msg
    assert ("missing" in msg) if kind == "missing" else ("has shape" in msg)
