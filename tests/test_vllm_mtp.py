"""vLLM speculative decoding with our MTP draft head (``qwen4exp.vllm.mtp.Qwen4ExpMTP``) on the trained tiny-coder.

Greedy tokens must be identical with and without ``speculative_config={"method": "mtp", ...}`` (batched, chunked
prefill: prefill chunks share steps with 1+k-token verifications, so the GDN/PLE state slots, the QSA caches and the
draft's cache all see mixed batches and rejected tokens), and equal to the HF reference's greedy decoding. vLLM must
report the acceptance counters; the mean acceptance length they give is compared with the HF reference's MTP run.
All in fp32: in bf16 a verification step's 4-token GEMMs and a decode step's 1-token GEMMs may round differently
(on a CPU without AVX-512 the bf16 runs diverged from one token on in one of the 5 prompts, while the fp32 runs
all agree), which is not what this test is about; fp32 makes the comparison exact.
"""

import os
import re

import pytest
import torch

pytestmark = pytest.mark.vllm

CKPT = os.path.join(os.path.dirname(__file__), "..", "qwen4exp", "assets", "tiny-coder")
GEN = 24
K = 3
TEXTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        ",
    '    def __repr__(self):\n        return "%s(%r)" % (self.__class__.__name__, self.',
    "def read_lines(path, encoding='utf-8'):\n    \"\"\"Return the lines of a text file.\"\"\"\n"
    "    with open(path, encoding=encoding) as f:\n        return [line.rstrip('\\n') for line in f]\n\n\n"
    "def write_lines(path, lines, encoding='utf-8'):\n    \"\"\"Write lines to a text file.\"\"\"\n"
    "    with open(path, 'w', encoding=encoding) as f:\n        for line in lines:\n            ",
]


@pytest.fixture(scope="module")
def setup():
    from tokenizers import Tokenizer

    from qwen4exp import Qwen4ExpForCausalLM

    tok = Tokenizer.from_file(os.path.join(CKPT, "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in TEXTS]
    assert max(len(p) for p in prompts) > 67  # past the dense regime: QSA block selection on
    m = Qwen4ExpForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
    greedy, acc = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = m.generate(ids, max_new_tokens=GEN, do_sample=False, eos_token_id=None, pad_token_id=0)
            greedy.append(out[0, len(p):].tolist())
            m.generate(ids, max_new_tokens=GEN, use_mtp=True, num_speculative_tokens=K)
            acc.append(m.last_mtp_stats["mean_acceptance_length"])
    return dict(prompts=prompts, hf_greedy=greedy, hf_acceptance=sum(acc) / len(acc))


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    from vllm_offline import run_offline

    out = {}
    for name, extra in (("plain", {}), ("mtp", MTP)):
        out[name] = run_offline(_spec(CKPT, setup, **extra), str(tmp_path_factory.mktemp(name)), timeout=240)
    return out


# CPU: eager; on a GPU (the GPU suite's part `mtp`: `SUITE_PARTS=mtp bash tools/gpu_device.sh suite`) vLLM's
# default CUDA graphs (tiny-coder's 64-wide GDN heads run our GDN: PIECEWISE; FULL graphs for MTP steps: the
# FN-4 draft test, tests/gpu/test_vllm_nvfp4_gpu.py)
ENGINE = dict(dtype="float32", enforce_eager=not torch.cuda.is_available(), skip_tokenizer_init=True,
              max_model_len=512, max_num_seqs=8,
              enable_chunked_prefill=True, max_num_batched_tokens=48, disable_log_stats=False)
MTP = dict(speculative_config={"method": "mtp", "num_speculative_tokens": K})
MTP_ACCEPTANCE = (2.2, 2.7)  # mean acceptance length on tiny-coder: docs/hf.md's range (test_tiny_checkpoint.py)


def _spec(model, setup, **engine):
    return dict(model=model, engine=dict(ENGINE, **engine), prompts=setup["prompts"],
                sampling=dict(temperature=0.0, max_tokens=GEN, ignore_eos=True, detokenize=False))


def test_mtp_greedy_equals_plain_and_hf(setup, runs):
    assert runs["mtp"]["tokens"] == runs["plain"]["tokens"]
    assert runs["plain"]["tokens"] == setup["hf_greedy"]


def test_mtp_index_share_reuses_selection(setup, runs, tmp_path):
    """``index_share_for_mtp_iteration`` (the speculative config's override of the checkpoint key): draft step 0
    selects its QSA blocks, steps 1+ reuse them (past the budget; within it every block, as a fresh selection).
    It changes only the drafts: greedy tokens stay the plain run's, vLLM still counts the drafts, and the reuse
    path ran (its log line)."""
    from vllm_offline import run_offline

    share = dict(speculative_config=dict(MTP["speculative_config"], index_share_for_mtp_iteration=True))
    out = run_offline(_spec(CKPT, setup, **share), str(tmp_path), timeout=240)
    assert out["tokens"] == runs["plain"]["tokens"]
    m = out["metrics"]
    drafts = m.get("vllm:spec_decode_num_drafts")
    assert drafts and m["vllm:spec_decode_num_draft_tokens"] == K * drafts
    print(f"acceptance length with the shared selection {1 + m['vllm:spec_decode_num_accepted_tokens'] / drafts:.2f}")
    assert "reuse step 0's QSA block selection" in out["log"]
    assert "reuse step 0's QSA block selection" not in runs["mtp"]["log"]


def test_mtp_acceptance_reported(setup, runs):
    m = runs["mtp"]["metrics"]
    drafts, accepted = m.get("vllm:spec_decode_num_drafts"), m.get("vllm:spec_decode_num_accepted_tokens")
    assert drafts and accepted is not None, f"no spec-decode counters in {sorted(m)}"
    assert m["vllm:spec_decode_num_draft_tokens"] == K * drafts
    mean = 1 + accepted / drafts
    print(f"vLLM MTP mean acceptance length {mean:.2f} ({drafts} drafts); HF reference {setup['hf_acceptance']:.2f}")
    assert 1.5 <= mean <= 1 + K
    assert abs(mean - setup["hf_acceptance"]) < 0.5
    lo, hi = MTP_ACCEPTANCE  # docs/hf.md's range (vLLM CPU and H200: 2.35; HF: 2.45)
    assert lo <= mean <= hi and lo <= setup["hf_acceptance"] <= hi
    assert "vllm:spec_decode_num_drafts" not in runs["plain"]["metrics"] or not runs["plain"]["metrics"][
        "vllm:spec_decode_num_drafts"]


def _rewritten_checkpoint(dst, edit):
    """tiny-coder copied to ``dst`` with its tensors edited (``edit(state_dict) -> state_dict``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(CKPT, dst)
    f = os.path.join(dst, "model.safetensors")
    save_file(edit(dict(load_file(f))), f, metadata={"format": "pt"})
    return str(dst)


_SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                  "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


def test_mtp_per_expert_checkpoint_drafts_like_fused(setup, runs, tmp_path):
    """The draft loads through the target's loader (``weights.MTP_DRAFT``): the same checkpoint with every expert
    stored per expert (``mtp.layers.0.mlp.experts.{e}.*_proj.weight`` too), the composite ``model.language_model.``
    prefix (the draft's shared embedding included) and the unused ``mtp.hyper_connection_mixer.block_inject_weight``
    drafts exactly as the fused one: same tokens, same acceptance counters. The run also asks for the FP8 draft
    head (``QWEN4EXP_MTP_DRAFT_HEAD=fp8``), which an fp32 model (or a CPU) cannot take: the plugin says why and
    drafts with the bf16 head, so the counters still match."""
    from tiny_checkpoint import split_experts

    from vllm_offline import run_offline

    def edit(sd):
        sd = split_experts(sd)
        assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in sd and "mtp.layers.0.mlp.experts.down_proj" not in sd
        inject = sd["mtp.layers.0.attn_hyper_connection.block_inject_weight.weight"]  # [n, nD], as the mixer's
        sd["mtp.hyper_connection_mixer.block_inject_weight.weight"] = torch.zeros_like(inject)
        return {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in sd.items()}

    ck = _rewritten_checkpoint(tmp_path / "per_expert", edit)
    spec = dict(_spec(ck, setup, **MTP), env={"QWEN4EXP_MTP_DRAFT_HEAD": "fp8"})
    out = run_offline(spec, str(tmp_path / "run"), timeout=240)
    assert "QWEN4EXP_MTP_DRAFT_HEAD=fp8 not applied (" in out["log"], out["log"][-3000:]
    assert out["tokens"] == runs["mtp"]["tokens"]
    got, want = ({k: r["metrics"].get(k) for k in _SPEC_COUNTERS} for r in (out, runs["mtp"]))
    assert want["vllm:spec_decode_num_drafts"]
    assert got == want


def test_mtp_draft_vocabulary_keeps_output(setup, runs, tmp_path):
    """``QWEN4EXP_MTP_DRAFT_VOCAB``: the drafts score only the 1024 lowest ids of tiny-coder's 2048 (plus its
    special tokens), so their head reads half the rows; the target still scores every token, so greedy tokens stay
    the plain run's, and drafts are still made and accepted. Asked beside the FP8 head, which the CPU refuses (its
    line), the vocabulary still applies. Under vLLM's ``use_local_argmax_reduction`` the proposer asks the draft
    for its tokens (``get_top_tokens``: the arg-max of those rows, no full-width logits): the same drafts, so the
    same counters."""
    from vllm_offline import run_offline

    env = {"QWEN4EXP_MTP_DRAFT_VOCAB": "1024", "QWEN4EXP_MTP_DRAFT_HEAD": "fp8"}
    out = run_offline(dict(_spec(CKPT, setup, **MTP), env=env), str(tmp_path / "logits"), timeout=240)
    local = dict(speculative_config=dict(MTP["speculative_config"], use_local_argmax_reduction=True))
    top = run_offline(dict(_spec(CKPT, setup, **local), env=env), str(tmp_path / "top"), timeout=240)
    assert out["tokens"] == runs["plain"]["tokens"] == top["tokens"]
    got, want = ({k: r["metrics"].get(k) for k in _SPEC_COUNTERS} for r in (top, out))
    assert want["vllm:spec_decode_num_drafts"] and got == want
    assert "QWEN4EXP_MTP_DRAFT_HEAD=fp8 not applied (" in out["log"], out["log"][-3000:]
    line = re.search(r"MTP drafts use a copy of the LM head's rows for (\d+) of (\d+) tokens \(the lowest ids, "
                     r"(\d+) special", out["log"])
    assert line, out["log"][-3000:]
    n, vocab, special = map(int, line.groups())
    assert vocab == 2048 and 1024 <= n <= 1024 + special and special >= 1
    m, base = out["metrics"], runs["mtp"]["metrics"]
    drafts = m.get("vllm:spec_decode_num_drafts")
    assert drafts and m["vllm:spec_decode_num_draft_tokens"] == K * drafts
    acc = 1 + m["vllm:spec_decode_num_accepted_tokens"] / drafts
    full = 1 + base["vllm:spec_decode_num_accepted_tokens"] / base["vllm:spec_decode_num_drafts"]
    print(f"MTP acceptance length with the drafts' {n}-token vocabulary {acc:.3f} (whole vocabulary {full:.3f})")
    assert acc >= 1.5


def test_misshaped_mtp_tensor_fails_with_its_name(tmp_path):
    """A wrong-shaped ``mtp.`` tensor is refused by the shape check against the reference model, naming it."""
    from vllm_offline import run_offline

    name = "mtp.layers.0.self_attn.indexer.index_qk_proj.weight"

    def edit(sd):
        sd[name] = torch.zeros(sd[name].shape[0] + 1, sd[name].shape[1], dtype=sd[name].dtype)
        return sd

    ck = _rewritten_checkpoint(tmp_path / "ck", edit)
    spec = dict(model=ck, prompts=[[2, 3]], sampling=dict(max_tokens=1),
                engine=dict(dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=128, **MTP))
    with pytest.raises(RuntimeError) as e:
        run_offline(spec, str(tmp_path / "run"))
    msg = str(e.value)
    assert f"CheckpointError: qwen4exp: tensor {name} has shape" in msg, msg[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FULL CUDA graphs of MTP steps need a GPU")
def test_mtp_full_graphs_bf16_greedy_equals_plain(setup, tmp_path):
    """MTP under FULL CUDA graphs (vLLM's GDN, as the real model runs it: the default graph mode stays
    FULL_AND_PIECEWISE with a draft): the target's 1 + k-query verifications and the draft's steps replay captured
    graphs, and greedy tokens equal plain greedy decoding's up to bf16 arithmetic. A verification's 4-token GEMMs
    and GDN steps round differently from a decode's 1-token ones, so the bar is measured, not assumed: the same
    engine in fp32 (plain) is the exact run; MTP in bf16 may be at most 2x as far from it as plain bf16 decoding is
    (``near_tie.drift`` over the steps where all three agree; a verification that computed something else would be
    whole logits off), or 3x the drift of a change of batch shape (the prompts one at a time against all at once);
    and MTP and plain may part only on a tie no wider than both runs' distances from the exact run together. (Run 30,
    H100: MTP drifted 0.52 from plain against a batch-shape drift of 0.125, with no flip; the fp32 MTP test above
    shows the verification exact in fp32. Upstream's engine cannot be the yardstick: its FULL-graph decode takes
    only top-k 512 / 1024 / 2048 in cooperative_topk, and the tiny-coder's QSA keeps 16 blocks.)"""
    from near_tie import drift, flip_within, ulp_bf16
    from vllm_offline import run_offline

    # (vLLM's default GDN prefill kernel, FlashInfer's sm_90 DSL one, takes 128-wide heads only: its Triton one)
    engine = dict(ENGINE, dtype="bfloat16", enforce_eager=False, logprobs_mode="raw_logits",
                  gdn_prefill_backend="triton")
    sampling = dict(temperature=0.0, max_tokens=GEN, ignore_eos=True, detokenize=False, logprobs=5)
    env = {"QWEN4EXP_VLLM_GDN": "vllm"}
    n = len(setup["prompts"])
    out = {}
    # (the fp32 run is the yardstick of exact values: its GDN is the plugin's default for these 64-wide heads, ours,
    # which the fp32 MTP test above runs on the GPU)
    for name, extra, batches, e in (("plain", {}, None, env), ("alone", {}, [[i] for i in range(n)], env),
                                    ("mtp", MTP, None, env), ("exact", dict(dtype="float32"), None, {}),
                                    ("mtp_fp8", MTP, None, dict(env, QWEN4EXP_MTP_DRAFT_HEAD="fp8")),
                                    ("mtp_vocab", MTP, None, dict(env, QWEN4EXP_MTP_DRAFT_HEAD="fp8",
                                                                  QWEN4EXP_MTP_DRAFT_VOCAB="1536"))):
        spec = dict(model=CKPT, prompts=setup["prompts"], sampling=sampling, env=e, engine=dict(engine, **extra),
                    batches=batches)
        out[name] = run_offline(spec, str(tmp_path / name), timeout=420)
    log = out["mtp"]["log"]
    assert "capturing FULL CUDA graphs of 4 queries per request" in log, log[-3000:]
    assert "cudagraph_mode" not in log or "-> PIECEWISE" not in log, log[-3000:]
    m = out["mtp"]["metrics"]
    assert m.get("vllm:spec_decode_num_drafts") and m.get("vllm:spec_decode_num_accepted_tokens")

    def pair(x, y, i, steps=None):
        return (out[x]["tokens"][i][:steps], out[x]["logprobs"][i][:steps], out[y]["tokens"][i][:steps],
                out[y]["logprobs"][i][:steps])

    def common(i):  # the steps up to and with the first where exact, plain and MTP do not all agree
        runs = [out[r]["tokens"][i] for r in ("exact", "plain", "mtp")]
        j = next((j for j, t in enumerate(zip(*runs)) if len(set(t)) > 1), len(runs[0]) - 1)
        return j + 1

    top = max(abs(v) for lp in out["plain"]["logprobs"] for step in lp for v in step.values())
    floor = 2 * ulp_bf16(top)
    d_batch = max(drift(*pair("plain", "alone", i)) for i in range(n))
    d_mtp = max(drift(*pair("plain", "mtp", i)) for i in range(n))
    e_plain = max(drift(*pair("exact", "plain", i, common(i))) for i in range(n))
    e_mtp = max(drift(*pair("exact", "mtp", i, common(i))) for i in range(n))
    print(f"logit drift: one at a time vs batched {d_batch:.4g}, MTP vs plain {d_mtp:.4g}; from the fp32 run: "
          f"plain {e_plain:.4g}, MTP {e_mtp:.4g} (over {[common(i) for i in range(n)]} steps; bf16 ulp at the top "
          f"logit {floor / 2:.4g})")
    assert e_mtp <= max(2 * e_plain, 3 * d_batch, floor), (e_mtp, e_plain, d_batch)
    bound = max(2 * d_batch, e_plain + e_mtp, floor)
    flips = [(i, f) for i in range(n) if (f := flip_within(*pair("plain", "mtp", i), bound)) is not None]
    assert not flips, flips
    acc = 1 + m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_drafts"]
    # the FP8 draft head: drafts only, so the same bar against plain; its drafts may differ from the bf16 head's
    # only where the draft's top logits nearly tie, so it keeps (nearly) the same acceptance
    assert "MTP drafts use an FP8 copy of the LM head" in out["mtp_fp8"]["log"], out["mtp_fp8"]["log"][-3000:]
    flips = [(i, f) for i in range(n) if (f := flip_within(*pair("plain", "mtp_fp8", i), bound)) is not None]
    assert not flips, flips
    m8 = out["mtp_fp8"]["metrics"]
    acc8 = 1 + m8["vllm:spec_decode_num_accepted_tokens"] / m8["vllm:spec_decode_num_drafts"]
    print(f"MTP acceptance length {acc:.3f}, with the FP8 draft head {acc8:.3f}")
    assert acc8 >= acc - 0.1, (acc8, acc)
    # the drafts' vocabulary (1536 of 2048 rows, in FP8), inside the captured draft graphs: drafts only, the same bar
    lv = out["mtp_vocab"]["log"]
    assert re.search(r"MTP drafts use an FP8 copy of the LM head for \d+ of 2048 tokens", lv), lv[-3000:]
    flips = [(i, f) for i in range(n) if (f := flip_within(*pair("plain", "mtp_vocab", i), bound)) is not None]
    assert not flips, flips
    mv = out["mtp_vocab"]["metrics"]
    accv = 1 + mv["vllm:spec_decode_num_accepted_tokens"] / mv["vllm:spec_decode_num_drafts"]
    print(f"with the drafts' 1536-token vocabulary in FP8 {accv:.3f}")
    assert accv >= 1.5, accv
