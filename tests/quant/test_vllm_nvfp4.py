"""The vLLM plugin on ModelOpt NVFP4 checkpoints made by our writer (``qwen4exp.quant.export``), on CPU: vLLM has
no NVFP4 (nor block-FP8) MoE here, so the plugin dequantizes the routed experts at load (``qwen4exp.vllm.quant``).

* the MIXED_PRECISION form (NVFP4 W4A4 experts, block-FP8 MTP experts, FP8 PLE table) is served exactly as the same
  checkpoint dequantized to BF16 (identical prompt logprobs and tokens: batched, chunked prefill, prompts beyond the
  QSA budget and with EOS inside); it and the plain W4A16_NVFP4 form meet the bf16 bar against the HF reference's
  fp32 logits on the same checkpoint (vLLM serves ModelOpt checkpoints in bf16 / fp16 only);
* the experts' served weights are vLLM's own dequantization of the checkpoint tensors, bit for bit (an independent
  oracle: ``dequantize_to_dtype`` / ``scaled_dequantize``), and so are the HF reference's; the PLE table stays FP8;
* MTP speculative decoding with the block-FP8 draft experts gives the plain greedy tokens;
* ``qwen4exp-serve`` on the NVFP4 tiny-coder answers with the HF reference's greedy tokens;
* a broken checkpoint fails the load with an error naming the tensor or field.
"""

import json
import os
import shutil

import pytest
import torch
from prompts import prompt
from safetensors.torch import load_file, save_file

import qwen4exp
from qwen4exp import Qwen4ExpForCausalLM
from qwen4exp.quant.export import quantize_checkpoint
from tests.tiny_checkpoint import build_checkpoint

pytestmark = pytest.mark.vllm

TINY_CODER = os.path.join(os.path.dirname(qwen4exp.__file__), "assets", "tiny-coder")
GEN = 8
# vLLM serves ModelOpt checkpoints in bf16 / fp16 only
ENGINE = dict(dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=8,
              max_logprobs=-1, enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=32)
DUMP = [r"layers\.0\.mlp\.experts\.", r"mtp\.layers\.0\.mlp\.experts\.", r"ngram_embedding"]


def dequantized_checkpoint(src: str, dst: str) -> str:
    """``src`` with every quantized expert projection replaced by its reference dequantization (bf16) and no
    quantization config: what the plugin must serve identically. The FP8 PLE table stays FP8 (with its scale)."""
    from qwen4exp.quant.experts import EXPERT_TENSOR, dequantize_projection, fp8_scale_name

    shutil.copytree(src, dst)
    sd = load_file(os.path.join(src, "model.safetensors"))
    groups: dict = {}
    out = {}
    for k, t in sd.items():
        m = EXPERT_TENSOR.match(k)
        if m and ("weight_scale_2" in k or "weight_scale" in k or t.element_size() == 1 or "input_scale" in k):
            groups.setdefault(k.rsplit(".", 1)[0], {})[m.group(4)] = t
        else:
            out[k] = t
    for n, f in groups.items():
        fmt = "nvfp4" if "weight_scale_2" in f else "fp8_block"
        out[f"{n}.weight"] = dequantize_projection(fmt, f, torch.bfloat16, fp8_scale_name(f)).contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as fh:
        cfg = json.load(fh)
    del cfg["quantization_config"]
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny random model with an MTP head (widths multiples of 128: block-FP8 MTP experts) in two NVFP4 forms,
    and the MIXED one dequantized."""
    d = tmp_path_factory.mktemp("vllm_nvfp4")
    src = build_checkpoint(str(d / "bf16"), hidden_size=128, moe_intermediate_size=128, mtp_num_hidden_layers=1)
    quantize_checkpoint(src, d / "mixed")  # NVFP4 W4A4 + FP8_PB_WO MTP experts + FP8 PLE: MIXED_PRECISION
    quantize_checkpoint(src, d / "w4a16", weight_only=True, mtp_experts="bf16", ple_table="bf16")  # W4A16_NVFP4
    return {"bf16": src, "mixed": str(d / "mixed"), "w4a16": str(d / "w4a16"),
            "mixed_deq": dequantized_checkpoint(str(d / "mixed"), str(d / "mixed_deq"))}


def _prompts(V, eos):
    return [prompt(n, V, eos, s, at).tolist() for n, s, at in ((300, 1, (50, 120)), (37, 2, ()), (5, 3, ()),
                                                               (140, 4, (0, 70)))]


@pytest.fixture(scope="module")
def runs(ckpts, tmp_path_factory):
    """bf16 engines on the two NVFP4 forms and on the dequantized MIXED one; the HF reference's fp32 and bf16
    logits on each NVFP4 form."""
    from vllm_offline import run_offline

    out = {}
    ref = Qwen4ExpForCausalLM.from_pretrained(ckpts["mixed"], dtype=torch.float32)
    prompts = _prompts(ref.config.vocab_size, ref.config.eos_token_id)
    for form in ("mixed", "w4a16", "mixed_deq"):
        spec = dict(model=ckpts[form], engine=ENGINE, prompts=prompts, full_prompt_logprobs=True, params=DUMP,
                    sampling=dict(temperature=0.0, max_tokens=GEN, ignore_eos=True, prompt_logprobs=-1,
                                  detokenize=False))
        out[form] = dict(res=run_offline(spec, str(tmp_path_factory.mktemp(form))), prompts=prompts)
    for form in ("mixed", "w4a16"):
        refs = {dt: Qwen4ExpForCausalLM.from_pretrained(ckpts[form], dtype=dt) for dt in (torch.float32, torch.bfloat16)}
        with torch.no_grad():
            for dt, m in refs.items():
                out[form][str(dt)] = [m(torch.tensor([p])).logits[0].float() for p in prompts]
        out[form]["ref"] = refs[torch.float32]
    return out


def _centered(lp):
    return lp - lp.mean(-1, keepdim=True)


def test_nvfp4_served_exactly_as_its_dequantized_bf16_checkpoint(runs):
    """Same engine, same weights after load: identical prompt logprobs and tokens (batched, chunked prefill, prompts
    beyond the QSA budget and with EOS inside)."""
    a, b = runs["mixed"]["res"], runs["mixed_deq"]["res"]
    assert a["tokens"] == b["tokens"]
    for i, (x, y) in enumerate(zip(a["prompt_logprobs"], b["prompt_logprobs"])):
        assert torch.equal(x, y), i


@pytest.mark.parametrize("form", ["mixed", "w4a16"])
def test_bf16_engine_vs_hf_reference_fp32(runs, form):
    """bf16 rounding alone moves argmaxes on random weights: the bar is the HF reference's own bf16 run against its
    fp32 logits on the same NVFP4 checkpoint (as tests/test_vllm_offline.py does for BF16 checkpoints)."""
    r = runs[form]
    v_wrong = b_wrong = total = 0
    for i, p in enumerate(r["prompts"]):
        f32 = r[str(torch.float32)][i][:-1]
        b16 = r[str(torch.bfloat16)][i][:-1]
        lp = r["res"]["prompt_logprobs"][i]
        err = ((_centered(lp) - _centered(torch.log_softmax(f32, -1))).norm()
               / _centered(torch.log_softmax(f32, -1)).norm()).item()
        assert err < 0.05, (form, i, err)
        top = f32.argmax(-1)
        v_wrong += int((lp.argmax(-1) != top).sum())
        b_wrong += int((b16.argmax(-1) != top).sum())
        total += top.numel()
    assert v_wrong <= b_wrong + max(2, 0.01 * total), (form, v_wrong, b_wrong, total)


def test_one_info_line_per_model_says_what_was_dequantized(ckpts, runs):
    with open(os.path.join(ckpts["mixed"], "config.json")) as f:
        n = json.load(f)["num_hidden_layers"]
    lines = [ln for ln in runs["mixed"]["res"]["log"].splitlines() if "dequantized to" in ln]
    assert len(lines) == 1, lines  # the target model (no draft in this run)
    assert f" {n} NVFP4 routed-experts module(s)" in lines[0] and "torch.bfloat16" in lines[0], lines[0]
    assert "vLLM has no NVFP4" in lines[0]
    w = [ln for ln in runs["w4a16"]["res"]["log"].splitlines() if "dequantized to" in ln]
    assert len(w) == 1 and "NVFP4" in w[0], w


def _oracle_dequant(ck: dict, base: str, e: int, p: str, dtype, vllm_oracle):
    """vLLM's own dequantization of one checkpoint projection: NVFP4 through its emulation path
    (``dequantize_to_dtype``: e2m1 * (e4m3 block scale * weight_scale_2)), block FP8 through ``scaled_dequantize``."""
    n = f"{base}.{e}.{p}"
    if f"{n}.weight_scale_2" in ck:
        w, s, s2 = ck[f"{n}.weight"], ck[f"{n}.weight_scale"], ck[f"{n}.weight_scale_2"].float().reshape(())
        return vllm_oracle.dequantize_to_dtype(w, s, s2, dtype, 16, swizzle=False)
    return vllm_oracle.scaled_dequantize(ck[f"{n}.weight"], ck[f"{n}.weight_scale_inv"],
                                         group_shape=vllm_oracle.GroupShape(128, 128), out_dtype=dtype)


def _multiset(t: torch.Tensor) -> torch.Tensor:
    return torch.sort(t.reshape(-1).float()).values


@pytest.mark.parametrize("form", ["mixed", "w4a16"])
def test_served_expert_weights_are_vllms_dequantization_bit_for_bit(ckpts, runs, form, vllm_oracle):
    """The target's experts as the engine holds them, and the HF reference's (target and block-FP8 MTP experts; the
    draft's own served copy is checked by its INFO line and tokens in the MTP test), against vLLM's dequantization.
    vLLM's CPU MoE repacks w13 / w2 (and pads the intermediate size) after loading, so each expert's served weights
    are compared as the multiset of their values, zero padding added to the oracle's."""
    ck = load_file(os.path.join(ckpts[form], "model.safetensors"))
    params = runs[form]["res"]["params"][0]
    ref = Qwen4ExpForCausalLM.from_pretrained(ckpts[form], dtype=torch.bfloat16)
    checked = []
    for base, mod in (("model.layers.0.mlp.experts", ref.model.layers[0].mlp.experts),
                      ("mtp.layers.0.mlp.experts", ref.mtp.layers[0].mlp.experts)):
        if f"{base}.0.gate_proj.weight_scale_2" not in ck and f"{base}.0.gate_proj.weight_scale_inv" not in ck:
            continue  # stored BF16 in this form
        served = base.startswith("model.")
        w13 = next((t for n, t in params.items() if n.startswith(base) and n.endswith("w13_weight")), None)
        w2 = next((t for n, t in params.items() if n.startswith(base) and n.endswith("w2_weight")), None)
        assert not served or (w13 is not None and w2 is not None), sorted(params)
        for e in range(mod.gate_up_proj.shape[0]):
            gate, up, down = (_oracle_dequant(ck, base, e, p, torch.bfloat16, vllm_oracle)
                              for p in ("gate_proj", "up_proj", "down_proj"))
            I = gate.shape[0]
            assert torch.equal(mod.gate_up_proj[e, :I], gate) and torch.equal(mod.gate_up_proj[e, I:], up), (base, e)
            assert torch.equal(mod.down_proj[e], down), (base, e)
            if served:
                want13 = torch.cat([gate.reshape(-1), up.reshape(-1),
                                    gate.new_zeros(w13[e].numel() - 2 * gate.numel())])
                want2 = torch.cat([down.reshape(-1), down.new_zeros(w2[e].numel() - down.numel())])
                assert torch.equal(_multiset(w13[e]), _multiset(want13)), (base, e)
                assert torch.equal(_multiset(w2[e]), _multiset(want2)), (base, e)
        checked.append(base)
    assert len(checked) == (2 if form == "mixed" else 1), checked


def test_ple_table_stays_fp8_with_its_scale(ckpts, runs):
    ck = load_file(os.path.join(ckpts["mixed"], "model.safetensors"))
    table = next(t for n, t in runs["mixed"]["res"]["params"][0].items() if n.endswith("ngram_embedding.weight"))
    assert table.dtype == torch.float8_e4m3fn
    shards = sorted((k for k in ck if ".ngram_embedding.shard" in k), key=lambda k: int(k.split("_")[-1].split(".")[0]))
    assert torch.equal(table.view(torch.uint8), torch.cat([ck[k] for k in shards]).view(torch.uint8))
    # W4A16 form: the table BF16, as written
    t16 = next(t for n, t in runs["w4a16"]["res"]["params"][0].items() if n.endswith("ngram_embedding.weight"))
    assert t16.dtype == torch.bfloat16


def test_mtp_block_fp8_draft_greedy_equals_plain(ckpts, runs, tmp_path):
    from vllm_offline import run_offline

    r = runs["mixed"]
    spec = dict(model=ckpts["mixed"], engine=dict(ENGINE, speculative_config={"method": "mtp",
                                                                                "num_speculative_tokens": 2}),
                prompts=r["prompts"], sampling=dict(temperature=0.0, max_tokens=GEN, ignore_eos=True, detokenize=False))
    res = run_offline(spec, str(tmp_path))
    assert res["tokens"] == r["res"]["tokens"]
    lines = [ln for ln in res["log"].splitlines() if "dequantized to" in ln]
    assert any("1 block-FP8 routed-experts module(s)" in ln for ln in lines), lines  # the draft's experts


# -- qwen4exp-serve on the NVFP4 tiny-coder ----------------------------------------------------------------------------
CODE_PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if',
                "import os\n\n\ndef list_python_files(path):\n    return [",
                "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"]


def test_served_nvfp4_tiny_coder_greedy_equals_hf_reference(tmp_path_factory):
    from served import post, serve
    from transformers import AutoTokenizer

    work = tmp_path_factory.mktemp("srv")  # (a short path: vLLM's IPC socket paths must stay under 107 bytes)
    ck = str(work / "tiny-coder-nvfp4")
    quantize_checkpoint(TINY_CODER, ck)
    tok = AutoTokenizer.from_pretrained(ck)
    ref = Qwen4ExpForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)
    want = []
    with torch.no_grad():
        for p in CODE_PROMPTS:
            ids = torch.tensor([tok(p)["input_ids"]])
            want.append(ref.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, ids.shape[1]:].tolist())
    with serve(ck, work, "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "4",
               name="tiny-coder-nvfp4") as s:
        got = []
        for p in CODE_PROMPTS:
            status, body = post(s["base"] + "/v1/completions", dict(
                model="tiny-coder-nvfp4", prompt=p, max_tokens=16, temperature=0, ignore_eos=True,
                return_token_ids=True))
            assert status == 200, body
            got.append(body["choices"][0]["token_ids"])
        log = s["log"].read_text()
    assert got == want
    assert "NVFP4 routed-experts module(s) dequantized to torch.bfloat16" in log


# -- bad checkpoints -----------------------------------------------------------------------------------------------
def _edit(src, dst, tensors=None, config=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        sd = load_file(os.path.join(src, "model.safetensors"))
        save_file(tensors(sd), os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        config(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return str(dst)


def _drop(key):
    def f(sd):
        del sd[key]
        return sd
    return f


def _extra_expert(sd):
    """A copy of the last expert of layer 1 under the next index, one past the model's experts."""
    base = "model.layers.1.mlp.experts."
    last = max(int(k[len(base):].split(".")[0]) for k in sd if k.startswith(base))
    sd.update({k.replace(f".experts.{last}.", f".experts.{last + 1}."): v.clone() for k, v in list(sd.items())
               if k.startswith(f"{base}{last}.")})
    return sd


def _exclude_experts(cfg):
    cfg["quantization_config"]["ignore"].append("*mlp.experts*")


BAD = {
    "missing_scale": (dict(tensors=_drop("model.layers.1.mlp.experts.3.up_proj.weight_scale_2")),
                      r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight_scale_2 is missing"),
    "expert_index": (dict(tensors=_extra_expert),
                     r"model\.layers\.1\.mlp\.experts\.\d+\.\w+_proj\.\w+: expert index out of range \(the model "
                     r"has \d+ experts\)"),
    "config_excludes_quantized": (dict(config=_exclude_experts),
                                  r"stores model\.layers\.\d\.mlp\.experts quantized, but its quantization config "
                                  r"keeps it unquantized"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_fails_naming_the_tensor(ckpts, tmp_path, case):
    from vllm_offline import run_offline

    edit, msg = BAD[case]
    bad = _edit(ckpts["w4a16"], tmp_path / "bad", **edit)
    spec = dict(model=bad, engine=ENGINE, prompts=[[1, 2, 3]], sampling=dict(max_tokens=1))
    with pytest.raises(RuntimeError, match=msg):
        run_offline(spec, str(tmp_path / "run"))
