"""NVFP4 on a CUDA GPU (issue 24 item 5): checkpoints made by our writer (``qwen4exp.quant.export``, what the recipe
writes) served by our plugin through vLLM's own NVFP4 MoE method and by upstream's in-tree qwen4_exp
(``QWEN4EXP_VLLM=0``), each teacher-forced against our HF reference's fp32 logits on the same checkpoint (dequantized),
greedy tokens of the two compared; the upstream anchor's quantization_config (dummy weights) in both. Each test runs
``tools/vllm_gpu_check.py`` on one model (one device call each); needs the CUDA build of vLLM (on Hopper with
humming-kernels, vLLM picks its HUMMING NVFP4 MoE backend).

Measured on the H200 (docs/performance.md, "NVFP4"): upstream refuses the trained tiny-coder for its QSA kernels'
widths (top-k 512, 1024 or 2048 blocks: tiny-coder selects 16; with ``coder-k512``'s 512 blocks, its indexer kernel
takes head dim 128 only: tiny-coder's is 64), so greedy tokens of ours and upstream are compared on the FN-shaped
random model, wherever bf16 can decide them."""

import ast
import csv
import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's CUDA build")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(ROOT, "tools", "vllm_gpu_check.py")
FLA = os.path.join(ROOT, ".whl", "fla")  # fla-core, when carried: the HF reference's GDN kernels (else torch)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """One --out for the module: fn4-nvfp4 is built (and its HF reference computed) once."""
    return tmp_path_factory.mktemp("nvfp4")


def check(model: str, out) -> dict:
    # 200 s an engine run alone; more when the suite's parts share the GPU and the host (SUITE_SHARE=1 sets it)
    limit = float(os.environ.get("QWEN4EXP_CHECK_TIMEOUT", 200))
    env = dict(os.environ, QWEN4EXP_CHECK_EAGER="1", QWEN4EXP_CHECK_TIMEOUT=str(limit))
    if os.path.isdir(FLA):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [FLA, env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, CHECK, "--out", str(out), "--models", model, "--impls", "ours,upstream"],
                       env=env, capture_output=True, text=True, timeout=2.7 * limit)
    print(p.stdout[-4000:])
    assert p.returncode == 0, p.stderr[-4000:]
    return {r["impl"]: r for r in csv.DictReader(open(out / "results.csv"))}


def _native_backend(r):
    assert r["moe_backend"].startswith("NVFP4:"), r  # vLLM's NVFP4 MoE method ran, not a dequantized fallback
    if torch.cuda.get_device_capability()[0] == 9:
        assert r["moe_backend"] in ("NVFP4:HUMMING", "NVFP4:MARLIN"), r  # Hopper: weight-only FP4


def test_fn_shaped_nvfp4_in_ours_and_upstream(out):
    """Both engines load the checkpoint our writer made from an FN-shaped random model and are no worse than the HF
    reference's bf16 run where bf16 can decide (random weights: greedy tokens part at near ties, reported only)."""
    rows = check("fn4-nvfp4", out)
    for impl in ("ours", "upstream"):
        r = rows[impl]
        assert not r["error"], r
        _native_backend(r)
        assert r["no_worse_decisive"] == "True" and int(r["decisive"]) > 0, r
    # same greedy tokens wherever bf16 can decide: the two engines' continuations may part only at a step whose fp32
    # top-2 gap is a near tie (both ran the same context up to there)
    parted = ast.literal_eval(rows["ours"]["greedy_parted_decisive_vs_upstream"])
    assert len(parted) == 4 and not any(parted), rows["ours"]
    print("greedy tokens equal before the first difference, ours vs upstream:",
          rows["ours"]["greedy_match_len_vs_upstream"], "fp32 gap there:", rows["ours"]["greedy_parted_gap_vs_upstream"],
          "decisive threshold:", rows["ours"]["decisive_gap"])


# what upstream vLLM 0.32's QSA kernels refuse at the trained tiny-coder's widths (H200, run 17): its indexer top-k
# takes 512, 1024 or 2048 blocks, its DSL indexer kernel head dim 128 only (tiny-coder's is 64)
UPSTREAM_WIDTH_REFUSALS = (r"persistent_topk supports k=", r"DSL kernel only supports D=128")


def test_trained_tiny_coder_nvfp4_in_ours_and_upstream(out):
    """Ours serves the trained tiny-coder's NVFP4 checkpoint through vLLM's NVFP4 MoE, no worse than HF bf16. Upstream
    gives the same greedy tokens, or refuses the model for its QSA kernels' widths (and for nothing else: an NVFP4
    loading error fails this test); the FN-shaped model above is then where the two are compared."""
    rows = check("coder-k512-nvfp4", out)
    ours, up = rows["ours"], rows["upstream"]
    assert not ours["error"], ours
    _native_backend(ours)
    assert ours["no_worse_decisive"] == "True" and int(ours["decisive"]) > 0, ours
    if up["error"]:
        assert any(re.search(r, up["error"]) for r in UPSTREAM_WIDTH_REFUSALS), up
        print("upstream refuses tiny-coder's widths:", up["error"])
        return
    _native_backend(up)
    match = json.loads(ours["greedy_match_len_vs_upstream"])
    assert all(m == 16 for m in match), match


def test_anchor_config_loads_in_ours_and_upstream(out):
    rows = check("fn4-anchor", out)
    for impl in ("ours", "upstream"):
        assert not rows[impl]["error"], rows[impl]
        _native_backend(rows[impl])
        assert int(rows[impl]["generated"]) > 0, rows[impl]


def test_fn_shaped_nvfp4_mtp_draft_runs_vllms_block_fp8_moe(out):
    """The MTP head's experts, block FP8 in our writer's checkpoint, load into vLLM's FP8 MoE method (the draft) and
    speculative decoding runs: the first token of each request (the target's prefill, unchanged by drafting) equals
    the plain run's; how far the rest agrees is reported (random weights: bf16 near ties)."""
    import vllm_gpu_check as C
    from vllm_offline import run_offline

    d, spec, eng = C.build("fn4-nvfp4", str(out))
    cfg = json.load(open(os.path.join(d, "config.json")))
    layers = cfg["quantization_config"]["quantized_layers"]
    assert any(k.startswith("mtp.") and v["quant_algo"] == "FP8_PB_WO" for k, v in layers.items()), layers
    eos = cfg["eos_token_id"][0] if isinstance(cfg["eos_token_id"], list) else cfg["eos_token_id"]
    prompts = C._prompts(cfg["vocab_size"], eos, spec[2:])
    engine = dict(dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_num_seqs=8, seed=0,
                  enable_prefix_caching=False, gpu_memory_utilization=0.5, disable_log_stats=False, **eng)
    sampling = dict(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    plain = run_offline(dict(model=d, engine=engine, prompts=prompts, sampling=sampling), str(out / "mtp-plain"))
    mtp = run_offline(dict(model=d, prompts=prompts, sampling=sampling, engine=dict(
        engine, speculative_config={"method": "mtp", "num_speculative_tokens": 3})), str(out / "mtp"))
    assert "Fp8 MoE backend" in mtp["log"], mtp["log"][-3000:]
    assert [t[0] for t in mtp["tokens"]] == [t[0] for t in plain["tokens"]]
    print("MTP vs plain, tokens equal before the first difference:",
          [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
           for x, y in zip(mtp["tokens"], plain["tokens"])],
          "accepted draft tokens:", mtp["metrics"].get("vllm:spec_decode_num_accepted_tokens"))
