"""The MTP drafts' vocabulary (``qwen4exp/vllm/draft_vocab.py``, ``QWEN4EXP_MTP_DRAFT_VOCAB``): which tokens, the
frequency file and its errors, the draft head that scores only them inside vLLM's ``LogitsProcessor``, and
``tools/draft_vocab.py``."""

import json
import os

import pytest
import torch

from qwen4exp.vllm.draft_vocab import (DraftVocabError, hot_token_ids, rank_by_count, read_ranked_ids,
                                       special_token_ids)
from script_loader import load_script

CKPT = os.path.join(os.path.dirname(__file__), "..", "qwen4exp", "assets", "tiny-coder")


def test_hot_ids_lowest_or_ranked_plus_always():
    assert hot_token_ids(4, 100) == [0, 1, 2, 3]
    assert hot_token_ids(4, 100, always=[99, 2, 500]) == [0, 1, 2, 3, 99]  # (500: past the vocabulary)
    # ranked: the first n distinct ids below the vocabulary, in the file's order
    assert hot_token_ids(3, 50, ranked=[7, 7, 60, 9, 1, 4]) == [1, 7, 9]
    assert hot_token_ids(10, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(DraftVocabError, match="QWEN4EXP_MTP_DRAFT_VOCAB must be a positive"):
        hot_token_ids(0, 5)


def test_rank_by_count_most_first_ties_to_lower_id():
    ranked, total = rank_by_count([[5, 3, 5, 9], [3, 5, 1]])
    assert ranked == [5, 3, 1, 9] and total == 7


def test_frequency_file_forms_and_errors(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([3, 1, 2]))
    b.write_text(json.dumps({"token_ids": [4, 0]}))
    assert read_ranked_ids(str(a)) == [3, 1, 2] and read_ranked_ids(str(b)) == [4, 0]
    bad = tmp_path / "bad.json"
    for text, msg in (("{", "not JSON"), (json.dumps({"ids": [1]}), "wants a list of token ids"),
                      (json.dumps([1, -2]), "wants a list of token ids"), (json.dumps([1.5]), "wants a list")):
        bad.write_text(text)
        with pytest.raises(DraftVocabError, match=f"QWEN4EXP_MTP_DRAFT_VOCAB_FILE {bad}: {msg}"):
            read_ranked_ids(str(bad))
    with pytest.raises(DraftVocabError, match="cannot read it"):
        read_ranked_ids(str(tmp_path / "missing.json"))


def test_special_ids_of_the_tiny_coder():
    ids = special_token_ids(CKPT)
    tc = json.load(open(os.path.join(CKPT, "tokenizer_config.json")))
    assert {int(k) for k in tc["added_tokens_decoder"]} <= ids
    gen = json.load(open(os.path.join(CKPT, "generation_config.json")))
    eos = gen.get("eos_token_id")
    assert set(eos if isinstance(eos, list) else [eos]) <= ids
    assert special_token_ids("") == set() and special_token_ids(os.path.join(CKPT, "nope")) == set()


@pytest.mark.vllm
def test_draft_head_scores_only_its_tokens_in_vllms_logits_processor():
    """The bf16 ``DraftHead`` (the CPU's form) in vLLM's own ``LogitsProcessor``: at its tokens the shared head's
    logits exactly, -inf elsewhere (the vocabulary trimmed as for the shared head), so the arg-max is the best of
    its tokens."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from qwen4exp.vllm.mtp import DraftHead

    torch.manual_seed(0)
    V, Vpad, D = 200, 208, 32
    w = torch.randn(Vpad, D)
    ids = torch.tensor(hot_token_ids(50, V, always=[150, 199]))
    head = DraftHead(w, ids)
    assert head.tp_size == 1 and head.n == 52
    x = torch.randn(3, D)
    with set_current_vllm_config(VllmConfig()):
        lp = LogitsProcessor(V)
        got = lp(head, x)
    want = x @ w[:V].T
    assert got.shape == (3, V)
    torch.testing.assert_close(got[:, ids], want[:, ids], rtol=0, atol=0)
    out = torch.ones(V, dtype=torch.bool)
    out[ids] = False
    assert torch.isneginf(got[:, out]).all()
    assert torch.equal(got.argmax(-1), ids[want[:, ids].argmax(-1)])


def test_tool_ranks_a_corpus(tmp_path, capsys):
    tool = load_script("draft_vocab")
    src = tmp_path / "a.py"
    src.write_text("def add(a, b):\n    return a + b\n\n" * 20 + "print(add(1, 2))\n")
    out = tool.main(["--model", CKPT, "--out", str(tmp_path / "hot.json"), str(src)])
    saved = json.load(open(tmp_path / "hot.json"))
    assert saved == out and saved["files"] == 1 and saved["tokens"] > 100
    from transformers import AutoTokenizer

    toks = AutoTokenizer.from_pretrained(CKPT)(src.read_text(), add_special_tokens=False)["input_ids"]
    assert saved["token_ids"] == rank_by_count([toks])[0] and saved["tokens"] == len(toks)
    assert "distinct" in capsys.readouterr().out
