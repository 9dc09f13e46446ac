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
