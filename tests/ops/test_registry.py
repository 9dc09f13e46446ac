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
