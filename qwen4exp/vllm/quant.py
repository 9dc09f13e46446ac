"""ModelOpt checkpoints (NVFP4 routed experts, block-FP8 MTP experts, FP8 PLE table) in the vLLM plugin.

Which module gets which format is the checkpoint config's decision, read with ``qwen4exp.quant`` exactly as vLLM 0.32
reads it (exclude wildcards, MIXED_PRECISION's ``quantized_layers``); everything but the routed experts and the PLE
table stays in the model dtype whatever the config says (our linears are built without a quant config).

* GPUs: the routed experts are vLLM's FusedMoE with the checkpoint's quant config, so vLLM's own NVFP4 MoE method
  (``ModelOptNvFp4FusedMoE``; the backend from its oracle: Humming / Marlin weight-only on Hopper, FlashInfer
  TRT-LLM / CUTLASS W4A4 on Blackwell) or block-FP8 MoE method (``Fp8MoEMethod``) loads and runs them.
* CPU: vLLM has no NVFP4 (nor block-FP8) MoE there; the experts are dequantized to the model dtype at load with the
  reference dequantization (``qwen4exp.quant.experts``), bit for bit the HF reference's weights, and one INFO line
  says so.
* The PLE table listed FP8 is kept FP8 (host or device, as ``QWEN4EXP_PLE_TABLE`` says) with its per-tensor scale;
  its rows are dequantized at lookup, as the HF reference does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm.config import VllmConfig

from ..quant import QuantConfig, QuantConfigError, load_quant_config, parse_quant_config
from ..quant.experts import expert_format

# our plugin's module names are the text-only checkpoint names (model.*, lm_head, mtp.*)
LAYOUT = "hf_text"
RUNTIME = "the qwen4exp vLLM plugin"


def checkpoint_quant(vllm_config: VllmConfig) -> QuantConfig | None:
    """The served checkpoint's ModelOpt config (``qwen4exp.quant``), None for an unquantized one. Cached on the
    model config."""
    mc = vllm_config.model_config
    cached = getattr(mc, "_qwen4exp_quant", False)
    if cached is not False:
        return cached
    q = None
    if os.path.isdir(str(mc.model)):
        q = load_quant_config(str(mc.model))
    else:  # a hub id: vLLM has the config.json form in the HF config
        raw = getattr(mc.hf_config, "quantization_config", None)
        if raw is None:
            raw = getattr(mc.hf_text_config, "quantization_config", None)
        q = None if raw is None else parse_quant_config(dict(raw))
    try:
        mc._qwen4exp_quant = q
    except (AttributeError, TypeError):
        pass
    return q


@dataclass(frozen=True)
class ExpertsQuant:
    """How one routed-experts module is stored and served: ``fmt`` "nvfp4" | "fp8_block" | None (unquantized),
    ``weight_only`` (no ``input_scale`` read), ``native`` (vLLM's quantized MoE method runs it; else dequantized to
    the model dtype at load)."""

    fmt: str | None = None
    weight_only: bool = True
    native: bool = False
    algo: str | None = None


def native_quantized_moe() -> bool:
    """vLLM runs NVFP4 / block-FP8 MoE on CUDA(-alike) GPUs only."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def experts_quant(vllm_config: VllmConfig, prefix: str) -> ExpertsQuant:
    qcfg = checkpoint_quant(vllm_config)
    algo = None if qcfg is None else qcfg.layer_algo(prefix, LAYOUT)
    if algo is None:
        return ExpertsQuant()
    fmt, weight_only = expert_format(algo, base=prefix, source=qcfg.source, runtime=RUNTIME)
    return ExpertsQuant(fmt, weight_only, native_quantized_moe(), algo)


# vLLM's MoE method classes for our formats (checked after FusedMoE is built: a config vLLM resolves differently
# from us would otherwise fail later, at the first tensor, with a message about vLLM's parameter names)
VLLM_MOE_METHODS = {"nvfp4": ("ModelOptNvFp4FusedMoE",), "fp8_block": ("Fp8MoEMethod",)}


def check_moe_method(experts, eq: ExpertsQuant, prefix: str) -> None:
    """``experts``: what FusedMoEFactory built (a MoERunner in vLLM 0.32, whose ``routed_experts`` holds the
    method; or the RoutedExperts layer itself)."""
    method = type(getattr(getattr(experts, "routed_experts", experts), "quant_method", None)).__name__
    want = VLLM_MOE_METHODS[eq.fmt]
    if method not in want:
        raise QuantConfigError(f"qwen4exp: routed experts {prefix} are {eq.algo} in the checkpoint, but vLLM's quant "
                               f"config gives them {method} (expected {' or '.join(want)})")


def ple_table_fp8(vllm_config: VllmConfig) -> bool:
    """Whether the config lists a PLE table as FP8 (the table is then allocated FP8)."""
    qcfg = checkpoint_quant(vllm_config)
    if qcfg is None or not qcfg.is_mixed:
        return False
    return any(name.endswith(".ngram_embedding") and lq.algo == "FP8" for name, lq in qcfg.quantized_layers)
