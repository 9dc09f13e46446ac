"""Ops: one folder per op, each with a readable torch ``reference`` and a dispatcher (``__init__``) that routes to a
fast kernel where one is registered for the device (Triton on CUDA), and to the reference elsewhere."""
