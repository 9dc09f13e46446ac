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
