"""Agentic multi-turn benchmark (``qwen4exp-bench``).

SWE-Smith shaped synthetic conversations replayed against an OpenAI-compatible
server over a concurrency sweep, reporting the metrics the field publishes
(per-user tok/s = 1000 / mean TPOT, tok/s per GPU, TTFT, ITL, prefix-cache hit
rate, MTP acceptance length). See :mod:`qwen4exp.bench.metrics` for the exact
definitions and ``qwen4exp-bench --help`` for the flags.
"""

from .cli import main

__all__ = ["main"]
