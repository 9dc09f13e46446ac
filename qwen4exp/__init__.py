"""qwen4exp: the Qwen4Exp architecture (Qwen3.8-Flash-Next) defined once, run by HF transformers and vLLM.

Imports are lazy so that light tools (the benchmark client, the serve launcher) start without torch/transformers.
"""

import importlib

__version__ = "0.1.0"

_FROM = {
    "Qwen4ExpConfig": ".configuration", "Qwen4ExpTextConfig": ".configuration",
    "Qwen4ExpVisionConfig": ".configuration", "ConfigError": ".configuration", "load_config": ".configuration",
    "Qwen4ExpForCausalLM": ".hf", "Qwen4ExpForConditionalGeneration": ".hf", "Qwen4ExpHybridCache": ".hf",
    "Qwen4ExpProcessor": ".hf",
}


def __getattr__(name):
    if name in _FROM:
        return getattr(importlib.import_module(_FROM[name], __name__), name)
    if name == "presets":
        return importlib.import_module(".presets", __name__)
    raise AttributeError(name)


__all__ = sorted(_FROM)
