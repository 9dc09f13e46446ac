"""Routed experts in a ModelOpt checkpoint, one projection at a time: which format a config's algo means, which
tensors one expert projection carries, their checks, and their dequantization. Shared by the HF reference's loader
(``qwen4exp.hf.quant``) and the vLLM plugin's (``qwen4exp.vllm.weights``), so both read the same tensors the same way.

Per expert ``e`` and projection ``p`` (gate_proj, up_proj: [I, D]; down_proj: [D, I]), ``...mlp.experts.{e}.{p}.``:

* ``nvfp4`` (NVFP4, W4A16_NVFP4): ``weight`` uint8 [out, in/2], ``weight_scale`` e4m3 [out, in/16],
  ``weight_scale_2`` fp32 scalar, ``input_scale`` fp32 scalar (W4A4 only; a weight-only checkpoint's is not read);
* ``fp8_block`` (FP8_PB_WO, the MTP head's): ``weight`` e4m3 [out, in] + fp32 128x128 block scales named
  ``weight_scale_inv`` (vLLM's block-FP8 MoE method's name) or ``weight_scale`` (ModelOpt's linear name).
"""

from __future__ import annotations

import torch

# the tensor names and field sets are the checkpoint layout's (re-exported for the loaders)
from ..checkpoint_layout import EXPERT_FIELDS, EXPERT_TENSOR, NVFP4_FIELDS, PROJS  # noqa: F401
from .config import NVFP4_ALGOS
from .errors import QuantConfigError, QuantTensorError
from .fp8 import dequantize_fp8_block, validate_fp8_block
from .nvfp4 import dequantize_nvfp4, validate_nvfp4_tensors


def is_quantized(t: torch.Tensor, field: str) -> bool:
    """Whether an expert tensor is a quantized one (any scale, or a 1-byte weight)."""
    return field != "weight" or t.dtype in (torch.uint8, torch.float8_e4m3fn)


def expert_format(algo: str, *, base: str, source: str, runtime: str = "the HF reference") -> tuple[str, bool]:
    """A config's algo for routed experts ``base`` -> (format "nvfp4" | "fp8_block", weight_only)."""
    if algo in NVFP4_ALGOS:
        return "nvfp4", algo == "W4A16_NVFP4"
    if algo == "FP8_PB_WO":
        return "fp8_block", True
    raise QuantConfigError(f"{source}: quant_algo {algo!r} for routed experts {base}: {runtime} reads routed "
                           f"experts as NVFP4, W4A16_NVFP4 or FP8_PB_WO (128x128 blocks)")


def projection_dims(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each expert projection."""
    D, I = config.hidden_size, config.moe_intermediate_size
    return {"gate_proj": (D, I), "up_proj": (D, I), "down_proj": (I, D)}


def check_expert_index(base: str, e: int, num_experts: int, tensor: str | None = None) -> None:
    """A checkpoint expert index must name one of the model's experts (QuantTensorError naming the tensor)."""
    if not 0 <= e < num_experts:
        raise QuantTensorError(f"{tensor or f'{base}.{e}'}: expert index out of range (the model has {num_experts} "
                               f"experts)")


def fp8_scale_name(fields) -> str:
    """The block-FP8 scale's name a checkpoint uses (``weight_scale`` only when it has no ``weight_scale_inv``)."""
    fields = set(fields)
    return "weight_scale" if "weight_scale" in fields and "weight_scale_inv" not in fields else "weight_scale_inv"


def required_fields(fmt: str, weight_only: bool, scale_name: str = "weight_scale_inv") -> tuple[str, ...]:
    """The tensors one projection must carry."""
    if fmt == "nvfp4":
        return NVFP4_FIELDS[:3] if weight_only else NVFP4_FIELDS
    return EXPERT_FIELDS[fmt][:1] + (scale_name,)


def check_projection(fmt: str, name: str, f: dict[str, torch.Tensor], in_f: int, out_f: int, *,
                     weight_only: bool, scale_name: str = "weight_scale_inv") -> None:
    """Check one expert projection's tensors ``f`` (field -> tensor; ``name`` = ``...experts.{e}.{p}``); raise
    QuantTensorError naming the tensor (missing, unknown, wrong dtype / shape / values)."""
    if fmt == "nvfp4":
        unknown = sorted(set(f) - set(NVFP4_FIELDS))
        if unknown:
            raise QuantTensorError(f"{name}.{unknown[0]}: not an NVFP4 tensor (NVFP4 experts carry "
                                   f"{', '.join(NVFP4_FIELDS)})")
        validate_nvfp4_tensors(name, f.get("weight"), f.get("weight_scale"), f.get("weight_scale_2"),
                               f.get("input_scale"), in_f, out_f, weight_only=weight_only)
        return
    unknown = sorted(set(f) - {"weight", scale_name})
    if unknown:
        raise QuantTensorError(f"{name}.{unknown[0]}: not a tensor of a block-FP8 expert (it carries weight and "
                               f"{scale_name})")
    validate_fp8_block(name, f.get("weight"), f.get(scale_name), in_f, out_f, scale_name=scale_name)


def block_scale_2d(s: torch.Tensor) -> torch.Tensor:
    """ModelOpt's [out/128, 1, in/128, 1] block scales as [out/128, in/128] (2-D ones unchanged)."""
    return s.squeeze(-1).squeeze(-2) if s.ndim == 4 else s


def dequantize_projection(fmt: str, f: dict[str, torch.Tensor], dtype: torch.dtype,
                          scale_name: str = "weight_scale_inv") -> torch.Tensor:
    """One checked projection -> its [out, in] weight in ``dtype`` (the reference dequantization)."""
    if fmt == "nvfp4":
        return dequantize_nvfp4(f["weight"], f["weight_scale"], f["weight_scale_2"], dtype)
    return dequantize_fp8_block(f["weight"], block_scale_2d(f[scale_name]), dtype)
