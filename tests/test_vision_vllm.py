"""Images through the vLLM plugin (``vllm.LLM``, fp32, a tiny random composite checkpoint made by upstream with a
tokenizer that has the vision tokens): greedy tokens equal our HF reference's, with chunked prefill whose chunks
end inside the images, and one or two images of different sizes per prompt; vLLM's prompt token ids (its Qwen3-VL
processor with our processing info) equal our HF processor's. On a CUDA machine the same test runs on the GPU (fp32,
eager; ``tests/conftest.py`` ALSO_ON_CUDA puts it in the GPU suite)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.vllm

GEN = 16

RUNNER = r'''
import json, sys, torch
from qwen4exp.serve import cpu_env
cpu_env()
from vllm import LLM, SamplingParams
sys.path.insert(0, sys.argv[3])
from vision_checkpoint import test_image
spec = json.load(open(sys.argv[1]))
llm = LLM(model=spec["model"], **spec["engine"])
sp = SamplingParams(temperature=0.0, max_tokens=spec["gen"], ignore_eos=True, prompt_logprobs=0, detokenize=False)
out = {}
for name, batch in spec["batches"].items():
    reqs = [{"prompt": p["text"], "multi_modal_data": {"image": [test_image(*im) for im in p["images"]]}}
            if p["images"] else {"prompt": p["text"]} for p in batch]
    res = llm.generate(reqs, sp, use_tqdm=False)
    out[name] = [{"prompt_ids": list(r.prompt_token_ids), "tokens": list(r.outputs[0].token_ids),
                  "prompt_lp": [None] + [d[t].logprob for d, t in zip(r.prompt_logprobs[1:], r.prompt_token_ids[1:])]}
                 for r in res]
json.dump(out, open(sys.argv[2], "w"))
'''

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [
    dict(text=f"<|im_start|> user {IMG} what is in the image <|im_end|> <|im_start|> assistant ",
         images=[(40, 24, 1)]),
    dict(text=f"<|im_start|> user the first {IMG} and the second {IMG} which one is red <|im_end|> "
              f"<|im_start|> assistant ", images=[(30, 50, 2), (64, 64, 3)]),
    dict(text="<|im_start|> user a question with no image at all about the sky <|im_end|> <|im_start|> assistant ",
         images=[]),
]


def _run(ckpt, engine, batches, workdir):
    os.makedirs(workdir, exist_ok=True)
    sp, out = os.path.join(workdir, "spec.json"), os.path.join(workdir, "out.json")
    with open(sp, "w") as f:
        json.dump(dict(model=ckpt, engine=engine, batches=batches, gen=GEN), f)
    script = os.path.join(workdir, "runner.py")
    with open(script, "w") as f:
        f.write(RUNNER)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", QWEN4EXP_CACHE_DIR=os.path.join(workdir, "cache"),
               TMPDIR=workdir)
    p = subprocess.run([sys.executable, script, sp, out, os.path.dirname(__file__)], env=env, timeout=900,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"vLLM run failed (rc={p.returncode}):\n{p.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from vision_checkpoint import build_vision_checkpoint

    d = str(tmp_path_factory.mktemp("vision_ckpt"))
    build_vision_checkpoint(d, seed=11, dtype=torch.float32, indexer_n_heads=16)
    from vllm_offline import shared_engine

    eng = shared_engine(dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=4,
                             limit_mm_per_prompt={"image": 2}, enable_prefix_caching=False))
    runs = {
        "whole": _run(d, dict(eng, enable_chunked_prefill=False, max_num_batched_tokens=512),
                      {"single": PROMPTS}, str(tmp_path_factory.mktemp("whole"))),
        "chunk8": _run(d, dict(eng, enable_chunked_prefill=True, max_num_batched_tokens=8),
                       {"single": PROMPTS}, str(tmp_path_factory.mktemp("chunk8"))),
    }
    return d, runs


_REF = {}


def _hf_reference(d, prompt):
    """Our HF reference (fp32) on the same prompt through AutoProcessor: (prompt ids, log-probs of each prompt
    token given the ones before, greedy continuation)."""
    from transformers import AutoProcessor

    from qwen4exp import Qwen4ExpForConditionalGeneration
    from vision_checkpoint import test_image

    if d not in _REF:
        _REF[d] = (AutoProcessor.from_pretrained(d), Qwen4ExpForConditionalGeneration.from_pretrained(
            d, dtype=torch.float32))
    proc, model = _REF[d]
    imgs = [test_image(*im) for im in prompt["images"]] or None
    inp = proc(text=[prompt["text"]], images=imgs, return_tensors="pt")
    ids = inp["input_ids"][0]
    with torch.no_grad():
        lp = model(**inp).logits[0].log_softmax(-1)
        out = model.generate(**inp, max_new_tokens=GEN, do_sample=False, eos_token_id=None, pad_token_id=0)
    return ids.tolist(), lp[:-1].gather(1, ids[1:, None])[:, 0], out[0, ids.numel():].tolist()


@pytest.mark.parametrize("run", ["whole", "chunk8"])
def test_plugin_matches_hf_reference(setup, run):
    """Same prompt ids; teacher-forced log-probs of every prompt token within 1e-3 (fp32 both); same greedy
    tokens."""
    d, runs = setup
    for i, p in enumerate(PROMPTS):
        ids, lp, ref = _hf_reference(d, p)
        got = runs[run]["single"][i]
        assert got["prompt_ids"] == ids, (run, i)
        err = (torch.tensor(got["prompt_lp"][1:]) - lp).abs().max().item()
        print(f"{run} prompt {i}: max |prompt log-prob diff| {err:.1e}")
        assert err <= 1e-3, (run, i, err)
        assert got["tokens"] == ref, (run, i)
