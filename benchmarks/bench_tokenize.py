"""Prompt tokenization of an agent's resent conversation: the tokenizer on the whole rendered chat (what vLLM's API
server does every turn) against ``qwen4exp.serving.tokenize_cache`` (pieces between added tokens cached between turns).

    python benchmarks/bench_tokenize.py --out bench_out/tokenize      # table + OUT/tokenize.csv

The conversation is SWE-Smith-shaped like ``qwen4exp-bench``'s (a first user message of --first-turn-tokens, then
+--turn-tokens a turn and an assistant reply of --reply-tokens), random words of the tokenizer's vocabulary; each
turn's whole prompt is rendered by the chat template and tokenized both ways (the ids are checked equal), median of
--repeats. The tokenizer defaults to tiny-coder's (byte-level BPE, as the served model's).
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def words(tok, rng, n: int) -> str:
    vocab = [t for t in tok.get_vocab() if t.startswith("Ġ") and t[1:].isalpha()]
    return "".join(tok.convert_tokens_to_string([rng.choice(vocab)]) for _ in range(n))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "qwen4exp", "assets", "tiny-coder"))
    ap.add_argument("--first-turn-tokens", type=int, default=50000)
    ap.add_argument("--turn-tokens", type=int, default=800)
    ap.add_argument("--reply-tokens", type=int, default=128)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench_out/tokenize")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from qwen4exp.serving.tokenize_cache import SegmentTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    rng = random.Random(0)
    msgs = [{"role": "user", "content": words(tok, rng, args.first_turn_tokens)}]
    rows = []
    for turn in range(1, args.turns + 1):
        if turn > 1:
            msgs += [{"role": "assistant", "content": words(tok, rng, args.reply_tokens)},
                     {"role": "user", "content": words(tok, rng, args.turn_tokens)}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        plain_ms, cached_ms = [], []
        for _ in range(args.repeats):
            cache = SegmentTokenizer.for_tokenizer(tok, 10**8)
            if turn > 1:  # the turn before went through the cache (what a server holds when this turn comes)
                cache.encode(tok.apply_chat_template(msgs[:-2], tokenize=False, add_generation_prompt=True))
            t = time.perf_counter()
            ids = tok(text, add_special_tokens=False)["input_ids"]
            plain_ms.append(1000 * (time.perf_counter() - t))
            t = time.perf_counter()
            got = cache.encode(text)
            cached_ms.append(1000 * (time.perf_counter() - t))
            assert got == list(ids), f"turn {turn}: the cache's ids differ from the tokenizer's"
        rows.append({"turn": turn, "prompt_tokens": len(ids), "plain_ms": round(statistics.median(plain_ms), 2),
                     "cached_ms": round(statistics.median(cached_ms), 2),
                     "speedup": round(statistics.median(plain_ms) / statistics.median(cached_ms), 1)})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tokenize.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{'turn':>4} {'prompt tokens':>13} {'tokenizer ms':>12} {'cached ms':>9} {'speed-up':>8}")
    for r in rows:
        print(f"{r['turn']:>4} {r['prompt_tokens']:>13,} {r['plain_ms']:>12} {r['cached_ms']:>9} {r['speedup']:>7}x")
    print(f"CSV: {os.path.join(args.out, 'tokenize.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
