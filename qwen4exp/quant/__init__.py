"""ModelOpt quantization for Qwen4Exp checkpoints: the config (both forms, vLLM's module matching) and torch references
for NVFP4 (routed experts) and FP8 (PLE table per tensor, MTP experts in 128x128 blocks). Pure math, no runtime."""

from .config import (LAYOUTS, LayerQuant, QuantConfig, is_layer_excluded, load_quant_config,  # noqa: F401
                     parse_quant_config)
from .errors import QuantConfigError, QuantTensorError  # noqa: F401
from .fp8 import (dequantize_fp8_block, dequantize_fp8_per_tensor, quantize_fp8_block,  # noqa: F401
                  quantize_fp8_per_tensor, validate_fp8_block, validate_fp8_per_tensor)
from .nvfp4 import (dequantize_nvfp4, fake_quant_activation_nvfp4, pack_fp4, quantize_nvfp4,  # noqa: F401
                    unpack_fp4, validate_nvfp4_tensors)
