"""``qwen4exp.vllm.memory``: the CPU worker's idle heap trim calls ``malloc_trim(0)`` once per idle spell, never
under load, and not at all with ``QWEN4EXP_IDLE_TRIM=0`` (recipes/soak_cpu.py measures what it does to RSS)."""

import sys

import pytest

from qwen4exp import envs
from qwen4exp.vllm import memory


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def forward(it, clock, seconds):
    it.begin()
    clock.t += seconds
    it.end()


def test_trims_once_per_idle_spell():
    clock, calls = Clock(), []
    it = memory.IdleTrim(0.5, calls.append, clock)
    clock.t += 1
    assert not it.poll()  # nothing ran yet: nothing to trim
    forward(it, clock, 0.1)
    clock.t += 0.4
    assert not it.poll()  # not idle long enough
    forward(it, clock, 0.1)
    clock.t += 0.4
    assert not it.poll()  # under load: a forward every 0.5 s never trims
    clock.t += 0.1
    assert it.poll() and calls == [0]
    clock.t += 5
    assert not it.poll() and it.count == 1  # still idle: once per spell
    it.begin()
    clock.t += 3
    assert not it.poll()  # never during a forward, however long
    it.end()
    clock.t += 0.6
    assert it.poll() and it.count == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_malloc_trim_found_and_switch_off(monkeypatch):
    assert memory._malloc_trim()(0) in (0, 1)
    monkeypatch.setattr(memory, "_idle", None)
    monkeypatch.setenv("QWEN4EXP_IDLE_TRIM", "0")
    envs.reset()
    try:
        assert memory.start_idle_trim() is None and memory._idle is None
        memory.begin(), memory.end()  # no thread: no-ops
    finally:
        envs.reset()
