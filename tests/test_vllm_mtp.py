"""vLLM speculative decoding with our MTP draft head (``qwen4exp.vllm.mtp.Qwen4ExpMTP``) on the trained tiny-coder.

Greedy tokens must be identical with and without ``speculative_config={"method": "mtp", ...}`` (batched, chunked
prefill: prefill chunks share steps with 1+k-token verifications, so the GDN/PLE state slots, the QSA caches and the
draft's cache all see mixed batches and rejected tokens), and equal to the HF reference's greedy decoding. vLLM must
report the acceptance counters; the mean acceptance length they give is compared with the HF reference's MTP run.
"""

import os

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
    m = Qwen4ExpForCausalLM.from_pretrained(CKPT, dtype=torch.bfloat16).eval()
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
    from qwen4exp.vllm.offline import run_offline

    engine = dict(dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=8,
                  enable_chunked_prefill=True, max_num_batched_tokens=48, disable_log_stats=False)
    out = {}
    for name, extra in (("plain", {}), ("mtp", dict(speculative_config={"method": "mtp", "num_speculative_tokens": K}))):
        spec = dict(model=CKPT, engine=dict(engine, **extra), prompts=setup["prompts"],
                    sampling=dict(temperature=0.0, max_tokens=GEN, ignore_eos=True, detokenize=False))
        out[name] = run_offline(spec, str(tmp_path_factory.mktemp(name)), timeout=240)
    return out


def test_mtp_greedy_equals_plain_and_hf(setup, runs):
    assert runs["mtp"]["tokens"] == runs["plain"]["tokens"]
    assert runs["plain"]["tokens"] == setup["hf_greedy"]


def test_mtp_acceptance_reported(setup, runs):
    m = runs["mtp"]["metrics"]
    drafts, accepted = m.get("vllm:spec_decode_num_drafts"), m.get("vllm:spec_decode_num_accepted_tokens")
    assert drafts and accepted is not None, f"no spec-decode counters in {sorted(m)}"
    assert m["vllm:spec_decode_num_draft_tokens"] == K * drafts
    mean = 1 + accepted / drafts
    print(f"vLLM MTP mean acceptance length {mean:.2f} ({drafts} drafts); HF reference {setup['hf_acceptance']:.2f}")
    assert 1.5 <= mean <= 1 + K
    assert abs(mean - setup["hf_acceptance"]) < 0.5
    assert "vllm:spec_decode_num_drafts" not in runs["plain"]["metrics"] or not runs["plain"]["metrics"][
        "vllm:spec_decode_num_drafts"]
