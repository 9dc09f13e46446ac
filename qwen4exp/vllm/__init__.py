"""vLLM plugin: serves Qwen4Exp with ``qwen4exp``'s model (runs on CPU, where vLLM's in-tree ``qwen4_exp`` cannot).

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every process (API server, engine core,
workers, the registry-inspection subprocess), so it is idempotent and cheap: it only records lazy class paths.
``QWEN4EXP_VLLM=0`` leaves vLLM's own classes in place.
"""

from __future__ import annotations

import logging
import os

ARCHITECTURES = ("Qwen4ExpForConditionalGeneration", "Qwen4ExpForCausalLM")  # Qwen4ExpMTP: not yet

_registered: bool | None = None
logger = logging.getLogger("qwen4exp.vllm")


def _logger():
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.plugins.qwen4exp")  # under vLLM's logger: formatted and shown like vLLM's own
    except Exception:  # pragma: no cover - vllm logger unavailable
        return logger


def register() -> bool:
    """Register our classes with vLLM's ModelRegistry (once per process). Returns True when ours serve Qwen4Exp."""
    global _registered
    if _registered is not None:
        return _registered
    if os.environ.get("QWEN4EXP_VLLM", "1").strip().lower() in ("0", "false", "no", "off"):
        _registered = False
        _logger().info("Qwen4Exp is served by vLLM's in-tree implementation (QWEN4EXP_VLLM=0)")
        return False
    from vllm import ModelRegistry

    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, f"qwen4exp.vllm.model:{arch}")
    _registered = True
    # the INFO line naming the implementation is logged once, where the model is built (qwen4exp.vllm.model)
    _logger().debug("qwen4exp plugin registered %s", ", ".join(ARCHITECTURES))
    return True
