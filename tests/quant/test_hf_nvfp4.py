"""The HF reference on NVFP4 checkpoints made by our writer (``qwen4exp.quant.export``): both load modes, bit-exact
dequantization and save round trips, every bad input named, and the quality of the NVFP4 tiny-coder."""

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import qwen4exp
from qwen4exp import Qwen4ExpForCausalLM
from qwen4exp.hf.quant import QuantizedExperts
from qwen4exp.quant import QuantConfigError, QuantTensorError, parse_quant_config
from qwen4exp.quant.export import quantize_checkpoint
from qwen4exp.quant.fp8 import dequantize_fp8_block, dequantize_fp8_per_tensor
from qwen4exp.quant.nvfp4 import dequantize_nvfp4
from tests.tiny_checkpoint import build_checkpoint

from .test_config import HF_NAMES, MTP_NAMES, VLLM_NAMES

TINY_CODER = os.path.join(os.path.dirname(qwen4exp.__file__), "assets", "tiny-coder")
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny random BF16 checkpoint with an MTP head, widths multiples of 128 (so the MTP experts are block FP8),
    and its NVFP4 (W4A4, default input_scale) and W4A16 forms."""
    d = tmp_path_factory.mktemp("nvfp4")
    src = build_checkpoint(str(d / "bf16"), hidden_size=128, moe_intermediate_size=128, mtp_num_hidden_layers=1)
    quantize_checkpoint(src, d / "nvfp4")
    quantize_checkpoint(src, d / "w4a16", weight_only=True)
    return {"bf16": src, "nvfp4": str(d / "nvfp4"), "w4a16": str(d / "w4a16")}


def _raw(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same_files(a, b):
    x, y = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert set(x) == set(y)
    bad = [k for k in x if x[k].dtype != y[k].dtype or x[k].shape != y[k].shape or not torch.equal(_raw(x[k]),
                                                                                                   _raw(y[k]))]
    assert not bad, bad[:5]


def test_writer_format(ckpts):
    sd = load_file(os.path.join(ckpts["nvfp4"], "model.safetensors"))
    n = "model.layers.0.mlp.experts.3"
    assert sd[f"{n}.gate_proj.weight"].dtype == torch.uint8 and sd[f"{n}.gate_proj.weight"].shape == (128, 64)
    assert sd[f"{n}.gate_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert sd[f"{n}.gate_proj.weight_scale"].shape == (128, 8)
    assert sd[f"{n}.down_proj.weight_scale_2"].shape == () and sd[f"{n}.down_proj.input_scale"].shape == ()
    assert torch.equal(sd[f"{n}.gate_proj.weight_scale_2"], sd[f"{n}.up_proj.weight_scale_2"])  # one w13 scale
    m = "mtp.layers.0.mlp.experts.1.down_proj"
    assert sd[f"{m}.weight"].dtype == torch.float8_e4m3fn and sd[f"{m}.weight_scale_inv"].shape == (1, 1)
    assert sd["model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"].dtype == torch.float8_e4m3fn
    assert sd["model.layers.0.ple.ple_embedding.ngram_embedding.weight_scale"].shape == ()
    assert sd["model.layers.0.mlp.shared_expert.gate_proj.weight"].dtype == torch.float32  # unchanged
    assert "input_scale" not in " ".join(load_file(os.path.join(ckpts["w4a16"], "model.safetensors")))
    with open(os.path.join(ckpts["w4a16"], "config.json")) as f:
        assert json.load(f)["quantization_config"]["quantized_layers"]["model.layers.0.mlp.experts"][
            "quant_algo"] == "W4A16_NVFP4"


@pytest.mark.parametrize("composite", [False, True])
def test_writer_ignore_list_quantizes_only_the_intended_modules(composite):
    # vLLM's decision on its own module names (both layouts, the MTP draft) and ours on HF names
    from qwen4exp.quant.export import quantization_config
    lm = "model.language_model." if composite else "model."
    qc = parse_quant_config(quantization_config(
        composite, [f"{lm}layers.{i}.mlp.experts" for i in (0, 1, 3)], ["mtp.layers.0.mlp.experts"],
        [f"{lm}layers.0.ple.ple_embedding.ngram_embedding"], weight_only=False))
    hf = [n.replace("model.language_model.", lm) for n in HF_NAMES if composite or not n.startswith("model.visual")]
    got = {n: qc.layer_algo(n, "hf" if composite else "hf_text") for n in hf}
    assert {n: a for n, a in got.items() if a} == {
        f"{lm}layers.0.mlp.experts": "NVFP4", f"{lm}layers.1.mlp.experts": "NVFP4",
        f"{lm}layers.0.ple.ple_embedding.ngram_embedding": "FP8", "mtp.layers.0.mlp.experts": "FP8_PB_WO"}
    layout = "vllm_composite" if composite else "vllm_text"
    got = {n: qc.layer_algo(n, layout) for n in VLLM_NAMES[layout]}
    p = "language_model.model." if composite else "model."
    assert {n: a for n, a in got.items() if a} == {
        f"{p}layers.0.mlp.experts": "NVFP4", f"{p}layers.1.mlp.experts": "NVFP4", f"{p}layers.3.mlp.experts": "NVFP4",
        f"{p}layers.0.ple.ple_embedding.ngram_embedding": "FP8"}
    got = {n: qc.layer_algo(n, "vllm_mtp", num_hidden_layers=4) for n in MTP_NAMES}
    assert {n: a for n, a in got.items() if a} == {"mtp.layers.4.mlp.experts": "FP8_PB_WO"}


@pytest.mark.parametrize("mode", ["dequantize", "packed"])
def test_dequantized_weights_equal_the_reference(ckpts, mode):
    sd = load_file(os.path.join(ckpts["nvfp4"], "model.safetensors"))
    m = Qwen4ExpForCausalLM.from_pretrained(ckpts["nvfp4"], dtype=BF16, quant_mode=mode)
    mods = {n: x for n, x in m.named_modules() if isinstance(x, QuantizedExperts)}
    assert sorted(mods) == [f"model.layers.{i}.mlp.experts" for i in range(4)] + ["mtp.layers.0.mlp.experts"]
    for name, mod in mods.items():
        for e in range(mod.num_experts):
            gu, dn = mod.expert_weights(e)
            b = f"{name}.{e}"
            if name.startswith("mtp."):
                ref = [dequantize_fp8_block(sd[f"{b}.{p}.weight"], sd[f"{b}.{p}.weight_scale_inv"], BF16)
                       for p in ("gate_proj", "up_proj", "down_proj")]
            else:
                ref = [dequantize_nvfp4(sd[f"{b}.{p}.weight"], sd[f"{b}.{p}.weight_scale"],
                                        sd[f"{b}.{p}.weight_scale_2"], BF16) for p in ("gate_proj", "up_proj",
                                                                                      "down_proj")]
            assert gu.dtype == BF16 and torch.equal(gu, torch.cat(ref[:2])) and torch.equal(dn, ref[2])
    t = m.model.layers[0].ple.ple_embedding.ngram_embedding  # the FP8 table stays FP8, rows dequantized at lookup
    key = "model.layers.0.ple.ple_embedding.ngram_embedding"
    assert t.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize_fp8_per_tensor(t.weight[:5], t.weight_scale),
                       dequantize_fp8_per_tensor(sd[f"{key}.shard_0.weight"][:5], sd[f"{key}.weight_scale"]))


@pytest.mark.parametrize("emulate", [False, True])
def test_packed_logits_equal_dequantized_logits(ckpts, emulate):
    ids = torch.randint(3, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    a = Qwen4ExpForCausalLM.from_pretrained(ckpts["nvfp4"], dtype=BF16, emulate_w4a4=emulate)
    b = Qwen4ExpForCausalLM.from_pretrained(ckpts["nvfp4"], dtype=BF16, quant_mode="packed", emulate_w4a4=emulate)
    la, lb = a(ids).logits, b(ids).logits
    assert torch.equal(la, lb)
    if emulate:  # the activation fake-quant is on: the logits move
        assert not torch.equal(la, Qwen4ExpForCausalLM.from_pretrained(ckpts["nvfp4"], dtype=BF16)(ids).logits)
    # MTP head (block-FP8 experts) too
    ha = a(ids, return_mtp_hidden=True)["mtp_hidden"]
    assert torch.equal(a.mtp_logits(ha, ids), b.mtp_logits(ha, ids))


@pytest.mark.parametrize("which", ["nvfp4", "w4a16"])
@pytest.mark.parametrize("mode", ["dequantize", "packed"])
def test_save_load_round_trip_bit_for_bit(ckpts, tmp_path, which, mode):
    m = Qwen4ExpForCausalLM.from_pretrained(ckpts[which], quant_mode=mode)  # the checkpoint's dtype (fp32)
    m.save_pretrained(tmp_path / "a")
    _same_files(ckpts[which], tmp_path / "a")
    with open(os.path.join(ckpts[which], "config.json")) as f, open(tmp_path / "a" / "config.json") as g:
        assert json.load(f)["quantization_config"] == json.load(g)["quantization_config"]
    # in BF16 (dequantized weights rounded to bf16, re-encoded with the loaded scales): the experts round-trip too
    m = Qwen4ExpForCausalLM.from_pretrained(ckpts[which], dtype=BF16, quant_mode=mode)
    m.save_pretrained(tmp_path / "b")
    x, y = load_file(os.path.join(ckpts[which], "model.safetensors")), load_file(tmp_path / "b" / "model.safetensors")
    for k in x:
        if ".experts." in k or "ngram_embedding" in k:
            assert y[k].dtype == x[k].dtype and torch.equal(_raw(x[k]), _raw(y[k])), k
    m2 = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "b", dtype=BF16, quant_mode=mode)
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(m(ids).logits, m2(ids).logits)


def test_changed_weights_are_quantized_afresh(ckpts, tmp_path, caplog):
    m = Qwen4ExpForCausalLM.from_pretrained(ckpts["nvfp4"], dtype=BF16)
    with torch.no_grad():
        m.model.layers[1].mlp.experts.down_proj[2] *= 3
    m.save_pretrained(tmp_path)
    assert "quantized afresh" in caplog.text
    x, y = load_file(os.path.join(ckpts["nvfp4"], "model.safetensors")), load_file(tmp_path / "model.safetensors")
    k = "model.layers.1.mlp.experts.2.down_proj.weight_scale_2"
    assert torch.allclose(y[k], x[k] * 3, rtol=0.05)  # a fresh amax: of the (dequantized) weight, x3
    assert torch.equal(_raw(x[k.replace("1.mlp.experts.2", "1.mlp.experts.3")]),
                       _raw(y[k.replace("1.mlp.experts.2", "1.mlp.experts.3")]))


# -- bad inputs -----------------------------------------------------------------------------------------------------
def _variant(src, dst, edit_sd=None, edit_qc=None):
    shutil.copytree(src, dst)
    if edit_sd:
        sd = load_file(os.path.join(src, "model.safetensors"))
        edit_sd(sd)
        save_file(sd, os.path.join(dst, "model.safetensors"))
    if edit_qc:
        p = os.path.join(dst, "config.json")
        with open(p) as f:
            cfg = json.load(f)
        edit_qc(cfg["quantization_config"])
        with open(p, "w") as f:
            json.dump(cfg, f)
    return dst


E = "model.layers.1.mlp.experts.2"
MTP = "mtp.layers.0.mlp.experts.0"
PLE = "model.layers.0.ple.ple_embedding.ngram_embedding"


def _set(k, v):
    return lambda sd: sd.__setitem__(k, v(sd[k]) if callable(v) else v)


def _pop(k):
    return lambda sd: sd.pop(k)


def _fuse(sd):
    base = "model.layers.1.mlp.experts"
    sd[f"{base}.gate_up_proj"] = torch.stack([torch.cat([sd.pop(f"{base}.{e}.gate_proj.weight"),
                                                         sd.pop(f"{base}.{e}.up_proj.weight")]) for e in range(8)])


BAD = {
    "missing scale": (_pop(f"{E}.gate_proj.weight_scale"), None, QuantTensorError,
                      rf"{E}\.gate_proj\.weight_scale is missing"),
    "missing input_scale": (_pop(f"{E}.down_proj.input_scale"), None, QuantTensorError,
                            rf"{E}\.down_proj\.input_scale is missing"),
    "missing expert": (_pop(f"{E}.up_proj.weight"), None, QuantTensorError, rf"{E}\.up_proj\.weight is missing"),
    "scale dtype": (_set(f"{E}.gate_proj.weight_scale", lambda t: t.float()), None, QuantTensorError,
                    rf"{E}\.gate_proj\.weight_scale must be torch\.float8_e4m3fn"),
    "weight dtype": (_set(f"{E}.up_proj.weight", lambda t: t.to(BF16)), None, QuantTensorError,
                     rf"{E}\.up_proj\.weight must be torch\.uint8"),
    "scale shape": (_set(f"{E}.down_proj.weight_scale", lambda t: t[:, :4].contiguous()), None, QuantTensorError,
                    rf"{E}\.down_proj\.weight_scale must have shape \(128, 8\)"),
    "global scale shape": (_set(f"{E}.down_proj.weight_scale_2", lambda t: t.reshape(1).repeat(2)), None,
                           QuantTensorError, rf"{E}\.down_proj\.weight_scale_2 must be a per-tensor scalar"),
    "global scale value": (_set(f"{E}.down_proj.weight_scale_2", lambda t: t * 0), None, QuantTensorError,
                           rf"{E}\.down_proj\.weight_scale_2 must be finite and > 0"),
    "unknown tensor": (_set(f"{E}.down_proj.k_scale", torch.tensor(1.0)), None, Exception,
                       rf"{E}\.down_proj\.k_scale"),
    "expert index": (lambda sd: sd.update({k.replace(".experts.2.", ".experts.8."): v.clone()
                                           for k, v in list(sd.items()) if k.startswith(E + ".")}), None,
                     QuantTensorError,
                     r"model\.layers\.1\.mlp\.experts\.8: expert index out of range \(the model has 8 experts\)"),
    "fused NVFP4": (_fuse, None, QuantTensorError, r"model\.layers\.1\.mlp\.experts\.gate_up_proj: quantized routed "
                                                   r"experts must be stored per expert"),
    "mtp scale missing": (_pop(f"{MTP}.down_proj.weight_scale_inv"), None, QuantTensorError,
                          rf"{MTP}\.down_proj\.weight_scale_inv is missing"),
    "mtp scale shape": (_set(f"{MTP}.gate_proj.weight_scale_inv", lambda t: t.repeat(2, 1)), None, QuantTensorError,
                        rf"{MTP}\.gate_proj\.weight_scale_inv must have shape \(1, 1\)"),
    "ple scale missing": (_pop(f"{PLE}.weight_scale"), None, QuantTensorError, rf"{PLE}\.weight_scale is missing"),
    "unknown algo": (None, lambda q: q.__setitem__("quant_algo", "NVFP8"), QuantConfigError,
                     r"quantization_config\.quant_algo: unsupported quant_algo 'NVFP8'"),
    "layer algo": (None, lambda q: q["quantized_layers"]["model.layers.1.mlp.experts"].__setitem__(
        "quant_algo", "INT4_AWQ"), QuantConfigError,
        r"quantized_layers\.model\.layers\.1\.mlp\.experts\.quant_algo: unsupported quant_algo 'INT4_AWQ'"),
    "group size": (None, lambda q: q.__setitem__("group_size", 32), QuantConfigError,
                   r"quantization_config\.group_size: NVFP4 is served with group size 16 only"),
    "experts as FP8": (None, lambda q: q["quantized_layers"]["model.layers.1.mlp.experts"].update(quant_algo="FP8"),
                       QuantConfigError, r"quant_algo 'FP8' for routed experts model\.layers\.1\.mlp\.experts"),
    "excluded but quantized": (None, lambda q: q["ignore"].append("model.layers.1.mlp.experts*"), QuantTensorError,
                               r"model\.layers\.1\.mlp\.experts\.0\.\w+\.\w+: the checkpoint stores "
                               r"model\.layers\.1\.mlp\.experts quantized, but it keeps it unquantized"),
    "NVFP4 PLE table": (None, lambda q: q["quantized_layers"][PLE].update(quant_algo="NVFP4"), QuantConfigError,
                        rf"quant_algo 'NVFP4' for the PLE table {PLE}"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_named(ckpts, tmp_path, case):
    edit_sd, edit_qc, exc, msg = BAD[case]
    d = _variant(ckpts["nvfp4"], str(tmp_path / "bad"), edit_sd, edit_qc)
    with pytest.raises(exc, match=msg):
        Qwen4ExpForCausalLM.from_pretrained(d, quant_mode="packed" if "mtp" in case else "dequantize")


def test_bad_options(ckpts):
    with pytest.raises(QuantConfigError, match=r"emulate_w4a4=True needs NVFP4 \(W4A4\) routed experts"):
        Qwen4ExpForCausalLM.from_pretrained(ckpts["w4a16"], emulate_w4a4=True)
    with pytest.raises(QuantConfigError, match=r"emulate_w4a4=True needs a quantized"):
        Qwen4ExpForCausalLM.from_pretrained(ckpts["bf16"], emulate_w4a4=True)
    with pytest.raises(ValueError, match=r"quant_mode must be one of dequantize, packed"):
        Qwen4ExpForCausalLM.from_pretrained(ckpts["nvfp4"], quant_mode="fp4")


# -- the trained tiny-coder --------------------------------------------------------------------------------------------
PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if',
           "import os\n\n\ndef list_python_files(path):\n    return [",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"]


def _windows(tok, split, n, seq=192):
    from tests.script_loader import load_script
    T = load_script("tokenizer_tiny")
    ids = []
    for rel in T.corpus_files(split):
        text = T.read_file(rel)
        if text:
            ids += tok(text)["input_ids"] + [0]
        if len(ids) >= n * seq:
            break
    if len(ids) < n * seq:
        pytest.skip("not enough stdlib text on this machine")
    return torch.tensor(ids[: n * seq]).view(n, seq)


@torch.no_grad()
def test_tiny_coder_nvfp4_quality(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(TINY_CODER)
    held = _windows(tok, "heldout", 8, 128)
    calib = _windows(tok, "train", 4, 128)
    quantize_checkpoint(TINY_CODER, tmp_path / "w4a4", calibration=list(calib))
    quantize_checkpoint(TINY_CODER, tmp_path / "wo", weight_only=True)
    ref = Qwen4ExpForCausalLM.from_pretrained(TINY_CODER, dtype=BF16)
    models = {"BF16": ref,
              "NVFP4 weight-only": Qwen4ExpForCausalLM.from_pretrained(tmp_path / "wo", dtype=BF16),
              "NVFP4 W4A4": Qwen4ExpForCausalLM.from_pretrained(tmp_path / "w4a4", dtype=BF16, emulate_w4a4=True)}
    ref_logits = ref(held, use_cache=False).logits.float()
    ref_top = ref_logits[:, :-1].argmax(-1)
    greedy = {}
    figures = {}
    for name, m in models.items():
        lg = ref_logits if m is ref else m(held, use_cache=False).logits.float()
        ce = F.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), held[:, 1:].reshape(-1)).item()
        agree = (lg[:, :-1].argmax(-1) == ref_top).float().mean().item()
        figures[name] = (ce, agree)
        greedy[name] = [m.generate(torch.tensor([tok(p)["input_ids"]]), max_new_tokens=16, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, -16:].tolist() for p in PROMPTS]
    print(f"\ntiny-coder, {held.numel()} held-out tokens:")
    for name, (ce, agree) in figures.items():
        # greedy: how many of the 16 new tokens each prompt keeps equal to BF16's before the first difference
        same = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(g))
                for g, r in zip(greedy[name], greedy["BF16"])]
        print(f"  {name:18s} perplexity {torch.tensor(ce).exp().item():7.3f} (CE {ce:.4f})  top-1 vs BF16 "
              f"{agree:.3f}  greedy prefix equal to BF16's (of 16) {same}")
    for p, g in zip(PROMPTS, greedy["NVFP4 W4A4"]):
        print(f"  W4A4 {p[:30]!r} -> {tok.decode(g)!r}")
    base = figures["BF16"][0]
    for name in ("NVFP4 weight-only", "NVFP4 W4A4"):
        ce, agree = figures[name]
        assert agree > 0.8 and ce < base + 0.25, (name, ce, agree)
