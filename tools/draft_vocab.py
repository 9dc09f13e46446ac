"""Rank a checkpoint's tokens by how often they occur in a corpus, for the MTP drafts' vocabulary
(``QWEN4EXP_MTP_DRAFT_VOCAB=N`` with ``QWEN4EXP_MTP_DRAFT_VOCAB_FILE=OUT``; ``qwen4exp/vllm/draft_vocab.py``).

    python tools/draft_vocab.py --model CKPT --out hot.json FILE [FILE ...]

FILEs are text (the kind of output the server produces: code, agent transcripts); each is tokenized whole. Writes
``{"model", "files", "tokens", "token_ids"}`` (ids most frequent first; tokens never seen are left out) and prints
what share of the counted tokens the first N ids cover, for a few N."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qwen4exp.vllm.draft_vocab import rank_by_count  # noqa: E402

SIZES = (256, 512, 1024, 4096, 8192, 16384, 32768, 65536)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (its tokenizer)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("files", nargs="+", help="text files")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.model_max_length = 1 << 40  # (whole files: no length warning)
    lists = []
    for f in args.files:
        try:
            with open(f, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except OSError as e:
            raise SystemExit(f"draft_vocab: {f}: cannot read it ({e.strerror})")
        lists.append(tok(text, add_special_tokens=False)["input_ids"])
    ranked, total = rank_by_count(lists)
    if not total:
        raise SystemExit("draft_vocab: the files hold no tokens")
    counts: dict[int, int] = {}
    for ids in lists:
        for i in ids:
            counts[i] = counts.get(i, 0) + 1
    out = {"model": os.path.basename(os.path.normpath(args.model)), "files": len(args.files), "tokens": total,
           "token_ids": ranked}
    with open(args.out, "w") as f:
        json.dump(out, f)
    covered, acc = {}, 0
    for k, i in enumerate(ranked, 1):
        acc += counts[i]
        if k in SIZES:
            covered[k] = acc / total
    print(f"{total} tokens, {len(ranked)} distinct (vocabulary {len(tok)}) -> {args.out}")
    for n in SIZES:
        if n < len(ranked):
            print(f"  the {n} most frequent cover {100 * covered[n]:.2f}% of them")
    return out


if __name__ == "__main__":
    main()
