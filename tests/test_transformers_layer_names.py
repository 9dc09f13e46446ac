"""transformers before 5.18 (5.16.1, 5.17: within upstream vLLM 0.32's range) calls the QSA layers
"qwen_sparse_attention" and its config validator refuses "indexed_attention". The configs then write that name, read
either, and build and run the model. Simulated in a fresh interpreter: the installed transformers' allowed list
and legacy-name map patched to 5.16.1's before qwen4exp is imported."""

import json
import subprocess
import sys

SCRIPT = r"""
import json, os, sys, tempfile
from transformers import configuration_utils as cu
old = tuple(t for t in cu.ALLOWED_ATTN_LAYER_TYPES if t != "indexed_attention") + ("qwen_sparse_attention",)
cu.ALLOWED_ATTN_LAYER_TYPES = old
cu.ALLOWED_LAYER_TYPES = old + cu.ALLOWED_MLP_LAYER_TYPES
for k in ("qwen_sparse_attention", "deepseek_sparse_attention"):  # (5.18+ remaps these old names; 5.16.1 does not)
    getattr(cu, "_LEGACY_LAYER_TYPE_REMAP", {}).pop(k, None)
import torch
from qwen4exp import Qwen4ExpForCausalLM, presets
from qwen4exp.configuration import INDEXED, Qwen4ExpTextConfig
out = {"indexed": INDEXED}
cfg = presets.tiny_text()
cfg.validate()
out["types"] = sorted(set(cfg.layer_types))
d = tempfile.mkdtemp()
cfg.save_pretrained(d)
out["written"] = sorted(set(json.load(open(os.path.join(d, "config.json")))["layer_types"]))
raw = cfg.to_dict()
raw["layer_types"] = ["indexed_attention" if t == INDEXED else t for t in raw["layer_types"]]  # a 5.18+ file
out["read_new_name"] = Qwen4ExpTextConfig(**{k: v for k, v in raw.items() if k not in ("transformers_version",
                                                                                        "model_type")}).layer_types == cfg.layer_types
torch.manual_seed(0)
m = Qwen4ExpForCausalLM(cfg).eval()
with torch.no_grad():
    out["finite"] = bool(torch.isfinite(m(torch.tensor([[3, 4, 5, 6, 7, 8, 9]])).logits).all())
print(json.dumps(out))
"""


def test_configs_and_model_under_the_pre_5_18_layer_name():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["indexed"] == "qwen_sparse_attention"
    assert out["types"] == out["written"] == ["linear_attention", "qwen_sparse_attention"]
    assert out["read_new_name"] and out["finite"]
