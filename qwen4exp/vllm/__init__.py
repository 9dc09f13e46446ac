"""vLLM plugin: serves Qwen4Exp with ``qwen4exp``'s model (runs on CPU, where vLLM's in-tree ``qwen4_exp`` cannot).

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every process (API server, engine core,
workers, the registry-inspection subprocess), so it is idempotent and cheap: it only records lazy class paths.
``QWEN4EXP_VLLM=0`` leaves vLLM's own classes in place.
"""

from __future__ import annotations

import logging
import os

ARCHITECTURES = ("Qwen4ExpForConditionalGeneration", "Qwen4ExpForCausalLM")

_registered: bool | None = None
logger = logging.getLogger("qwen4exp.vllm")


def _log(msg: str, *args) -> None:
    try:
        from vllm.logger import init_logger

        init_logger("qwen4exp.vllm").info(msg, *args)
    except Exception:  # pragma: no cover - vllm logger unavailable
        logger.info(msg, *args)


def register() -> bool:
    """Register our classes with vLLM's ModelRegistry (once per process). Returns True when ours serve Qwen4Exp."""
    global _registered
    if _registered is not None:
        return _registered
    if os.environ.get("QWEN4EXP_VLLM", "1").strip().lower() in ("0", "false", "no", "off"):
        _registered = False
        _log("Qwen4Exp served by vLLM's in-tree implementation (QWEN4EXP_VLLM=0)")
        return False
    from vllm import ModelRegistry

    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, f"qwen4exp.vllm.model:{arch}")
    _registered = True
    _log("Qwen4Exp served by the qwen4exp plugin (qwen4exp.vllm.model: %s)", ", ".join(ARCHITECTURES))
    return True
