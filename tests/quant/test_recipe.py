"""recipes/quantize_nvfp4.py on the trained tiny-coder: NVIDIA ModelOpt (nvidia-modelopt 0.47, installed by
``make quant`` / ``make test``) calibrates the routed experts, our writer writes the checkpoint.

Checked: the output loads in the HF reference (both quant modes, W4A4 emulation); the input scales written are the
ones ModelOpt's calibration found, equal to our own independent observer (``calibrate_input_amax``) on the same text;
the weights are what ModelOpt's ``NVFP4QTensor.quantize`` makes with its calibrated global scales, and what our
writer makes alone; the quality table is printed and written, within bounds; weight-only and ``--calib-file`` runs;
bad input named. Without modelopt the tests fail under ``make test`` (``QWEN4EXP_REQUIRE_MODELOPT=1``) or in CI, and
skip elsewhere."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import qwen4exp
from qwen4exp import Qwen4ExpForCausalLM
from qwen4exp.quant.export import calibrate_input_amax, quantize_checkpoint
from qwen4exp.quant.nvfp4 import E2M1_MAX, E4M3_MAX
from tests.script_loader import ROOT, load_script

TINY_CODER = os.path.join(os.path.dirname(qwen4exp.__file__), "assets", "tiny-coder")
SCRIPT = os.path.join(ROOT, "recipes", "quantize_nvfp4.py")
BF16 = torch.bfloat16
LAYERS = [f"model.layers.{i}.mlp.experts" for i in range(4)]
CALIB_TOKENS = 512


def _need_modelopt():
    if importlib.util.find_spec("modelopt") is None:
        msg = "nvidia-modelopt is not installed (`make quant` installs it; `make test` does so first)"
        if os.environ.get("QWEN4EXP_REQUIRE_MODELOPT") == "1" or os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def R():
    return load_script("quantize_nvfp4")


def _run(R, argv):
    """The recipe in this process -> (summary, stdout)."""
    _need_modelopt()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        summary = R.run(R.parser().parse_args(argv + ["--device", "cpu"]))
    return summary, buf.getvalue()


@pytest.fixture(scope="module")
def w4a4(R, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("recipe") / "nvfp4")
    args = ["--model", TINY_CODER, "--out", out, "--calib-tokens", str(CALIB_TOKENS), "--modelopt-eval"]
    summary, text = _run(R, args)
    print(text)
    return {"out": out, "summary": summary, "stdout": text, "args": R.parser().parse_args(args)}


def _tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(TINY_CODER)


def test_recipe_output_loads_and_quality_is_within_bounds(w4a4):
    out, s, text = w4a4["out"], w4a4["summary"], w4a4["stdout"]
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_algo"] == "MIXED_PRECISION" and qc["producer"]["name"] == "qwen4exp recipes/quantize_nvfp4.py"
    assert {k: v["quant_algo"] for k, v in qc["quantized_layers"].items()} == {
        **{b: "NVFP4" for b in LAYERS}, "model.layers.0.ple.ple_embedding.ngram_embedding": "FP8"}
    ids = torch.randint(3, 2000, (1, 40), generator=torch.Generator().manual_seed(0))
    a = Qwen4ExpForCausalLM.from_pretrained(out, dtype=BF16, emulate_w4a4=True)
    b = Qwen4ExpForCausalLM.from_pretrained(out, dtype=BF16, emulate_w4a4=True, quant_mode="packed")
    assert torch.equal(a(ids).logits, b(ids).logits)
    # the table, printed and written
    for row in ("BF16", "NVFP4 weight-only (Hopper)", "NVFP4 W4A4 (Blackwell)"):
        assert row in text, text
    assert "--modelopt-eval: skipped: ModelOpt's NVFP4 fake-quant forward needs CUDA" in text
    with open(os.path.join(out, "quality.json")) as f:
        q = json.load(f)
    assert q["calibration"]["tokens"] == CALIB_TOKENS and q["eval"]["tokens"] == 1024
    assert set(q["quality"]) == {"BF16", "NVFP4 weight-only", "NVFP4 W4A4"}
    base = q["quality"]["BF16"]["ce"]
    assert 2.5 < base < 3.0  # the tiny-coder's held-out CE (ppl 15.5)
    for name in ("NVFP4 weight-only", "NVFP4 W4A4"):
        r = q["quality"][name]
        assert r["ce"] < base + 0.25 and r["top1_vs_bf16"] > 0.8, (name, r)
        assert f"{r['perplexity']:10.3f}" in text
    assert s["quality"]["NVFP4 W4A4"]["ce"] == q["quality"]["NVFP4 W4A4"]["ce"]


def test_model_card_says_what_the_checkpoint_is(w4a4):
    """OUT/README.md is the NVFP4 checkpoint's own card, not the BF16 checkpoint's copy: the base checkpoint, what
    is NVFP4 / FP8 / BF16, the tools and their versions, the date, the quality, how to serve it."""
    import time
    from importlib.metadata import version

    out = w4a4["out"]
    with open(os.path.join(out, "README.md")) as f:
        card = f.read()
    with open(os.path.join(TINY_CODER, "README.md")) as f:
        assert f.read() != card
    assert card.startswith("# nvfp4\n") and os.path.abspath(TINY_CODER) in card and "Qwen4ExpForCausalLM" in card
    assert f"qwen4exp {qwen4exp.__version__}" in card and f"nvidia-modelopt {version('nvidia-modelopt')}" in card
    assert "NVFP4_EXPERTS_ONLY_CFG" in card and time.strftime("%Y-%m-%d", time.gmtime()) in card
    assert "`quant_algo` MIXED_PRECISION" in card
    assert f"Routed experts (4 module(s), `{LAYERS[0]}` ...): NVFP4, E2M1 weights in groups of 16" in card
    assert f"max calibration on {CALIB_TOKENS:,} tokens of tiny-coder corpus, train split" in card
    assert "MTP head's experts: BF16 (block FP8 needs both expert dims to be multiples of 128)" in card
    assert "PLE n-gram table: FP8 (E4M3) per tensor" in card and "Everything else BF16" in card
    q = json.load(open(os.path.join(out, "quality.json")))["quality"]
    assert f"| NVFP4 W4A4 (Blackwell) | {q['NVFP4 W4A4']['perplexity']:.3f} |" in card
    assert f"vllm serve {os.path.abspath(out)} --served-model-name nvfp4" in card and "qwen4exp-serve" in card
    assert f"python recipes/quantize_nvfp4.py --model {TINY_CODER} --out {out} --calib-tokens {CALIB_TOKENS} " \
           f"--modelopt-eval" in card


def test_default_out_is_outside_the_tree(R, tmp_path, monkeypatch):
    """Without --out the checkpoint goes to qwen4exp's cache folder (checkpoints/<model>-nvfp4), never into the
    source tree (where `--out tiny-coder-nvfp4` from the repo root left an untracked folder)."""
    monkeypatch.delenv("QWEN4EXP_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert R.default_out(TINY_CODER) == str(tmp_path / "xdg" / "qwen4exp" / "checkpoints" / "tiny-coder-nvfp4")
    assert R.default_out(TINY_CODER + "/", {"QWEN4EXP_CACHE_DIR": "/c"}) == "/c/checkpoints/tiny-coder-nvfp4"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert not os.path.abspath(R.default_out(TINY_CODER)).startswith(str(ROOT) + os.sep)
    assert R.parser().parse_args(["--model", TINY_CODER]).out is None


def test_input_scales_are_modelopts_calibration(w4a4, R):
    """ModelOpt's calibrated amax per GEMM = our own observer's on the same windows; input_scale = amax / 2688."""
    s = w4a4["summary"]["scales"]
    windows = R.calibration_windows(_tokenizer(), w4a4["args"])
    assert sum(w.numel() for w in windows) == CALIB_TOKENS
    ours = calibrate_input_amax(TINY_CODER, windows)
    assert sorted(s["input_amax"]) == sorted(ours) == LAYERS
    sd = load_file(os.path.join(w4a4["out"], "model.safetensors"))
    for base in LAYERS:
        for proj, p in (("gate_up", "gate_proj"), ("gate_up", "up_proj"), ("down", "down_proj")):
            amax = s["input_amax"][base][proj]
            assert amax == ours[base][proj] > 0, (base, proj)
            for e in range(8):
                written = sd[f"{base}.{e}.{p}.input_scale"]
                assert written.dtype == torch.float32 and written.shape == ()
                assert torch.equal(written, s["input_scales"][base][proj])
                torch.testing.assert_close(written, torch.tensor(amax / (E2M1_MAX * E4M3_MAX)), rtol=1e-6, atol=0)


def test_weights_are_modelopts_nvfp4(w4a4, R, tmp_path):
    """Each expert's weight_scale_2 is ModelOpt's (amax of the weight, gate and up sharing one), and the codes and
    block scales are those of ModelOpt's NVFP4QTensor.quantize with it; the whole checkpoint is what our writer
    makes alone with its own calibration (input scales within an ulp: the two round amax / 2688 differently)."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    s = w4a4["summary"]["scales"]
    sd = load_file(os.path.join(w4a4["out"], "model.safetensors"))
    src = load_file(os.path.join(TINY_CODER, "model.safetensors"))
    for base in LAYERS:
        gu, dn = src[f"{base}.gate_up_proj"].float(), src[f"{base}.down_proj"].float()
        I = gu.shape[1] // 2
        for e in range(8):
            assert s["weight_amax"][base][e]["gate_up"] == float(gu[e].abs().max())
            w = {"gate_proj": gu[e, :I], "up_proj": gu[e, I:], "down_proj": dn[e]}
            for p, t in w.items():
                s2 = s["weight_scales_2"][base][e]["down" if p == "down_proj" else "gate_up"]
                assert torch.equal(sd[f"{base}.{e}.{p}.weight_scale_2"], s2)
                q, bs, _ = NVFP4QTensor.quantize(t, 16, weights_scaling_factor_2=s2)
                assert torch.equal(sd[f"{base}.{e}.{p}.weight"], q._quantized_data), (base, e, p)
                assert torch.equal(sd[f"{base}.{e}.{p}.weight_scale"].view(torch.uint8), bs.view(torch.uint8))
    windows = R.calibration_windows(_tokenizer(), w4a4["args"])
    quantize_checkpoint(TINY_CODER, tmp_path / "ours", calibration=windows)
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert set(ours) == set(sd)
    for k in sd:
        if k.endswith("input_scale"):
            torch.testing.assert_close(sd[k], ours[k], rtol=2 ** -23, atol=0)
        else:
            assert _same(sd[k], ours[k]), k


def _same(a, b):
    raw = (lambda t: t.view(torch.uint8)) if a.element_size() == 1 else (lambda t: t)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def test_weight_only_recipe(R, tmp_path):
    out = str(tmp_path / "w4a16")
    summary, text = _run(R, ["--model", TINY_CODER, "--out", out, "--weight-only", "--eval-tokens", "256",
                             "--mtp-experts", "bf16", "--ple-table", "bf16", "--calib-file", "/nonexistent"])
    assert "weight-only (W4A16): the weights alone, no text" in text
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_algo"] == "W4A16_NVFP4" and qc["config_groups"]["group_0"]["input_activations"] is None
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert not [k for k in sd if k.endswith("input_scale")]
    assert sd["model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"].dtype == BF16
    assert set(summary["quality"]) == {"BF16", "NVFP4 weight-only"} and "W4A4" not in text
    card = open(os.path.join(out, "README.md")).read()
    assert "`quant_algo` W4A16_NVFP4" in card and "weight-only (W4A16: activations stay BF16" in card
    assert "MTP head's experts: BF16 (`--mtp-experts bf16`)" in card
    assert "PLE n-gram table: BF16 (`--ple-table bf16`)" in card
    r = summary["quality"]["NVFP4 weight-only"]
    assert r["ce"] < summary["quality"]["BF16"]["ce"] + 0.25 and r["top1_vs_bf16"] > 0.8
    with pytest.raises(Exception, match="emulate_w4a4=True needs"):
        Qwen4ExpForCausalLM.from_pretrained(out, emulate_w4a4=True)


def test_calib_file(R, tmp_path):
    T = load_script("tokenizer_tiny")
    text = next(t for t in map(T.read_file, T.corpus_files("train")) if t and len(t) > 5000)
    f = tmp_path / "calib.txt"
    f.write_text(text)
    out = str(tmp_path / "nvfp4")
    summary, printed = _run(R, ["--model", TINY_CODER, "--out", out, "--calib-file", str(f), "--calib-tokens", "300",
                                "--eval-tokens", "0"])
    assert f"calibration: 300 tokens of {f}, 3 window(s)" in printed
    assert summary["quality"] == {} and "quality on" not in printed
    windows = R.text_windows(_tokenizer(), text, 300, 128, str(f))
    assert [w.shape[1] for w in windows] == [128, 128, 44]
    assert summary["scales"]["input_amax"] == calibrate_input_amax(TINY_CODER, windows)


def _cli(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_bad_input_is_named(w4a4, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    out, nope, missing = str(tmp_path / "o"), str(tmp_path / "nope"), str(tmp_path / "missing.txt")
    cases = [
        ((nope,), f"--model {nope}: no such directory"),
        ((str(tmp_path),), f"--model {tmp_path}: no config.json"),
        ((w4a4["out"],), f"--model {w4a4['out']}: already quantized (config.json has a quantization_config, "
                         f"quant_algo 'MIXED_PRECISION'); pass the BF16 checkpoint"),
        ((TINY_CODER, "--calib-file", str(empty)), f"--calib-file {empty}: the file is empty"),
        ((TINY_CODER, "--calib-file", missing), f"--calib-file {missing}: no such file"),
        ((TINY_CODER, "--calib-tokens", "0"), "--calib-tokens must be >= 1"),
    ]
    for (model, *extra), msg in cases:
        p = _cli("--model", model, "--out", out, *extra)
        assert p.returncode == 2 and f"quantize_nvfp4.py: error: {msg}" in p.stderr, (model, extra, p.stderr[-2000:])
    p = _cli("--model", TINY_CODER, "--out", TINY_CODER)
    assert p.returncode == 2 and f"--out {TINY_CODER}: must differ from --model" in p.stderr
    assert not os.path.exists(out)


def test_missing_modelopt_is_named(R, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "modelopt.torch.quantization", None)  # import -> ImportError
    with pytest.raises(R.RecipeError, match=r"nvidia-modelopt is not importable .*run `make quant`"):
        R.run(R.parser().parse_args(["--model", TINY_CODER, "--out", str(tmp_path / "o")]))


def test_writer_takes_precomputed_scales(tmp_path):
    """quantize_checkpoint(input_scales=..., weight_scales_2=...): what the recipe hands it, validated by name."""
    ones = {b: {"gate_up": 0.01, "down": 0.02} for b in LAYERS}
    per_expert = {b: {e: {"gate_up": 1e-4 * (e + 1), "down": 2e-4} for e in range(8)} for b in LAYERS}
    quantize_checkpoint(TINY_CODER, tmp_path / "a", input_scales=ones, weight_scales_2=per_expert,
                        producer={"name": "test", "version": "0"})
    sd = load_file(tmp_path / "a" / "model.safetensors")
    b = "model.layers.2.mlp.experts"
    assert float(sd[f"{b}.5.up_proj.weight_scale_2"]) == pytest.approx(6e-4)
    assert float(sd[f"{b}.5.down_proj.weight_scale_2"]) == pytest.approx(2e-4)
    assert float(sd[f"{b}.1.up_proj.input_scale"]) == pytest.approx(0.01)
    assert float(sd[f"{b}.1.down_proj.input_scale"]) == pytest.approx(0.02)
    bad = [
        (dict(input_scales={k: v for k, v in ones.items() if k != b}), rf"input_scales must name exactly .*missing "
                                                                       rf"\['{b}'\]"),
        (dict(input_scales={**ones, "mtp.layers.0.mlp.experts": ones[b]}),
         r"unknown \['mtp\.layers\.0\.mlp\.experts'\]"),
        (dict(input_scales={**ones, b: {"gate_up": 0.1}}), rf"input_scales\['{b}'\] must map 'gate_up' and 'down'"),
        (dict(input_scales={**ones, b: {"gate_up": 0.0, "down": 1.0}}),
         rf"input_scales\['{b}'\]\['gate_up'\] must be finite and > 0, got 0\.0"),
        (dict(weight_scales_2={**per_expert, b: {e: per_expert[b][e] for e in range(7)}}),
         rf"weight_scales_2\['{b}'\] must have one entry per expert \(8: 0\.\.7\)"),
        (dict(weight_scales_2={**per_expert, b: {**per_expert[b], 3: {"gate_up": float("inf"), "down": 1.0}}}),
         rf"weight_scales_2\['{b}'\]\[3\]\['gate_up'\] must be finite"),
        (dict(input_scales=ones, calibration=[torch.tensor([3, 4, 5])]), "either calibration .* or input_scales"),
    ]
    for kwargs, msg in bad:
        with pytest.raises(ValueError, match=msg):
            quantize_checkpoint(TINY_CODER, tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


def test_registration_replaces_modelopts_generic_fused_experts():
    """``register()`` wins over ModelOpt's auto-detected ``_QuantFusedExperts`` (whose F.linear hook would send every
    expert of a BF16 model through expert 0's quantizer, see qwen4exp/quant/modelopt_experts.py)."""
    _need_modelopt()
    from modelopt.torch.quantization.nn import QuantModuleRegistry
    from modelopt.torch.quantization.plugins.huggingface import _QuantFusedExperts

    from qwen4exp.layers.moe import Experts
    from qwen4exp.quant import modelopt_experts as mx

    mx.register()
    QuantModuleRegistry.unregister(Experts)
    QuantModuleRegistry.register({Experts: "hf.Experts"})(_QuantFusedExperts)  # what auto-detection does
    assert not issubclass(QuantModuleRegistry.get(Experts), mx.QuantExperts)
    mx.register()
    mx.register()
    assert issubclass(QuantModuleRegistry.get(Experts), mx.QuantExperts)


def test_composite_checkpoint(R, tmp_path):
    """A composite (vision + language) checkpoint: Qwen4ExpForConditionalGeneration, model.language_model.* names."""
    from qwen4exp import presets
    from qwen4exp.hf.modeling import Qwen4ExpForConditionalGeneration
    from tests.tiny_checkpoint import build_tokenizer

    src, out = str(tmp_path / "bf16"), str(tmp_path / "nvfp4")
    cfg = presets.tiny()
    torch.manual_seed(0)
    Qwen4ExpForConditionalGeneration(cfg).to(BF16).save_pretrained(src)
    build_tokenizer(src, cfg.text_config.vocab_size, int(cfg.text_config.eos_token_id), 0)
    summary, text = _run(R, ["--model", src, "--out", out, "--calib-tokens", "128", "--eval-tokens", "0"])
    assert f"loading {src} (Qwen4ExpForConditionalGeneration" in text
    lm = [f"model.language_model.layers.{i}.mlp.experts" for i in range(4)]
    assert sorted(summary["scales"]["input_scales"]) == lm
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert {k for k, v in qc["quantized_layers"].items() if v["quant_algo"] == "NVFP4"} == set(lm)
    m = Qwen4ExpForConditionalGeneration.from_pretrained(out, dtype=BF16, emulate_w4a4=True)
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(m.model.language_model.layers[1].mlp.experts.down_proj_input_scale,
                       torch.stack([sd[f"{lm[1]}.{e}.down_proj.input_scale"] for e in range(8)]))
