"""``qwen4exp.ops._registry``: what the kernel modules keep per launch (``Launches``) is opt-in."""

from __future__ import annotations

from qwen4exp.ops import _registry


def test_launches_are_kept_only_while_recording():
    table, handle = _registry.Launches(), object()
    assert table.keep("k", handle) is handle  # the launch's handle passes through either way
    assert "k" not in table  # a serving step stores nothing
    with _registry.record():
        table.keep("k", handle)
    assert table["k"] is handle
    table.clear()
    with _registry.record():
        with _registry.record():  # nested: still recording
            table.keep("inner", handle)
        table.keep("outer", handle)
    assert set(table) == {"inner", "outer"}
    table.keep("after", handle)
    assert "after" not in table


def test_nested_records_report_to_the_outer_one():
    """A test's ``expect_kernel`` (an outer record) around a block that records launches itself (an inner one) still
    sees which implementation ran (run 31: four GPU tests found "nothing ran" before)."""
    with _registry.record() as outer:
        with _registry.record() as inner:
            _registry.ran("hc_mix", "kernel")
        assert inner == {"hc_mix": "kernel"}
        _registry.ran("rms_norm", "reference")
    assert outer == {"hc_mix": "kernel", "rms_norm": "reference"}
    _registry.ran("after", "kernel")
    assert "after" not in outer
