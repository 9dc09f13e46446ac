"""Kernel registration and dispatch for the ops: each op folder registers its own kernels, loaded lazily.

An op folder ``ops/<op>/`` holds ``reference.py`` (readable torch), the kernel source (``triton_kernel.py``, ...)
and ``cuda.py``: the registration of its CUDA kernels as ``qwen4exp::<name>`` custom operators plus the host-side
wrappers that check what each kernel covers and send the rest to the reference. The folder's ``__init__.py``
(the dispatcher) declares them with ``Kernels(__name__, cuda=".cuda")`` and calls ``pick`` per call:

* ``cuda.py`` is imported the first time the op sees a CUDA tensor, so importing ``qwen4exp.ops`` never imports
  Triton (a CPU environment has none);
* an import failure disables that op folder's kernels alone, with one warning naming the folder and the error;
* ``KERNELS`` in ``cuda.py`` maps op names to their wrappers; ops it lacks use the reference;
* ``QWEN4EXP_OPS=reference`` (``qwen4exp.envs``) sends every op to its reference.

``record()`` tells tests which implementation ran: wrappers call ``ran(op, "kernel")`` on their kernel path, the
dispatcher ``ran(op, "reference")`` when it picks the reference, so a GPU test can assert its kernel ran and not
a fallback. While it is active the kernel modules' ``LAUNCHED`` tables (``Launches``) also keep each kernel's last
launch; otherwise nothing is stored per launch.

Custom operators are defined straight in a ``torch.library.Library`` fragment (schema inferred from the type
hints, the kernel as the CUDA implementation, the fake as the Meta one) rather than through
``torch.library.custom_op``, whose Python wrapper (autograd routing, aliasing checks) costs ~20 us more per call;
eager steps (prefill, mixed batches) call about ten of these per layer.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from typing import Callable, Optional

import torch

from .. import envs

_RECORD: Optional[dict] = None  # {op: implementation} while record() is active


@contextlib.contextmanager
def record():
    """``with record() as ran: ...``: afterwards ``ran[op]`` is "kernel" or "reference", whichever ran last. Nested
    records nest: what an inner one saw is the outer one's too."""
    global _RECORD
    prev, _RECORD = _RECORD, {}
    try:
        yield _RECORD
    finally:
        inner, _RECORD = _RECORD, prev
        if prev is not None:
            prev.update(inner)


def ran(op: str, impl: str) -> None:
    if _RECORD is not None:
        _RECORD[op] = impl


class Launches(dict):
    """The last launch handle of each kernel of one kernel module (``LAUNCHED``), kept only while ``record()`` is
    active: tests read which kernels ran, benchmarks their registers and spills; a serving step stores nothing."""

    def keep(self, name: str, handle):
        if _RECORD is not None:
            self[name] = handle
        return handle


class Kernels:
    """The kernels of one op folder, by device type, loaded on first use (see the module docstring)."""

    def __init__(self, package: str, **modules: str):
        self.package, self.modules = package, modules
        self._loaded: dict[str, dict[str, Callable]] = {}
        self.errors: dict[str, str] = {}  # device type -> why its kernels are off

    def table(self, device_type: str) -> dict[str, Callable]:
        if device_type not in self._loaded:
            table: dict[str, Callable] = {}
            name = self.modules.get(device_type)
            if name is not None:
                try:
                    table = dict(importlib.import_module(name, self.package).KERNELS)
                except Exception as e:  # (no Triton, an incompatible kernel library, ...): this op only
                    self.errors[device_type] = f"{type(e).__name__}: {e}"
                    warnings.warn(f"qwen4exp: the {device_type} kernels of {self.package} are unavailable "
                                  f"({self.errors[device_type]}); its ops use their torch references", stacklevel=3)
            self._loaded[device_type] = table
        return self._loaded[device_type]

    def pick(self, op: str, device: torch.device, reference: Callable) -> Callable:
        if envs.QWEN4EXP_OPS != "reference":
            fn = self.table(device.type).get(op)
            if fn is not None:
                return fn
        if _RECORD is not None:
            _RECORD[op] = "reference"
        return reference


# ------------------------------------------------------------------------------------------- custom operators
_LIB: Optional[torch.library.Library] = None


def _lib() -> torch.library.Library:
    global _LIB
    if _LIB is None:  # lives as long as this module: the operators with it
        _LIB = torch.library.Library("qwen4exp", "FRAGMENT")
    return _LIB


class CustomOp:
    """``qwen4exp::<name>`` defined from ``fn``'s signature, ``fn`` as its CUDA kernel; calling this object calls
    the operator (the dispatcher, then ``fn``). ``register_fake`` works as a decorator, as custom_op's does."""

    def __init__(self, name: str, fn: Callable, mutates_args: tuple[str, ...]):
        self.name = name
        _lib().define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _lib().impl(name, fn, "CUDA")  # (any CUDA tensor among the arguments: e.g. a pinned host table + GPU rows)
        self._op = getattr(torch.ops.qwen4exp, name).default

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(f"qwen4exp::{self.name}", fake, lib=_lib())
        return fake

    def __call__(self, *args, **kwargs):
        return self._op(*args, **kwargs)


def custom_op(qualname: str, mutates_args=()):
    """Decorator: ``@custom_op("qwen4exp::name", mutates_args=(...))`` over the CUDA implementation."""
    ns, _, name = qualname.partition("::")
    if ns != "qwen4exp":
        raise ValueError(f"custom ops live in the qwen4exp namespace, got {qualname!r}")
    return lambda fn: CustomOp(name, fn, tuple(mutates_args))
