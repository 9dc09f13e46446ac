"""NVFP4 as a readable torch reference: E2M1 codes, packing, ModelOpt's weight quantizer, dequantization, and the
W4A4 activation fake-quant vLLM's emulation path applies.

Format (one quantized linear, ModelOpt export = what vLLM 0.32 loads, ``KNvfp4Static``/``KNvfp4Dynamic`` in
``model_executor/layers/quantization/modelopt.py:1987-2101``)::

    weight          uint8          [out, in/2]   two E2M1 codes a byte: element 2j in the low nibble, 2j+1 high
    weight_scale    float8_e4m3fn  [out, in/16]  one scale per 16 consecutive inputs
    weight_scale_2  float32        scalar        per-tensor: amax / (6 * 448)
    input_scale     float32        scalar        per-tensor activation scale amax_x / (6 * 448) (W4A4 only)

    w[o, i] = E2M1(code[o, i]) * float(weight_scale[o, i // 16]) * weight_scale_2

An E2M1 code is sign (bit 3) + magnitude index (bits 0-2) into {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
"""

from __future__ import annotations

import torch

from .errors import QuantTensorError

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# code -> value; code 8 is negative zero (ModelOpt writes it for small negative inputs)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# midpoints between neighbouring magnitudes; a value on a midpoint rounds to the even code (RNE), as ModelOpt's
# _cast_fp4 (searchsorted + odd-bound bump) and vLLM's cast_to_fp4 both do
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ODD_BOUNDS = (0.75, 1.75, 3.5)  # midpoints whose upper neighbour has the even code


def e2m1_table(device=None) -> torch.Tensor:
    """The 16 code values as float32."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) of the nearest E2M1 values to ``x`` (already divided by its scale): ties to the even code,
    magnitudes above 6 saturate to 6, the sign bit set for any x < 0 (so -0.1 -> code 8, -0). ModelOpt's
    ``NVFP4QTensor._cast_fp4`` (modelopt/torch/quantization/qtensor/nvfp4_tensor.py)."""
    x = x.float()
    mag = x.abs()
    bounds = torch.tensor(E2M1_BOUNDS, dtype=torch.float32, device=x.device)
    idx = torch.searchsorted(bounds, mag.contiguous())  # count of bounds < mag: a value on a bound stays below it
    on_odd = torch.zeros_like(mag, dtype=torch.bool)
    for b in _ODD_BOUNDS:
        on_odd |= mag == b
    idx = idx + on_odd.long()
    return (idx + 8 * (x < 0).long()).to(torch.uint8)


def codes_to_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8, 0..15)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"E2M1 codes must be uint8, got {codes.dtype}")
    return e2m1_table(codes.device)[codes.long()]


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (n even) -> bytes [..., n/2]: element 2j in the low nibble, 2j+1 in the high one
    (ModelOpt ``(q[..., 1::2] << 4) | q[..., 0::2]``; vLLM's ``break_fp4_bytes`` reads low nibble first)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"E2M1 codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"packing needs an even last dimension, got {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("E2M1 codes are 4-bit (0..15)")
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., m] -> uint8 codes [..., 2m], low nibble first."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed NVFP4 must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_fp4(values: torch.Tensor) -> torch.Tensor:
    """E2M1 values (each exactly one of the 16, -0.0 kept as code 8) [..., n] -> packed bytes [..., n/2]."""
    v = values.float()
    codes = round_to_e2m1(v)
    codes = torch.where(torch.signbit(v) & (v == 0), torch.full_like(codes, 8), codes)
    if not torch.equal(codes_to_values(codes), v):
        raise ValueError("pack_fp4: values must be exact E2M1 values (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6)")
    return pack_codes(codes)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., m] -> float32 E2M1 values [..., 2m]."""
    return codes_to_values(unpack_codes(packed))


def _block_amax(w: torch.Tensor, group_size: int) -> torch.Tensor:
    return w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size).abs().amax(dim=-1).float()


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | float | None = None,
                   group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt's NVFP4 weight quantizer (0.46+, ``NVFP4QTensor.quantize`` dynamic path), op for op in float32.

    ``w`` [..., out, in] (in % 16 == 0) -> ``(weight uint8 [..., out, in/2], weight_scale e4m3 [..., out, in/16],
    weight_scale_2 fp32 scalar)``::

        weight_scale_2 = amax|w| / (6 * 448)                 (``global_scale`` overrides it: fused gate/up share one)
        s              = block_amax / (6 * weight_scale_2);  s == 0 -> 1;  clamp [2^-9, 448];  cast to e4m3 (RNE)
        code           = E2M1_round(w / (float(s) * weight_scale_2))

    An all-zero ``w`` (ModelOpt would divide 0 by 0 into NaN scales) is given amax 6: zero codes, finite scales."""
    if w.shape[-1] % group_size:
        raise ValueError(f"NVFP4 needs the input dimension to be a multiple of {group_size}, got {tuple(w.shape)}")
    if global_scale is None:
        amax = w.abs().amax().float()
        amax = torch.where(amax == 0, torch.tensor(E2M1_MAX), amax)
        weight_scale_2 = amax / (E2M1_MAX * E4M3_MAX)
    else:
        weight_scale_2 = torch.as_tensor(global_scale, dtype=torch.float32).reshape(())
        if not (torch.isfinite(weight_scale_2) and weight_scale_2 > 0):
            raise ValueError(f"global_scale must be finite and > 0, got {float(weight_scale_2)}")
    weight_scale_2 = weight_scale_2.to(w.device)
    per_block = _block_amax(w, group_size) / (E2M1_MAX * weight_scale_2)
    per_block[per_block == 0] = 1.0
    weight_scale = per_block.clamp(min=2.0 ** -9, max=E4M3_MAX).to(torch.float8_e4m3fn)
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    scaled = blocks / (weight_scale.to(torch.float32) * weight_scale_2).unsqueeze(-1)
    codes = round_to_e2m1(scaled.reshape(w.shape))
    return pack_codes(codes), weight_scale, weight_scale_2


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | float,
                     dtype: torch.dtype = torch.bfloat16, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """Packed NVFP4 -> ``dtype`` [..., out, in], computed as vLLM's ``dequantize_to_dtype`` (swizzle=False,
    quantization/utils/nvfp4_emulation_utils.py:559-613) and ModelOpt's ``NVFP4QTensor.dequantize``: in float32,
    ``E2M1 * (float(weight_scale) * weight_scale_2)``, then one rounding to ``dtype``.

    Stacked experts: ``weight`` [E, out, in/2], ``weight_scale`` [E, out, in/16], ``weight_scale_2`` [E] (or a
    scalar shared by all)."""
    if weight.dtype != torch.uint8:
        raise TypeError(f"NVFP4 weight must be uint8, got {weight.dtype}")
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"NVFP4 weight_scale must be float8_e4m3fn, got {weight_scale.dtype}")
    values = unpack_fp4(weight)
    k = values.shape[-1]
    if weight_scale.shape != (*weight.shape[:-1], k // group_size):
        raise ValueError(f"weight_scale shape {tuple(weight_scale.shape)} does not fit weight {tuple(weight.shape)}")
    gs = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device)
    if gs.numel() == 1:
        gs = gs.reshape(())
    elif weight.ndim == 3 and gs.numel() == weight.shape[0]:
        gs = gs.reshape(-1, 1, 1)  # one global scale per expert
    else:
        raise ValueError(f"weight_scale_2 shape {tuple(gs.shape)} does not fit weight {tuple(weight.shape)}")
    sf = weight_scale.to(torch.float32) * gs
    out = values.reshape(*values.shape[:-1], k // group_size, group_size) * sf.unsqueeze(-1)
    return out.reshape(values.shape).to(dtype)


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    # vLLM's get_reciprocal (nvfp4_emulation_utils.py:616-623): a zero maps to 1e-8, not inf
    return 1.0 / (x + (x == 0) * 1e8)


def fake_quant_activation_nvfp4(x: torch.Tensor, input_scale: torch.Tensor | float,
                                group_size: int = GROUP_SIZE) -> torch.Tensor:
    """W4A4 emulation of the activation side: ``x`` [..., k] quantized to NVFP4 and back, in ``x``'s dtype.

    Per 16-block scale computed on the fly from the block's amax, with the checkpoint's static global scale; this is
    vLLM's ``ref_nvfp4_quant_dequant`` (nvfp4_emulation_utils.py:640-675) with ``global_scale = 1 / input_scale``
    (``input_global_scale_inv``, modelopt.py:2067-2101, emulation.py:40-46), op for op::

        g = 1 / input_scale;  s = e4m3(clamp(g * (block_amax * (1/6)), ±448))
        q = E2M1_round(clamp(x / (s / g), ±6));   x_dq = q * (s / g)"""
    if x.shape[-1] % group_size:
        raise ValueError(f"NVFP4 needs the last dimension to be a multiple of {group_size}, got {tuple(x.shape)}")
    g = 1.0 / torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(())
    shape = x.shape
    xb = x.reshape(-1, shape[-1] // group_size, group_size)
    vec_max = xb.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    s = g * (vec_max * (1.0 / E2M1_MAX))
    s = s.clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    inv = _reciprocal(s * _reciprocal(g))
    q = codes_to_values(round_to_e2m1((xb.to(torch.float32) * inv).clamp(-E2M1_MAX, E2M1_MAX)))
    return (q * (s / g)).reshape(shape).to(x.dtype)


def validate_nvfp4_tensors(name: str, weight: torch.Tensor | None, weight_scale: torch.Tensor | None,
                           weight_scale_2: torch.Tensor | None, input_scale: torch.Tensor | None,
                           in_features: int, out_features: int, *, weight_only: bool = False,
                           group_size: int = GROUP_SIZE) -> None:
    """Check one NVFP4 linear's checkpoint tensors (``name`` = the module, e.g. ``...experts.3.gate_proj``) against
    its shape; raise QuantTensorError naming the tensor. ``weight_only`` (W4A16_NVFP4): ``input_scale`` is not read,
    so it is not checked."""
    if in_features % group_size:
        raise QuantTensorError(f"{name}.weight: NVFP4 needs in_features to be a multiple of {group_size}, "
                               f"got {in_features}")
    expect = {
        "weight": (weight, torch.uint8, (out_features, in_features // 2)),
        "weight_scale": (weight_scale, torch.float8_e4m3fn, (out_features, in_features // group_size)),
        "weight_scale_2": (weight_scale_2, torch.float32, None),
        "input_scale": (input_scale, torch.float32, None),
    }
    for tname, (t, dtype, shape) in expect.items():
        if tname == "input_scale" and weight_only:
            continue  # not read: vLLM drops a W4A16 checkpoint's input_scale (_DROP_INPUT_SCALE, modelopt.py:2495)
        if t is None:
            raise QuantTensorError(f"{name}.{tname} is missing (NVFP4 needs weight, weight_scale, weight_scale_2"
                                   f"{'' if weight_only else ', input_scale'})")
        if t.dtype != dtype:
            raise QuantTensorError(f"{name}.{tname} must be {dtype}, got {t.dtype}")
        if shape is None:
            if t.numel() != 1 or t.ndim > 1:
                raise QuantTensorError(f"{name}.{tname} must be a per-tensor scalar, got shape {tuple(t.shape)}")
            v = float(t.reshape(()))
            if not (v > 0 and v != float("inf")):
                raise QuantTensorError(f"{name}.{tname} must be finite and > 0, got {v}")
        elif tuple(t.shape) != shape:
            raise QuantTensorError(f"{name}.{tname} must have shape {shape} for a [{out_features}, {in_features}] "
                                   f"layer, got {tuple(t.shape)}")
    if torch.isnan(weight_scale.to(torch.float32)).any():  # vLLM's never-loaded check (modelopt.py:2036-2052)
        raise QuantTensorError(f"{name}.weight_scale holds NaN")
