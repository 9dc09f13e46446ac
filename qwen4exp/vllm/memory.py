"""Idle heap trim for vLLM's CPU worker: freed heap memory goes back to the OS once the model has been idle a while.

Why: serving on CPU, every step allocates and frees activations whose sizes change with the batch. glibc's malloc
keeps freed heap memory for reuse, and raises its mmap threshold after the first large frees (up to 32 MiB), so the
activations come from the heap, whose free space it can only give back from the top; with live chunks above it,
the worker's RSS grows with served requests although the memory is free. A fixed ``MALLOC_MMAP_THRESHOLD_`` keeps it
flat but slows every step (fresh zeroed pages for every large tensor); ``malloc_trim(0)`` when idle costs nothing
under load. Measurements: docs/performance.md, "Server memory over a soak (CPU)".

``QWEN4EXP_IDLE_TRIM`` seconds (default 0.5; 0: off) after the last forward ended, with none running, a daemon
thread calls ``malloc_trim(0)`` once (again only after the next forward; never during one, however long it takes).
The first step after an idle spell faults the pages back in (a few ms).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Callable, Optional

from .. import envs


class IdleTrim:
    """Calls ``trim(0)`` once per idle spell: ``idle_s`` seconds after the last forward ended (``end()``), with no
    forward running (between ``begin()`` and ``end()``)."""

    def __init__(self, idle_s: float, trim: Callable[[int], int], clock: Callable[[], float] = time.monotonic):
        self.idle_s, self.trim, self.clock = idle_s, trim, clock
        self.last_end = clock()
        self.busy = False  # a forward is running
        self.pending = False  # a forward ran since the last trim
        self.count = 0
        self.lock = threading.Lock()  # a trim in progress holds a starting forward back (and no trim starts in one)

    def begin(self) -> None:
        with self.lock:
            self.busy = self.pending = True

    def end(self) -> None:
        self.last_end = self.clock()
        self.busy = False

    def poll(self) -> bool:
        """Trim if a forward ran since the last trim, none runs, and the last ended ``idle_s`` ago; whether it
        trimmed."""
        with self.lock:
            if self.busy or not self.pending or self.clock() - self.last_end < self.idle_s:
                return False
            self.pending = False
            self.trim(0)
            self.count += 1
            return True

    def run(self) -> None:  # the daemon thread's loop
        while True:
            time.sleep(self.idle_s / 2)
            self.poll()


def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        f = ctypes.CDLL(None).malloc_trim  # glibc; absent elsewhere (musl, macOS)
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_size_t], ctypes.c_int
    return f


_idle: Optional[IdleTrim] = None


def start_idle_trim() -> Optional[IdleTrim]:
    """Start the idle trim thread of this process (once; None when off or without glibc)."""
    global _idle
    if _idle is None:
        idle_s, trim = envs.QWEN4EXP_IDLE_TRIM, _malloc_trim()
        if not idle_s or trim is None:
            return None
        _idle = IdleTrim(idle_s, trim)
        threading.Thread(target=_idle.run, name="qwen4exp-idle-trim", daemon=True).start()
    return _idle


def begin() -> None:
    """A forward starts (for the idle trim; a no-op when it is off)."""
    if _idle is not None:
        _idle.begin()


def end() -> None:
    """A forward ended (a clock read)."""
    if _idle is not None:
        _idle.end()
