"""The bf16 near-tie rule shared by the tests that compare two greedy runs of one bf16 model whose arithmetic
differs (another batch, a resumed state): where the runs first part, the two tokens must be both runs' top two,
and both runs' top-2 gaps of raw logits (``logprobs_mode="raw_logits"``) within a few bf16 ulps."""

import math


def ulp_bf16(x: float) -> float:
    """Spacing of bf16 numbers (8 significant bits) at magnitude |x|."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


def top2(step: dict) -> list[tuple[int, float]]:
    return sorted(step.items(), key=lambda kv: -kv[1])[:2]


def first_flip(a_tokens, a_logits, b_tokens, b_logits):
    """None where the runs agree; else (step, gap in a, gap in b, ulp, same pair) at the first difference: each
    run's top-2 gap, the bf16 ulp at the larger top logit, and whether the two tokens are both runs' top two."""
    for j, (a, b) in enumerate(zip(a_tokens, b_tokens)):
        if a != b:
            ta, tb = top2(a_logits[j]), top2(b_logits[j])
            ulp = ulp_bf16(max(abs(ta[0][1]), abs(tb[0][1])))
            same = len(ta) == len(tb) == 2 and {ta[0][0], ta[1][0]} == {tb[0][0], tb[1][0]} == {a, b}
            return j, ta[0][1] - ta[-1][1], tb[0][1] - tb[-1][1], ulp, same
    return None


def drift(a_tokens, a_logits, b_tokens, b_logits) -> float:
    """The largest difference between two runs' raw logits of one token at one step, over the steps before their
    first different token (same context in both) and the tokens both runs report there: how far the two runs'
    arithmetic moves the logits, which bounds the gap a flip caused by it can close."""
    d = 0.0
    for j, (a, b) in enumerate(zip(a_tokens, b_tokens)):
        for t in set(a_logits[j]) & set(b_logits[j]):
            d = max(d, abs(a_logits[j][t] - b_logits[j][t]))
        if a != b:
            break
    return d


def flip_within(a_tokens, a_logits, b_tokens, b_logits, bound: float):
    """None where the runs agree or part on a tie no wider than ``bound`` in either run (each run's logit of its
    token minus that of the other run's token, both reported); else a description of the flip."""
    for j, (a, b) in enumerate(zip(a_tokens, b_tokens)):
        if a == b:
            continue
        la, lb = a_logits[j], b_logits[j]
        if not ({a, b} <= set(la) and {a, b} <= set(lb)):
            return f"step {j}: tokens {a} / {b} not both among each run's reported logits ({la} / {lb})"
        gap_a, gap_b = la[a] - la[b], lb[b] - lb[a]
        if gap_a > bound or gap_b > bound:
            return f"step {j}: tokens {a} / {b}, gaps {gap_a:.4g} / {gap_b:.4g} > {bound:.4g} ({la} / {lb})"
        return None
    return None
