"""Faults at load (issue 28 item 3): broken copies of the embedded tiny-coder checkpoint fail in
``qwen4exp.checkpoint.validate_checkpoint`` before anything is allocated, with one error naming the file, tensor or
field: through the HF loader (``from_pretrained``), through ``qwen4exp-serve`` (exit status 1, one line, before vLLM
starts) and through the vLLM plugin's config hook (while vLLM builds its config, before the engine starts)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen4exp import Qwen4ExpForCausalLM
from qwen4exp.checkpoint import validate_checkpoint
from qwen4exp.demo import ASSET

ST = "model.safetensors"


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "tiny-coder"
    shutil.copytree(ASSET, d, ignore=shutil.ignore_patterns("train_stats.json", "README.md"))
    return d


def edit_config(d, **fields):
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in fields.items():
        if v is _DROP:
            del cfg[k]
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


_DROP = object()


def shard(d, n_files=2):
    """Rewrite ``d``'s single file as ``n_files`` shards with a ``model.safetensors.index.json``."""
    sd = load_file(str(d / ST))
    names = sorted(sd)
    wm = {}
    for i in range(n_files):
        fname = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        part = {k: sd[k] for k in names[i::n_files]}
        save_file(part, str(d / fname), metadata={"format": "pt"})
        wm.update(dict.fromkeys(part, fname))
    (d / ST).unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return wm


def hf_load(d):
    return Qwen4ExpForCausalLM.from_pretrained(str(d), dtype=torch.float32)


def test_intact_copy_and_sharded_copy_load(ckpt):
    ref = hf_load(ASSET)
    shard(ckpt)
    m = hf_load(ckpt)
    assert validate_checkpoint(ckpt).vocab_size == 2048
    for (k, a), (_, b) in zip(ref.state_dict().items(), m.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("field,value,msg", [
    ("hidden_size", "big", "must be int, got 'big'"),
    ("num_hidden_layers", 1.5, "must be int, got 1.5"),
    ("num_experts", None, "must be int, got null"),
    ("ple_layer_ids", ["1"], r"must be list\[int\] \| None, got \['1'\]"),
    ("rms_norm_eps", "tiny", "must be float, got 'tiny'"),
    ("hidden_size", -1, "must be > 0, got -1"),
    ("rms_norm_eps", -1, "must be > 0, got -1"),
    ("rms_norm_eps", 0.0, "must be > 0, got 0.0"),
    ("layer_types", ["linear_attention", "indexed_attention", "linear_attention"],
     "has 3 entries but num_hidden_layers is 4"),
    ("indexer_budget", 66, "66 is not divisible by indexer_compress_ratio 4"),
    ("hidden_size", _DROP, "is required in a checkpoint's config.json"),
    ("vocab_size", _DROP, "is required in a checkpoint's config.json"),
])
def test_bad_config_field_named(ckpt, field, value, msg):
    edit_config(ckpt, **{field: value})
    with pytest.raises(ValueError, match=rf"config.json: Qwen4Exp config field `{re.escape(field)}`: {msg}"):
        hf_load(ckpt)


def test_invalid_json_names_the_file(ckpt):
    (ckpt / "config.json").write_text('{"hidden_size": 192,,}')
    with pytest.raises(ValueError, match=rf"{re.escape(str(ckpt / 'config.json'))}: not valid JSON \(.*line 1"):
        hf_load(ckpt)


def test_truncated_safetensors_names_the_file(ckpt):
    p = ckpt / ST
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size - 4096)
    with pytest.raises(ValueError, match=rf"{re.escape(str(p))}: truncated safetensors file: tensor \S+ ends at "
                                         rf"data byte \d+, the file holds \d+ data bytes"):
        hf_load(ckpt)
    with open(p, "r+b") as f:  # cut inside the header
        f.truncate(100)
    with pytest.raises(ValueError, match=rf"{re.escape(str(p))}: truncated safetensors file \(its header is"):
        hf_load(ckpt)


def test_missing_shard_named(ckpt):
    wm = shard(ckpt)
    gone = sorted(set(wm.values()))[1]
    (ckpt / gone).unlink()
    with pytest.raises(ValueError, match=rf"model.safetensors.index.json names shard {gone}, which is missing"):
        hf_load(ckpt)


def test_index_tensor_no_shard_holds(ckpt):
    wm = shard(ckpt)
    idx = ckpt / "model.safetensors.index.json"
    wm["model.layers.9.mlp.gate.weight"] = sorted(set(wm.values()))[0]
    idx.write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(ValueError, match=r"places tensor model.layers.9.mlp.gate.weight in model-00001-of-00002"
                                         r".safetensors, which does not hold it"):
        hf_load(ckpt)


@pytest.mark.parametrize("name,change,msg", [
    ("model.hyper_connection_mixer.hc_norm.weight", lambda t: t.to(torch.int32),
     "has dtype I32, expected a float dtype"),
    ("model.layers.0.ple.ple_embedding.layer_multipliers", lambda t: t.float(), "has dtype F32, expected an integer"),
    ("lm_head.weight", lambda t: t[:-1], r"has shape \[2047, 192\], the config implies \[2048, 192\]"),
    ("model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight", lambda t: t[:-8],
     r"its 4 shard\(s\) hold 16024 rows, the config implies 16032"),
])
def test_bad_tensor_named(ckpt, name, change, msg):
    sd = load_file(str(ckpt / ST))
    sd[name] = change(sd[name]).contiguous()
    save_file(sd, str(ckpt / ST), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{re.escape(name.rsplit('.shard_', 1)[0])}.* {msg}"):
        hf_load(ckpt)


def test_missing_and_unexpected_tensor_named(ckpt):
    sd = load_file(str(ckpt / ST))
    sd["model.layers.7.mlp.gate.weight"] = sd["model.layers.0.mlp.gate.weight"].clone()
    save_file(sd, str(ckpt / ST), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensor model.layers.7.mlp.gate.weight \(in model.safetensors\)"):
        hf_load(ckpt)
    del sd["model.layers.7.mlp.gate.weight"], sd["model.layers.2.linear_attn.dt_bias"]
    save_file(sd, str(ckpt / ST), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model.layers.2.linear_attn.dt_bias"):
        hf_load(ckpt)


def test_tokenizer_larger_than_vocab(ckpt):
    p = ckpt / "tokenizer.json"
    tok = json.loads(p.read_text())
    tok["added_tokens"].append({"id": 2500, "content": "<extra>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    p.write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"tokenizer .*tokenizer.json has 2501 token ids, more than the model's "
                                         r"vocab_size 2048"):
        hf_load(ckpt)


def serve_cli(d, *extra):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "qwen4exp.serve", str(d), "--port", "1", *extra], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, QWEN4EXP_CACHE_DIR=str(d.parent / "cache")))
    return p, time.monotonic() - t0


@pytest.mark.parametrize("fault", ["hidden_size", "truncated"])
def test_serve_exits_with_one_line(ckpt, fault):
    if fault == "hidden_size":
        edit_config(ckpt, hidden_size=-1)
        want = "Qwen4Exp config field `hidden_size`: must be > 0, got -1"
    else:
        with open(ckpt / ST, "r+b") as f:
            f.truncate(1_000_000)
        want = f"{ckpt / ST}: truncated safetensors file"
    p, dt = serve_cli(ckpt)
    assert p.returncode == 1, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwen4exp-serve: bad checkpoint: ") and want in lines[0], lines
    assert "Traceback" not in p.stderr + p.stdout
    print(f"qwen4exp-serve exited in {dt:.1f} s")


@pytest.mark.vllm
@pytest.mark.parametrize("fault", ["hidden_size", "dtype"])
def test_vllm_config_hook_rejects_before_the_engine(ckpt, fault):
    """vLLM's own entry (no qwen4exp-serve pre-check): the plugin's config hook fails while vLLM builds its
    config, naming the field / tensor (before: hidden_size -1 died ~24 s later in vLLM's buffer allocation)."""
    from vllm.engine.arg_utils import EngineArgs

    from qwen4exp.vllm import CheckpointRejected

    if fault == "hidden_size":
        edit_config(ckpt, hidden_size=-1)
        want = "config field `hidden_size`: must be > 0, got -1"
    else:
        sd = load_file(str(ckpt / ST))
        sd["model.layers.1.self_attn.k_proj.weight"] = sd["model.layers.1.self_attn.k_proj.weight"].to(torch.int8)
        save_file(sd, str(ckpt / ST), metadata={"format": "pt"})
        want = ("tensor model.layers.1.self_attn.k_proj.weight has dtype I8, expected a float dtype (BF16, F16, F32) "
                "(in model.safetensors)")
    with pytest.raises(CheckpointRejected, match=re.escape(want)):  # (not wrapped in pydantic's ValidationError)
        EngineArgs(model=str(ckpt), enforce_eager=True, max_model_len=256).create_engine_config()
