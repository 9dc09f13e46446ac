"""The small trained checkpoint shipped in ``qwen4exp/assets/tiny-coder`` (made by ``recipes/train_tiny.py``).

It loads in the HF runtime in the official format, is small, has every mechanism switched on, has learned something
(held-out cross-entropy well below the train-set unigram baseline), its MTP head drafts tokens that the main head
accepts (and speculative decoding still equals plain greedy), and its tokenizer renders the chat template.
"""

import json
import math
import os

import pytest
import torch

import qwen4exp
from qwen4exp import Qwen4ExpForCausalLM

CKPT = os.path.join(os.path.dirname(qwen4exp.__file__), "assets", "tiny-coder")

# Held-out text written for this test (so it is in no training file).
HELDOUT = '''import os
import re
from collections import defaultdict


class WordIndex:
    """Map every word of a set of text files to the files and line numbers where it occurs."""

    def __init__(self, root, pattern=r"\\w+"):
        self.root = root
        self.pattern = re.compile(pattern)
        self.index = defaultdict(list)

    def add_file(self, path):
        """Read one file and record where each of its words appears."""
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                for word in self.pattern.findall(line.lower()):
                    self.index[word].append((path, lineno))

    def build(self):
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(".txt"):
                    self.add_file(os.path.join(dirpath, name))
        return self

    def lookup(self, word):
        """Return the list of (path, line) pairs for word, or an empty list."""
        return list(self.index.get(word.lower(), []))

    def __len__(self):
        return len(self.index)

    def __repr__(self):
        return f"{self.__class__.__name__}({self.root!r}, words={len(self)})"
'''

# Measured on the shipped checkpoint: model 2.41 nats/token vs the train-set unigram baseline 6.13 on HELDOUT
# (363 tokens; margin 3.72). On the recipe's own held-out split (14 stdlib files, 12,240 tokens): 2.99 vs 6.35.
# The guard keeps a wide margin so a retrained checkpoint, or another machine's numerics, still passes.
MARGIN = 2.0

# MTP mean acceptance length (1 + accepted drafts per verification, 3 drafted tokens) on tiny-coder, the range the
# docs/hf.md states: these PROMPTS give 2.29 in the HF reference (fp32); tests/test_vllm_mtp.py's prompts 2.45 (HF) and
# 2.35 (vLLM), and must stay in the same range.
MTP_ACCEPTANCE = (2.2, 2.7)

PROMPTS = [
    "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n",
]


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and immune to a busy machine
    try:
        yield Qwen4ExpForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(CKPT)


def test_size_and_format():
    files = sorted(os.listdir(CKPT))
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert f in files
    total = sum(os.path.getsize(os.path.join(CKPT, f)) for f in files)
    assert total <= 8_000_000, f"checkpoint dir is {total / 1e6:.2f} MB"
    from safetensors import safe_open

    with safe_open(os.path.join(CKPT, "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        dtypes = {f.get_tensor(n).dtype for n in names if f.get_tensor(n).is_floating_point()}
    assert dtypes == {torch.bfloat16}  # (the PLE hash buffers are int64, as in the official checkpoint)
    assert any(n.startswith("mtp.") for n in names)
    assert any(".ple.ple_embedding.ngram_embedding.shard_0.weight" in n for n in names)


def test_config_has_every_mechanism(model, tokenizer):
    c = model.config
    assert {"linear_attention", "indexed_attention"} <= set(c.layer_types)
    assert c.hc_count == 4
    assert len(c.ple_layer_ids) == 1 and c.layer_types[c.ple_layer_ids[0] - 1] == "linear_attention"
    assert c.num_experts > c.num_experts_per_tok >= 1 and c.shared_expert_intermediate_size > 0
    assert c.mtp_num_hidden_layers == 1 and model.mtp is not None
    # QSA block selection is active from position budget + r - 1 on: well inside the demo's prompts
    assert c.indexer_budget // c.indexer_compress_ratio < 32 and c.indexer_n_heads == 4
    assert c.head_dim in (32, 64) and c.linear_key_head_dim == c.linear_value_head_dim == 64
    assert c.vocab_size >= len(tokenizer) and c.vocab_size % 64 == 0
    assert c.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id


@torch.no_grad()
def test_heldout_loss_beats_unigram(model, tokenizer):
    with open(os.path.join(CKPT, "train_stats.json")) as f:
        stats = json.load(f)
    counts = torch.tensor(stats["unigram_counts"], dtype=torch.float64) + 1.0
    uni_lp = (counts / counts.sum()).log()
    ids = torch.tensor([tokenizer(HELDOUT)["input_ids"]])
    assert ids.shape[1] > 2 * (model.config.indexer_budget + model.config.indexer_compress_ratio)  # QSA selects
    logits = model(ids, use_cache=False).logits[0, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()
    uni = -uni_lp[ids[0, 1:]].mean().item()
    print(f"held-out CE {ce:.3f} nats/token vs unigram {uni:.3f} ({ids.shape[1]} tokens)")
    assert math.isfinite(ce) and ce < uni - MARGIN


@torch.no_grad()
def test_mtp_on_equals_off_and_accepts_drafts(model, tokenizer):
    steps = accepted = 0
    for p in PROMPTS:
        ids = torch.tensor([tokenizer(p)["input_ids"]])
        ref = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = model.generate(ids, max_new_tokens=16, use_mtp=True, num_speculative_tokens=3, eos_token_id=None)
        assert torch.equal(out, ref), (tokenizer.decode(ref[0]), tokenizer.decode(out[0]))
        steps += model.last_mtp_stats["verify_steps"]
        accepted += model.last_mtp_stats["accepted_drafts"]
    mean_accept = 1 + accepted / steps
    print(f"MTP mean acceptance length {mean_accept:.2f}")
    assert MTP_ACCEPTANCE[0] <= mean_accept <= MTP_ACCEPTANCE[1]


def test_tokenizer_chat_template_round_trip(tokenizer):
    msgs = [{"role": "system", "content": "You are a coding assistant."},
            {"role": "user", "content": "Write `def add(a, b):`"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a coding assistant.<|im_end|>\n"
                    "<|im_start|>user\nWrite `def add(a, b):`<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    assert tokenizer.decode(ids) == text
    code = HELDOUT[:400] + "\t tabs,  spaces and unicode: λ → ✓\n"
    assert tokenizer.decode(tokenizer(code)["input_ids"]) == code


@torch.no_grad()
def test_mtp_training_forward_matches_inference(model, tokenizer):
    """``mtp_logits`` (the batched training forward the recipe uses) computes what ``mtp_forward`` does in decoding."""
    ids = torch.tensor([tokenizer(HELDOUT)["input_ids"][:100], tokenizer(HELDOUT)["input_ids"][100:200]])
    H = model(ids, use_cache=False, return_mtp_hidden=True)["mtp_hidden"]
    batched = model.mtp_logits(H, ids)
    for b in range(ids.shape[0]):
        cache = model.new_cache(1)
        ref, _ = model.mtp_forward(H[b, :-1], ids[b, 1:], torch.arange(ids.shape[1] - 1), cache)
        torch.testing.assert_close(batched[b], ref, rtol=1e-4, atol=1e-4)
