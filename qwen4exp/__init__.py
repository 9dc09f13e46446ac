"""qwen4exp: the Qwen4Exp architecture (Qwen3.8-Flash-Next) defined once, run by HF transformers and vLLM."""

from .configuration import ConfigError, Qwen4ExpConfig, Qwen4ExpTextConfig, Qwen4ExpVisionConfig, load_config

__version__ = "0.1.0"

_LAZY = {"Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "Qwen4ExpHybridCache"}


def __getattr__(name):
    if name in _LAZY:
        from . import hf

        return getattr(hf, name)
    if name == "presets":
        import importlib

        return importlib.import_module(".presets", __name__)
    raise AttributeError(name)


__all__ = ["Qwen4ExpConfig", "Qwen4ExpTextConfig", "Qwen4ExpVisionConfig", "ConfigError", "load_config",
           *sorted(_LAZY)]
