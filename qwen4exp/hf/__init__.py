"""HF transformers runtime (the readable reference): binds the hybrid cache and packs padded batches."""

from .cache import Qwen4ExpHybridCache
from .modeling import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration, Qwen4ExpTextModel
from .processing import Qwen4ExpProcessor, register as _register_processor

_register_processor()

__all__ = ["Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "Qwen4ExpTextModel", "Qwen4ExpHybridCache",
           "Qwen4ExpProcessor"]
