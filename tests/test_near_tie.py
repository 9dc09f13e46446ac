"""``tests/near_tie.py``: the bf16 near-tie rule on hand-made runs."""

from near_tie import first_flip, ulp_bf16


def test_flip_rule():
    """Agreeing runs give None; a flip reports the first differing step, both runs' top-2 gaps and the bf16 ulp at
    the top logit, and whether the two tokens are the runs' top two."""
    same_lps = [{1: 5.0, 3: 1.0}, {2: 5.0, 4: 1.0}]
    assert first_flip([1, 2], same_lps, [1, 2], same_lps) is None
    step, ga, go, ulp, same = first_flip([1, 2, 9], [{1: 5.0}, {2: 10.0, 4: 9.9375}, {9: 1.0}],
                                         [1, 4, 7], [{1: 5.0}, {4: 10.0, 2: 9.9375}, {7: 1.0}])
    assert (step, ga, go, ulp, same) == (1, 0.0625, 0.0625, 0.0625, True)  # bf16 spacing in [8, 16): 2**-4
    assert first_flip([2], [{2: 10.0, 5: 9.9}], [4], [{4: 10.0, 5: 9.0}])[4] is False  # 2 not in the other's top 2
    assert first_flip([2], [{2: 10.0}], [4], [{4: 10.0}])[4] is False  # one logit a step: no pair to compare
    assert ulp_bf16(1.0) == 2.0 ** -7 and ulp_bf16(-3.0) == 2.0 ** -6


def test_drift_and_flip_within_a_bound():
    from near_tie import drift, flip_within
    a = [{1: 5.0, 2: 4.0}, {3: 7.0, 4: 6.9}, {5: 1.0}]
    b = [{1: 5.05, 2: 3.9}, {4: 7.0, 3: 6.95}, {6: 9.0}]  # parts at step 1: a near-tie in both runs
    assert abs(drift([1, 3, 5], a, [1, 4, 6], b) - 0.1) < 1e-9  # (step 1 counts; step 2 after the flip does not)
    assert flip_within([1, 3, 5], a, [1, 4, 6], b, 0.11) is None
    assert "gaps" in flip_within([1, 3, 5], a, [1, 4, 6], b, 0.06)
    assert "not both" in flip_within([1, 3], a[:2], [1, 4], [a[0], {4: 7.0, 8: 6.0}], 1.0)
    assert flip_within([1, 3], a[:2], [1, 3], a[:2], 0.0) is None
