"""FP8 E4M3 references: per-tensor (the PLE n-gram table), per-row (the MTP drafts' LM head copy, derived at load) and
128x128 block scales (the MTP head's routed experts, ModelOpt ``FP8_PB_WO``). Scales are multiplicative: ``w =
float(weight) * weight_scale``.

* per tensor: ``weight`` float8_e4m3fn [rows, cols], ``weight_scale`` float32 scalar (``[]`` or ``[1]``) = amax / 448
  (ModelOpt ``get_scaling_factor``: ``amax.float() / maxbound``; ``to_quantized_weight``: ``(w / scale).to(e4m3)``).
* blocks: ``weight`` float8_e4m3fn [out, in], ``weight_scale`` float32 [ceil(out/128), in/128] (vLLM also takes
  ModelOpt's 4-D ``[out/128, 1, in/128, 1]``, ``KFp8Block128``, modelopt.py:2214-2268), one scale per 128x128 tile =
  tile amax / 448 (ModelOpt ``FP8QTensor.quantize`` with ``block_sizes={-1: 128, -2: 128}``; zero padding).

A zero amax becomes 448 (scale 1), as ModelOpt's ``TensorQuantizer.export_amax`` does.
"""

from __future__ import annotations

import math

import torch

from .errors import QuantTensorError

E4M3_MAX = 448.0
BLOCK_SIZE = 128


def _amax_to_scale(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float()
    return torch.where(amax == 0, torch.full_like(amax, E4M3_MAX), amax) / E4M3_MAX


def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` -> ``(weight float8_e4m3fn, weight_scale float32 scalar)``; values are rounded to nearest even."""
    scale = _amax_to_scale(w.abs().amax())
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def quantize_fp8_per_row(w: torch.Tensor, chunk_rows: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [rows, cols] -> ``(weight float8_e4m3fn [rows, cols], weight_scale float32 [rows, 1])``, one scale per
    row (output channel) = row amax / 448. Rows go ``chunk_rows`` at a time, so a 248k-row LM head needs float32
    room for one chunk, not for the whole matrix."""
    if w.ndim != 2:
        raise ValueError(f"per-row FP8 wants a 2-D weight, got shape {tuple(w.shape)}")
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(w.shape[0], 1, dtype=torch.float32, device=w.device)
    for r in range(0, w.shape[0], chunk_rows):
        rows = w[r:r + chunk_rows].float()
        s = _amax_to_scale(rows.abs().amax(dim=1, keepdim=True))
        q[r:r + chunk_rows] = (rows / s).to(torch.float8_e4m3fn)
        scale[r:r + chunk_rows] = s
    return q, scale


def dequantize_fp8_per_tensor(weight: torch.Tensor, weight_scale: torch.Tensor | float,
                              dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Per-tensor FP8 -> ``dtype``, computed as vLLM's FP8 PLE embedding method does it (in ``dtype``:
    ``weight.to(dtype) * weight_scale.to(dtype)``, models/qwen4_exp/common/ngram_embedding.py:336-346), so the PLE rows
    our runtimes look up equal vLLM's bit for bit. E4M3 -> bf16/fp32 is exact; the scale and the product round once
    each in ``dtype``."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    s = torch.as_tensor(weight_scale, dtype=torch.float32, device=weight.device)
    if s.numel() != 1:
        raise ValueError(f"per-tensor weight_scale must hold one value, got shape {tuple(s.shape)}")
    return weight.to(dtype) * s.reshape(()).to(dtype)


def _block_scale_2d(weight_scale: torch.Tensor) -> torch.Tensor:
    # ModelOpt's 4-D export [ob, 1, ib, 1] (possibly under leading expert dims) -> [ob, ib]
    if weight_scale.ndim >= 4 and weight_scale.shape[-1] == 1 and weight_scale.shape[-3] == 1:
        return weight_scale.squeeze(-1).squeeze(-2)
    return weight_scale


def quantize_fp8_block(w: torch.Tensor, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., out, in] -> ``(weight float8_e4m3fn [..., out, in], weight_scale float32 [..., ceil(out/b),
    ceil(in/b)])``. Partial edge tiles are zero-padded for their amax, as ModelOpt pads."""
    *lead, rows, cols = w.shape
    rb, cb = math.ceil(rows / block_size), math.ceil(cols / block_size)
    padded = torch.zeros(*lead, rb * block_size, cb * block_size, dtype=w.dtype, device=w.device)
    padded[..., :rows, :cols] = w
    tiles = padded.reshape(*lead, rb, block_size, cb, block_size)
    scale = _amax_to_scale(tiles.abs().amax(dim=(-3, -1)))
    expanded = scale.repeat_interleave(block_size, dim=-2).repeat_interleave(block_size, dim=-1)
    q = (padded.float() / expanded).to(torch.float8_e4m3fn)
    return q[..., :rows, :cols].contiguous(), scale


def dequantize_fp8_block(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                         block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Block FP8 -> ``dtype``: in float32 ``float(weight) * weight_scale`` (tile-broadcast), one rounding to ``dtype``
    (vLLM's ``scaled_dequantize``, quantization/utils/quant_utils.py:489-501). Leading expert dims are kept."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    s = _block_scale_2d(weight_scale).to(torch.float32)
    rows, cols = weight.shape[-2:]
    want = (*weight.shape[:-2], math.ceil(rows / block_size), math.ceil(cols / block_size))
    if tuple(s.shape) != want:
        raise ValueError(f"weight_scale shape {tuple(weight_scale.shape)} does not fit weight {tuple(weight.shape)} "
                         f"with {block_size}x{block_size} blocks (want {want})")
    expanded = s.repeat_interleave(block_size, dim=-2)[..., :rows, :]
    expanded = expanded.repeat_interleave(block_size, dim=-1)[..., :cols]
    return (weight.to(torch.float32) * expanded).to(dtype)


def _check_scale_values(name: str, t: torch.Tensor) -> None:
    bad = ~(torch.isfinite(t) & (t > 0))
    if bad.any():
        first = float(t.reshape(-1)[bad.reshape(-1)][0])
        raise QuantTensorError(f"{name} must be finite and > 0 everywhere, got {first}")


def _check_present_and_typed(name: str, weight: torch.Tensor | None, scale: torch.Tensor | None, scale_name: str,
                             why: str) -> None:
    """Both tensors there, the weight e4m3 and its scale fp32 (what every FP8 form shares)."""
    if weight is None:
        raise QuantTensorError(f"{name}.weight is missing")
    if scale is None:
        raise QuantTensorError(f"{name}.{scale_name} is missing ({why})")
    if weight.dtype != torch.float8_e4m3fn:
        raise QuantTensorError(f"{name}.weight must be torch.float8_e4m3fn, got {weight.dtype}")
    if scale.dtype != torch.float32:
        raise QuantTensorError(f"{name}.{scale_name} must be torch.float32, got {scale.dtype}")


def validate_fp8_per_tensor(name: str, weight: torch.Tensor | None, weight_scale: torch.Tensor | None,
                            rows: int, cols: int) -> None:
    """Check a per-tensor FP8 tensor (``name`` = the module, e.g. ``...ple.ple_embedding.ngram_embedding``)."""
    _check_present_and_typed(name, weight, weight_scale, "weight_scale", "per-tensor FP8 needs its scale")
    if tuple(weight.shape) != (rows, cols):
        raise QuantTensorError(f"{name}.weight must have shape {(rows, cols)}, got {tuple(weight.shape)}")
    if weight_scale.numel() != 1 or weight_scale.ndim > 1:
        raise QuantTensorError(f"{name}.weight_scale must be a per-tensor scalar, got shape "
                               f"{tuple(weight_scale.shape)}")
    _check_scale_values(f"{name}.weight_scale", weight_scale)


def validate_fp8_block(name: str, weight: torch.Tensor | None, weight_scale: torch.Tensor | None,
                       in_features: int, out_features: int, *, block_size: int = BLOCK_SIZE,
                       scale_name: str = "weight_scale") -> None:
    """Check a 128x128 block-FP8 linear (``scale_name``: ``weight_scale`` as ModelOpt writes it, or
    ``weight_scale_inv`` in the DeepSeek naming vLLM's block-FP8 MoE method uses)."""
    _check_present_and_typed(name, weight, weight_scale, scale_name, "block FP8 needs its scales")
    if tuple(weight.shape) != (out_features, in_features):
        raise QuantTensorError(f"{name}.weight must have shape {(out_features, in_features)}, got "
                               f"{tuple(weight.shape)}")
    if in_features % block_size:  # vLLM pads only the output side (modelopt.py:2227-2233)
        raise QuantTensorError(f"{name}.weight: block FP8 needs in_features to be a multiple of {block_size}, "
                               f"got {in_features}")
    want = (math.ceil(out_features / block_size), in_features // block_size)
    if tuple(_block_scale_2d(weight_scale).shape) != want or weight_scale.ndim not in (2, 4):
        raise QuantTensorError(f"{name}.{scale_name} must have shape {want} (or [{want[0]}, 1, {want[1]}, 1]), got "
                               f"{tuple(weight_scale.shape)}")
    _check_scale_values(f"{name}.{scale_name}", weight_scale)
