"""QWEN4EXP_KNOBS: launch settings of the Triton ops overridden from the environment (A/B runs of whole engines)."""

import pytest

from qwen4exp.ops._dispatch import apply_knobs


def _ns():
    return dict(FUSED=False, TOPK_SMALL_BITS=1, TOPK="triton", RATIO=0.5, _private=3)


def test_knobs_set_typed_values_of_their_op_only(monkeypatch):
    monkeypatch.setenv("QWEN4EXP_KNOBS", " hc.FUSED=1, qsa.TOPK_SMALL_BITS=8,hc.RATIO=0.25 ,qsa.TOPK=torch")
    hc, qsa = _ns(), _ns()
    apply_knobs(hc, "hc")
    apply_knobs(qsa, "qsa")
    assert hc == dict(FUSED=True, TOPK_SMALL_BITS=1, TOPK="triton", RATIO=0.25, _private=3)
    assert qsa == dict(FUSED=False, TOPK_SMALL_BITS=8, TOPK="torch", RATIO=0.5, _private=3)
    assert type(qsa["TOPK_SMALL_BITS"]) is int and hc["FUSED"] is True


def test_knobs_unset_leave_the_defaults(monkeypatch):
    monkeypatch.delenv("QWEN4EXP_KNOBS", raising=False)
    ns = _ns()
    apply_knobs(ns, "hc")
    assert ns == _ns()


@pytest.mark.parametrize("spec, msg", [
    ("hc.NOPE=1", "hc.NOPE=1"),               # unknown setting: named
    ("hc._private=1", "hc._private=1"),       # not a launch setting
    ("hc.FUSED", "hc.FUSED"),                 # no value
    ("hc.FUSED=maybe", "hc.FUSED wants 0/1"),
    ("hc.TOPK_SMALL_BITS=eight", "hc.TOPK_SMALL_BITS wants a int"),
])
def test_knobs_bad_entries_name_the_setting(monkeypatch, spec, msg):
    monkeypatch.setenv("QWEN4EXP_KNOBS", spec)
    with pytest.raises(ValueError, match=msg.replace(".", r"\.")):
        apply_knobs(_ns(), "hc")
