"""Which tokens the MTP drafts score (``QWEN4EXP_MTP_DRAFT_VOCAB=N``): the N most frequent ones plus the tokenizer's
special and added tokens, instead of the whole vocabulary.

Why: at batch 1 each draft step reads the whole LM head (248k x 2560 bf16, 1.27 GB: ~0.42 ms of a ~7.4 ms MTP
step on an H100, three times a step), while the tokens a draft gets accepted with are almost always among the
frequent ones. The drafts then read N rows; the target still scores every token, so the output is unchanged and
only how many drafts are accepted can change (the frequency-ranked drafting of FR-Spec, and EAGLE-3's draft
vocabulary). Frequencies come from a file of token ids ranked most frequent first (``tools/draft_vocab.py`` counts
them over a corpus of the traffic served), else from the ids themselves: byte-level BPE numbers its tokens in merge
order, frequent merges first, so the lowest ids are a corpus-free ranking.

Pure (json, no vLLM): the plugin's draft head (``qwen4exp.vllm.mtp``) and the tool share it."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable


class DraftVocabError(ValueError):
    pass


def special_token_ids(model_dir: str) -> set[int]:
    """The ids a draft must always be able to propose though rare in text: the tokenizer's added / special tokens
    (``tokenizer_config.json``'s ``added_tokens_decoder``, ``tokenizer.json``'s ``added_tokens``: chat and tool-call
    markers, end of turn) and the configs' eos / bos / pad ids. Empty where ``model_dir`` is not a local folder."""
    ids: set[int] = set()
    if not model_dir or not os.path.isdir(model_dir):
        return ids

    def load(name):
        try:
            with open(os.path.join(model_dir, name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    tc = load("tokenizer_config.json") or {}
    ids.update(int(k) for k in (tc.get("added_tokens_decoder") or {}))
    tj = load("tokenizer.json") or {}
    ids.update(int(t["id"]) for t in tj.get("added_tokens") or [] if isinstance(t, dict) and "id" in t)
    for cfg in (load("config.json") or {}, (load("config.json") or {}).get("text_config") or {},
                load("generation_config.json") or {}):
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            v = cfg.get(key)
            ids.update(x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int) and x >= 0)
    return ids


def read_ranked_ids(path: str) -> list[int]:
    """A frequency file: JSON, a list of token ids or ``{"token_ids": [...]}``, most frequent first."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise DraftVocabError(f"QWEN4EXP_MTP_DRAFT_VOCAB_FILE {path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise DraftVocabError(f"QWEN4EXP_MTP_DRAFT_VOCAB_FILE {path}: not JSON ({e})") from None
    ids = data.get("token_ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise DraftVocabError(f"QWEN4EXP_MTP_DRAFT_VOCAB_FILE {path}: wants a list of token ids (non-negative "
                              "integers, most frequent first), or {\"token_ids\": [...]}")
    return ids


def hot_token_ids(n: int, vocab_size: int, ranked: list[int] | None = None, always: Iterable[int] = ()) -> list[int]:
    """The drafts' vocabulary, sorted: the first ``n`` distinct ids of ``ranked`` below ``vocab_size`` (``None``:
    ids 0 .. n - 1), plus ``always`` (below ``vocab_size``)."""
    if n <= 0:
        raise DraftVocabError(f"QWEN4EXP_MTP_DRAFT_VOCAB must be a positive number of tokens, got {n}")
    chosen: set[int] = set()
    for i in (range(min(n, vocab_size)) if ranked is None else ranked):
        if len(chosen) >= n:
            break
        if i < vocab_size:
            chosen.add(i)
    chosen.update(i for i in always if 0 <= i < vocab_size)
    return sorted(chosen)


def rank_by_count(token_lists: Iterable[Iterable[int]]) -> tuple[list[int], int]:
    """(ids by count, most first, ties to the lower id; the number of tokens counted)."""
    c: Counter = Counter()
    total = 0
    for toks in token_lists:
        toks = list(toks)
        c.update(toks)
        total += len(toks)
    return sorted(c, key=lambda i: (-c[i], i)), total
