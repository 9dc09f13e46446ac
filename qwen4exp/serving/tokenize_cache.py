"""Segment-cached prompt tokenization in the API server of a Qwen4Exp model (``QWEN4EXP_TOKENIZE_CACHE_TOKENS``).

An agent resends its whole conversation every turn, and the API server re-tokenizes text it tokenized the turn
before, in every turn's TTFT (figures: `docs/performance.md`, "Scheduling for agents").
A fast tokenizer splits its input at added tokens (``<|im_start|>``, ``<|im_end|>``, ...) before anything else and
encodes each piece on its own, so a rendered chat prompt's token ids are the concatenation of its pieces' ids. Here
the pieces' ids are kept in an LRU cache keyed by the piece's text; a resent conversation then costs a regex split,
a dictionary lookup per message and the encoding of its new pieces only.

Exactness: only added tokens that split the same way everywhere (not normalized, no lstrip / rstrip / single_word)
are split points, and ``SegmentTokenizer.for_tokenizer`` turns itself off (``None``) unless the tokenizer adds no
special tokens of its own and a set of probe texts encode identically through both paths (a pre-tokenizer that
treats the first piece differently, e.g. a "first"-only Metaspace prefix, fails it). Calls the cache cannot answer
exactly (offsets wanted, another truncation side) go to vLLM's own path.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict

from vllm.logger import init_logger

logger = init_logger("vllm.plugins.qwen4exp.tokenize_cache")

MIN_CACHED_CHARS = 64  # shorter pieces are encoded each time (a dictionary entry would cost more than it saves)
_PROBE_WORDS = ("hello", " world", "\n", "  two  spaces", "\t", "é", "中文", "x=1;", " ", "\n\n", "end.")


class SegmentTokenizer:
    """``encode(text, add_special_tokens, max_length)`` == ``tokenizer(text, ...)["input_ids"]``, piece by piece
    through an LRU cache of at most ``max_tokens`` token ids (int32)."""

    def __init__(self, tokenizer, max_tokens: int, split_tokens: dict[str, int]):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.split_ids = split_tokens
        self.pattern = re.compile("(" + "|".join(re.escape(t) for t in sorted(split_tokens, key=len, reverse=True))
                                  + ")")
        self.cache: OrderedDict[str, array] = OrderedDict()
        self.cached_tokens = 0
        self.hits = self.misses = 0  # pieces of at least MIN_CACHED_CHARS found / not found
        self.lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, max_tokens: int) -> SegmentTokenizer | None:
        """The cache for ``tokenizer``, or None where it could not be exact (see the module docstring)."""
        if max_tokens <= 0:
            return None
        try:
            decoder = tokenizer.added_tokens_decoder
        except AttributeError:
            return None
        split = {t.content: i for i, t in decoder.items()
                 if t.content and not (t.normalized or t.lstrip or t.rstrip or t.single_word)}
        if not split:
            return None
        self = cls(tokenizer, max_tokens, split)
        try:
            ok = self._self_check()
        except Exception as e:  # noqa: BLE001 (any failure: vLLM's own path stays)
            logger.warning("qwen4exp tokenize cache off: its self-check failed (%s: %s)", type(e).__name__, e)
            return None
        if not ok:
            logger.warning("qwen4exp tokenize cache off: %s does not encode piece by piece as a whole",
                           type(tokenizer).__name__)
            return None
        self.cache.clear()
        self.cached_tokens = self.hits = self.misses = 0
        return self

    def _plain(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _self_check(self) -> bool:
        if self._plain("a b", True) != self._plain("a b", False):
            return False  # the tokenizer adds BOS/EOS itself: not handled here
        specials = sorted(self.split_ids)
        probes = ["".join(w + specials[i % len(specials)] for i, w in enumerate(_PROBE_WORDS)),
                  "".join(specials[i % len(specials)] + w for i, w in enumerate(_PROBE_WORDS)),
                  " leading" + specials[0] + specials[-1] + " x" * 40 + specials[0], "no split tokens here " * 5]
        for text in probes:
            for _ in range(2):  # the second time through the cache
                if self.encode(text, False) != self._plain(text, False):
                    return False
        return True

    def encode(self, text: str, add_special_tokens: bool = False, max_length: int | None = None) -> list[int]:
        parts = self.pattern.split(text)
        new = {}
        with self.lock:
            for i in range(0, len(parts), 2):
                p = parts[i]
                if len(p) >= MIN_CACHED_CHARS:
                    ids = self.cache.get(p)
                    if ids is None:
                        new[p] = None
                        self.misses += 1
                    else:
                        self.cache.move_to_end(p)
                        self.hits += 1
                elif p:
                    new[p] = None
        if new:  # one batch call for every piece not cached (the tokenizer encodes a batch in parallel)
            texts = list(new)
            for p, ids in zip(texts, self.tokenizer(texts, add_special_tokens=False)["input_ids"], strict=True):
                new[p] = array("i", ids)
        out = array("i")
        with self.lock:
            for i, p in enumerate(parts):
                if i % 2:
                    out.append(self.split_ids[p])
                elif p:
                    ids = new.get(p)
                    if ids is None:
                        ids = self.cache.get(p)
                        if ids is None:  # (evicted meanwhile by another thread)
                            ids = array("i", self.tokenizer(p, add_special_tokens=False)["input_ids"])
                    out.extend(ids)
            for p, ids in new.items():
                if len(p) >= MIN_CACHED_CHARS and p not in self.cache and len(ids) <= self.max_tokens:
                    self.cache[p] = ids
                    self.cached_tokens += len(ids)
            while self.cached_tokens > self.max_tokens:
                _, ids = self.cache.popitem(last=False)
                self.cached_tokens -= len(ids)
        ids = out.tolist()
        if max_length is not None and len(ids) > max_length:
            ids = ids[:max_length] if self.tokenizer.truncation_side == "right" else ids[len(ids) - max_length:]
        return ids


_caches: dict[int, SegmentTokenizer | None] = {}


def cache_for(tokenizer, max_tokens: int) -> SegmentTokenizer | None:
    """One ``SegmentTokenizer`` a tokenizer object (built, and self-checked, at its first prompt)."""
    key = id(tokenizer)
    if key not in _caches:
        _caches[key] = SegmentTokenizer.for_tokenizer(tokenizer, max_tokens)
        if _caches[key] is not None:
            logger.info("qwen4exp tokenize cache on: up to %d token ids, split at %d added tokens", max_tokens,
                        len(_caches[key].split_ids))
    return _caches[key]


def _serves_ours(renderer, architectures) -> bool:
    """Whether the renderer's model is one of ``architectures`` (asked once a renderer)."""
    ours = getattr(renderer, "_qwen4exp_tokenize_cache", None)
    if ours is None:
        hf = getattr(getattr(renderer, "model_config", None), "hf_config", None)
        ours = bool(set(getattr(hf, "architectures", None) or ()) & set(architectures))
        renderer._qwen4exp_tokenize_cache = ours
    return ours


def install(architectures=None) -> bool:
    """Route vLLM 0.32's text-prompt tokenization (``BaseRenderer._tokenize_prompt``) through the cache where it
    can answer exactly, for renderers of a model of ``architectures`` (default: the plugin's; other models keep
    vLLM's path); False where ``QWEN4EXP_TOKENIZE_CACHE_TOKENS`` is 0 or it is already installed."""
    from vllm.renderers.base import BaseRenderer

    from qwen4exp import envs

    if architectures is None:
        from qwen4exp.vllm import ARCHITECTURES as architectures
    max_tokens = envs.QWEN4EXP_TOKENIZE_CACHE_TOKENS
    original = BaseRenderer._tokenize_prompt
    if max_tokens <= 0 or getattr(original, "_qwen4exp", False):
        return False

    def _tokenize_prompt(self, prompt, params):
        kwargs = params.get_encode_kwargs()
        if (not self._wants_offsets(prompt, params) and set(kwargs) <= {"truncation", "max_length",
                                                                        "add_special_tokens"}
                and isinstance(prompt.get("prompt"), str) and self.tokenizer is not None
                and _serves_ours(self, architectures)):
            cache = cache_for(self.tokenizer, max_tokens)
            if cache is not None:
                ids = cache.encode(prompt["prompt"], bool(kwargs.get("add_special_tokens", True)),
                                   kwargs.get("max_length") if kwargs.get("truncation") else None)
                return self._build_tokens_prompt(ids, prompt, offset_mapping=None)
        return original(self, prompt, params)

    _tokenize_prompt._qwen4exp = True
    _tokenize_prompt.__wrapped__ = original
    BaseRenderer._tokenize_prompt = _tokenize_prompt
    return True
