"""vLLM's own CPU-usable quantization helpers, as independent oracles (skipped where vLLM is not installed)."""

import importlib
import types

import pytest


@pytest.fixture(scope="session")
def vllm_oracle():
    pytest.importorskip("vllm")
    emu = importlib.import_module("vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils")
    qu = importlib.import_module("vllm.model_executor.layers.quantization.utils.quant_utils")
    mo = importlib.import_module("vllm.model_executor.layers.quantization.modelopt")
    mu = importlib.import_module("vllm.model_executor.models.utils")
    return types.SimpleNamespace(
        break_fp4_bytes=emu.break_fp4_bytes, dequantize_to_dtype=emu.dequantize_to_dtype, cast_to_fp4=emu.cast_to_fp4,
        ref_nvfp4_quant_dequant=emu.ref_nvfp4_quant_dequant, scaled_dequantize=qu.scaled_dequantize,
        GroupShape=qu.GroupShape, ModelOptNvFp4Config=mo.ModelOptNvFp4Config,
        ModelOptMixedPrecisionConfig=mo.ModelOptMixedPrecisionConfig, WeightsMapper=mu.WeightsMapper)
