"""``tools/vllm_tp_check.py``: which greedy differences between TP=1 and TP=N count as bf16 near-ties."""

from __future__ import annotations

import pytest
from script_loader import load_script

Q = 2.0 ** -6  # one bf16 step of logits in [2, 4)


@pytest.fixture(scope="module")
def tp():
    return load_script("vllm_tp_check")


def _row(base: float, steps: dict[int, int]) -> dict[int, float]:
    """Logprobs on a bf16 grid: token -> base - k steps."""
    return {t: base - k * Q for t, k in steps.items()}


def test_one_step_swap_is_a_near_tie(tp):
    # TP=1: a on top, b one step below; TP=N: b on top, a one step below (both at a rounding boundary)
    one = _row(-10.34, {1: 0, 2: 1, 3: 1, 4: 3})
    many = _row(-10.34, {2: 0, 1: 1, 3: 1, 4: 3})
    assert tp.near_tie(one, many, 1, 2)


def test_exact_tie_broken_differently_is_a_near_tie(tp):
    one = _row(-10.34, {1: 0, 2: 0, 3: 2})
    many = _row(-10.34, {1: 0, 2: 0, 3: 2})
    assert tp.near_tie(one, many, 1, 2)


def test_two_steps_apart_is_not_a_tie(tp):
    one = _row(-10.34, {1: 0, 2: 2, 3: 1, 4: 3})
    many = _row(-10.34, {2: 0, 1: 1, 3: 1, 4: 3})
    assert not tp.near_tie(one, many, 1, 2)


def test_token_missing_from_a_row_is_not_a_tie(tp):
    one = _row(-10.34, {1: 0, 3: 1})
    many = _row(-10.34, {2: 0, 1: 1, 3: 1})
    assert not tp.near_tie(one, many, 1, 2)
