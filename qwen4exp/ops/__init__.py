"""Ops: one folder per op (``qwen4exp.ops.<op>``), each in one place:

* ``reference.py``: the readable torch reference, the contract every kernel is tested against;
* ``triton_kernel.py`` (or ``fla_kernel.py``: a library's kernels on our layout): the CUDA kernels;
* ``cuda.py``: their registration as ``qwen4exp::`` custom operators (with fakes) and the host wrappers, listed in
  ``KERNELS``; imported on the op's first CUDA call (``_registry``), so importing ``qwen4exp.ops`` never imports
  Triton;
* ``host.py``: what the kernels cover and the CUDA path's host-side logic, from shapes and dtypes alone (Triton-free,
  tested on the CPU);
* ``__init__.py``: the dispatcher (``_registry.Kernels(...).pick``): a kernel registered for the tensor's device,
  else the reference.

Tests: ``tests/ops/test_<op>.py``."""
