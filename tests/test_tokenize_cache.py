"""``qwen4exp.serving.tokenize_cache``: prompt pieces' token ids cached between an agent's turns, exactly what the
tokenizer gives for the whole text (tiny-coder's byte-level BPE, random multi-turn chats rendered by its chat
template, unicode, whitespace runs, special tokens inside message text), its LRU bound, the self-check that turns it
off for a tokenizer that does not encode piece by piece as a whole, and its hook into vLLM 0.32's renderer."""

from __future__ import annotations

import os
import random

import pytest

from qwen4exp.serving import tokenize_cache as TC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(ROOT, "qwen4exp", "assets", "tiny-coder"))


def plain(tok, text, **kw):
    return list(tok(text, add_special_tokens=False, **kw)["input_ids"])


def random_text(rng: random.Random, n: int) -> str:
    pieces = ["def", " f", "(x):", "\n", "    ", "return", " x", "  ", "\t", "é", "中文", "🙂", "<|im_end|>", "<|im",
              "_start", "|>", " 123", "4567", "\n\n", "Hello", " world", ".", "'s", " don't", "\r\n"]
    return "".join(rng.choice(pieces) for _ in range(n))


def test_a_growing_chat_encodes_exactly_and_hits_the_cache(tok):
    cache = TC.SegmentTokenizer.for_tokenizer(tok, 1_000_000)
    assert cache is not None and set(cache.split_ids) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    rng = random.Random(0)
    for conv in range(6):
        msgs = [{"role": "system", "content": random_text(rng, 30)}]
        for turn in range(4):
            msgs.append({"role": "user", "content": random_text(rng, rng.randrange(1, 400))})
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            hits = cache.hits
            assert cache.encode(text) == plain(tok, text), (conv, turn)
            assert cache.encode(text) == plain(tok, text)  # the second time from the cache
            if turn:
                assert cache.hits > hits  # the earlier messages came from the cache
            msgs.append({"role": "assistant", "content": random_text(rng, rng.randrange(1, 200))})


def test_any_text_encodes_exactly(tok):
    cache = TC.SegmentTokenizer.for_tokenizer(tok, 1_000_000)
    rng = random.Random(1)
    for i in range(200):
        text = random_text(rng, rng.randrange(0, 300))
        assert cache.encode(text) == plain(tok, text), i
        assert cache.encode(text, add_special_tokens=True) == list(tok(text)["input_ids"]), i


def test_truncation_and_the_lru_bound(tok):
    cache = TC.SegmentTokenizer.for_tokenizer(tok, 300)
    rng = random.Random(2)
    for i in range(40):
        text = "<|im_start|>".join(random_text(rng, 120) for _ in range(3))
        assert cache.encode(text) == plain(tok, text)
        assert cache.encode(text, max_length=50) == plain(tok, text, truncation=True, max_length=50)
        assert cache.cached_tokens <= 300 and cache.cached_tokens == sum(len(v) for v in cache.cache.values())
    assert cache.cache  # something is kept


class FakeTokenizer:
    """A tokenizer whose ids depend on where a piece sits (the first piece differs) or that adds a BOS token."""

    truncation_side = "right"

    def __init__(self, first_differs=False, bos=False):
        from types import SimpleNamespace

        self.first_differs, self.bos = first_differs, bos
        self.added_tokens_decoder = {0: SimpleNamespace(content="<s>", normalized=False, lstrip=False, rstrip=False,
                                                        single_word=False)}

    def _one(self, text):
        ids, first = [], True
        for i, p in enumerate(text.split("<s>")):
            if i:
                ids.append(0)
            ids += [ord(c) + (1000 if self.first_differs and first else 0) for c in p]
            first = False
        return ids

    def __call__(self, text, add_special_tokens=True):
        one = (lambda t: ([1] if self.bos and add_special_tokens else []) + self._one(t))
        return {"input_ids": [one(t) for t in text] if isinstance(text, list) else one(text)}


def test_self_check_turns_the_cache_off_where_it_would_not_be_exact():
    assert TC.SegmentTokenizer.for_tokenizer(FakeTokenizer(), 100) is not None  # (the fake itself is cacheable)
    assert TC.SegmentTokenizer.for_tokenizer(FakeTokenizer(first_differs=True), 100) is None
    assert TC.SegmentTokenizer.for_tokenizer(FakeTokenizer(bos=True), 100) is None
    assert TC.SegmentTokenizer.for_tokenizer(FakeTokenizer(), 0) is None  # the switch at 0: off
    assert TC.SegmentTokenizer.for_tokenizer(object(), 100) is None  # no added tokens to split at


def test_the_renderer_hook(tok, monkeypatch):
    """vLLM 0.32's ``BaseRenderer._tokenize_prompt`` (pinned: its signature, ``_wants_offsets``,
    ``_build_tokens_prompt``, ``model_config`` and the encode kwargs it passes) goes through the cache for a Qwen4Exp
    model; a call wanting offsets, and any other model, go to vLLM's own path."""
    from types import SimpleNamespace

    import inspect

    from vllm.renderers.base import BaseRenderer
    from vllm.renderers.params import TokenizeParams

    from qwen4exp import envs

    assert list(inspect.signature(BaseRenderer._tokenize_prompt).parameters) == ["self", "prompt", "params"]
    assert callable(BaseRenderer._wants_offsets) and callable(BaseRenderer._build_tokens_prompt)
    calls = []

    def vllms_own(self, prompt, params):  # stands in for vLLM's method under the hook
        calls.append(prompt["prompt"])
        return {"prompt_token_ids": None, "offsets": "vllm"}

    monkeypatch.setattr(BaseRenderer, "_tokenize_prompt", vllms_own)  # (restored after the test)
    monkeypatch.setattr(TC, "_caches", {})
    monkeypatch.setenv("QWEN4EXP_TOKENIZE_CACHE_TOKENS", "100000")
    envs.reset()
    try:
        assert TC.install() and not TC.install()  # once
    finally:
        envs.reset()
    hook = BaseRenderer._tokenize_prompt
    assert hook._qwen4exp and hook.__wrapped__ is vllms_own

    class Stub:
        tokenizer = tok
        offsets = False

        def __init__(self, arch="Qwen4ExpForConditionalGeneration"):
            self.model_config = SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch]))

        def _wants_offsets(self, prompt, params):
            return self.offsets

        def _build_tokens_prompt(self, ids, prompt, offset_mapping=None):
            return {"prompt_token_ids": list(ids), "offsets": offset_mapping}

    text = tok.apply_chat_template([{"role": "user", "content": "hi " * 50}, {"role": "assistant", "content": "ok"},
                                    {"role": "user", "content": "more " * 30}], tokenize=False,
                                   add_generation_prompt=True)
    params = TokenizeParams(max_total_tokens=4096)
    kwargs = params.get_encode_kwargs()
    assert set(kwargs) <= {"truncation", "max_length", "add_special_tokens"}, kwargs
    stub = Stub()
    out = hook(stub, {"prompt": text}, params)
    assert out["prompt_token_ids"] == list(tok(text, **kwargs)["input_ids"]) and calls == []
    assert TC.cache_for(tok, 100000).hits == 0 and hook(stub, {"prompt": text}, params) == out
    assert TC.cache_for(tok, 100000).hits > 0
    short = TokenizeParams(max_total_tokens=20)  # truncated as the tokenizer would (to fail vLLM's length check)
    assert hook(stub, {"prompt": text}, short)["prompt_token_ids"] == \
        list(tok(text, **short.get_encode_kwargs())["input_ids"])
    stub.offsets = True
    assert hook(stub, {"prompt": text}, params)["offsets"] == "vllm" and calls == [text]
    assert hook(Stub("LlamaForCausalLM"), {"prompt": text}, params)["offsets"] == "vllm" and calls == [text] * 2


def test_bench_tokenize_script_writes_its_table(tmp_path, capsys):
    """``benchmarks/bench_tokenize.py`` at a small size: one CSV row a turn, the ids checked equal inside."""
    import csv

    from script_loader import load_script

    bench = load_script("bench_tokenize")
    assert bench.main(["--first-turn-tokens", "600", "--turn-tokens", "50", "--reply-tokens", "20", "--turns", "3",
                       "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "tokenize.csv")))
    assert [int(r["turn"]) for r in rows] == [1, 2, 3]
    assert all(float(r["plain_ms"]) > 0 and float(r["cached_ms"]) > 0 for r in rows)
    tokens = [int(r["prompt_tokens"]) for r in rows]
    assert 600 <= tokens[0] < tokens[1] < tokens[2]
    assert "speed-up" in capsys.readouterr().out
