"""Quantized routed experts in the HF reference: loading a ModelOpt checkpoint's experts, and writing them back.

What the HF runtime reads (the format vLLM 0.32 reads, ``qwen4exp.quant``):

* routed experts NVFP4 (``NVFP4`` / ``W4A16_NVFP4``), per expert:
  ``...mlp.experts.{e}.{gate,up,down}_proj.{weight (uint8), weight_scale (e4m3), weight_scale_2 (fp32),
  input_scale (fp32; W4A4 only)}``. ModelOpt exports experts per expert and vLLM 0.32's ``RoutedExperts`` loader
  maps only per-expert names onto its NVFP4 parameters, so a fused (``experts.gate_up_proj``) NVFP4 tensor is refused.
* routed experts FP8 in 128x128 blocks (``FP8_PB_WO``, the MTP head's): ``...experts.{e}.{p}.weight`` (e4m3) +
  ``weight_scale_inv`` (vLLM's block-FP8 MoE method's name, what NVIDIA's checkpoint holds) or ``weight_scale``
  (ModelOpt's linear name), fp32 [ceil(out/128), in/128].
* the PLE table FP8 per tensor: handled by ``NGramTable`` (kept FP8, rows dequantized at lookup as vLLM does).

Two modes (``from_pretrained(..., quant_mode=...)``):

* ``"dequantize"`` (default): the experts are dequantized once at load into ordinary ``gate_up_proj`` / ``down_proj``
  parameters of the model dtype; the scales are kept (buffers) so that ``save_pretrained`` re-encodes the weights
  with them, bit for bit what was loaded while they are unchanged.
* ``"packed"``: the packed tensors stay as loaded (buffers) and each forward dequantizes the experts it routes to,
  so a model too large for its BF16 form loads. Both modes compute the same bits.

``emulate_w4a4=True`` (NVFP4 W4A4 checkpoints, either mode) fake-quantizes each expert GEMM's input as Blackwell's
W4A4 kernels quantize it: 16-element blocks, E4M3 block scales, the layer's static ``input_scale`` (the maximum over
its experts, as vLLM's NVFP4 MoE backends take it).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict

import torch
from torch import nn

from ..layers.moe import Experts
from ..quant import QuantConfigError, QuantTensorError
from ..quant.experts import (EXPERT_TENSOR, NVFP4_FIELDS, PROJS, block_scale_2d, check_expert_index,
                             check_projection, expert_format, fp8_scale_name, is_quantized, projection_dims)
from ..quant.fp8 import dequantize_fp8_block, quantize_fp8_block
from ..quant.nvfp4 import dequantize_nvfp4, fake_quant_activation_nvfp4, pack_codes, quantize_nvfp4, round_to_e2m1

log = logging.getLogger("qwen4exp")

QUANT_MODES = ("dequantize", "packed")
# a fused experts tensor and whatever suffix a producer may hang on it
FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(?:[._].*)?$")


class QuantizedExperts(Experts):
    """Routed experts of a quantized checkpoint, ``fmt`` "nvfp4" or "fp8_block" (see the module docstring).

    Per projection p (gate_proj, up_proj, down_proj) stacked over experts, as non-persistent buffers (the checkpoint
    tensors are written by ``checkpoint_tensors``): NVFP4 ``{p}_weight_scale`` [E, out, in/16], ``{p}_weight_scale_2``
    [E], ``{p}_input_scale`` [E] (W4A4); FP8 ``{p}_weight_scale`` [E, out/128, in/128]; packed mode also
    ``{p}_weight`` [E, out, in/2] uint8 (NVFP4) or [E, out, in] e4m3 (FP8)."""

    def __init__(self, config, fmt: str, packed: bool, dtype: torch.dtype, emulate_w4a4: bool = False,
                 fp8_scale_name: str = "weight_scale_inv"):
        nn.Module.__init__(self)
        self.num_experts = config.num_experts
        self.fmt, self.packed, self.dtype, self.emulate_w4a4 = fmt, packed, dtype, emulate_w4a4
        self.fp8_scale_name = fp8_scale_name
        self.weight_only = True
        self.has_input_scale = False
        self.act_scale: dict[str, torch.Tensor] = {}

    # -- building ----------------------------------------------------------------------------------------------------
    def set_tensors(self, stacked: dict[str, dict[str, torch.Tensor]], weight_only: bool) -> None:
        """``stacked[p][field]``: the checkpoint tensors of projection p stacked over experts (validated)."""
        self.weight_only = weight_only
        self.has_input_scale = "input_scale" in stacked["gate_proj"]
        for p in PROJS:
            for field, t in stacked[p].items():
                if field == "weight" and not self.packed:
                    continue
                self.register_buffer(f"{p}_{field}", t, persistent=False)
        if not self.packed:
            gate, up, down = (self._dequantize(p, None, stacked[p]["weight"]) for p in PROJS)
            self.gate_up_proj = nn.Parameter(torch.cat([gate, up], 1), requires_grad=False)
            self.down_proj = nn.Parameter(down, requires_grad=False)
        if self.fmt == "nvfp4" and not weight_only:
            # vLLM's NVFP4 MoE backends quantize a layer's activations with one static scale per GEMM: the maximum
            # over its experts (and over gate and up) of the checkpoint's input_scale (fused_moe/oracle/nvfp4.py)
            gate_up = torch.maximum(self.gate_proj_input_scale.max(), self.up_proj_input_scale.max())
            self.act_scale = {"gate_up": gate_up, "down": self.down_proj_input_scale.max()}

    def _dequantize(self, p: str, e: int | None, weight: torch.Tensor | None = None) -> torch.Tensor:
        sel = (lambda t: t) if e is None else (lambda t: t[e])
        w = sel(getattr(self, f"{p}_weight")) if weight is None else weight
        if self.fmt == "nvfp4":
            return dequantize_nvfp4(w, sel(getattr(self, f"{p}_weight_scale")),
                                    sel(getattr(self, f"{p}_weight_scale_2")), self.dtype)
        return dequantize_fp8_block(w, sel(getattr(self, f"{p}_weight_scale")), self.dtype)

    # -- forward -----------------------------------------------------------------------------------------------------
    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.packed:
            return self.gate_up_proj[e], self.down_proj[e]
        return torch.cat([self._dequantize("gate_proj", e), self._dequantize("up_proj", e)], 0), \
            self._dequantize("down_proj", e)

    def quant_input(self, x: torch.Tensor, proj: str) -> torch.Tensor:
        if not self.emulate_w4a4:
            return x
        return fake_quant_activation_nvfp4(x, self.act_scale[proj])

    # -- saving ------------------------------------------------------------------------------------------------------
    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The experts in checkpoint form, ``{prefix}.{e}.{p}.{field}``. Packed: the tensors as loaded. Dequantized:
        each weight re-encoded with its loaded scales (exactly the loaded bytes while the weight is unchanged); a
        weight that no longer fits its scales (modified after loading) is quantized afresh, with a warning."""
        out: dict[str, torch.Tensor] = {}
        fresh = 0
        I = None if self.packed else self.gate_up_proj.shape[1] // 2
        for e in range(self.num_experts):
            fields = {p: {} for p in PROJS}
            for p in PROJS:
                for field in self._fields():
                    if field != "weight":
                        fields[p][field] = getattr(self, f"{p}_{field}")[e]
            if self.packed:
                for p in PROJS:
                    fields[p]["weight"] = getattr(self, f"{p}_weight")[e]
            else:
                dense = {"gate_proj": self.gate_up_proj[e, :I], "up_proj": self.gate_up_proj[e, I:],
                         "down_proj": self.down_proj[e]}
                qs = {p: self._reencode(dense[p], fields[p]) for p in PROJS}
                if any(q is None for q in qs.values()):
                    fresh += 1
                    fields = self._quantize_fresh(dense, fields)
                else:
                    for p in PROJS:
                        fields[p]["weight"] = qs[p]
            for p in PROJS:
                for field, t in fields[p].items():
                    name = self.fp8_scale_name if (self.fmt == "fp8_block" and field == "weight_scale") else field
                    out[f"{prefix}.{e}.{p}.{name}"] = t.detach().clone().contiguous()
        if fresh:
            log.warning("qwen4exp: %s: %d expert(s) changed since loading; quantized afresh (new scales)", prefix,
                        fresh)
        return out

    def _fields(self) -> tuple[str, ...]:
        if self.fmt == "fp8_block":
            return ("weight", "weight_scale")
        return NVFP4_FIELDS if self.has_input_scale else NVFP4_FIELDS[:3]

    def _reencode(self, w: torch.Tensor, f: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``w`` re-encoded with its scales, or None when the scales do not reproduce it."""
        if self.fmt == "nvfp4":
            s = f["weight_scale"].float() * f["weight_scale_2"].float()
            out_f, in_f = w.shape
            v = (w.float().reshape(out_f, in_f // 16, 16) / s.unsqueeze(-1)).reshape(out_f, in_f)
            codes = round_to_e2m1(v)
            codes = torch.where(torch.signbit(w) & (w == 0), torch.full_like(codes, 8), codes)  # -0 is code 8
            q = pack_codes(codes)
            back = dequantize_nvfp4(q, f["weight_scale"], f["weight_scale_2"], w.dtype)
        else:
            s = f["weight_scale"].float()
            rows, cols = w.shape
            exp = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            q = (w.float() / exp).to(torch.float8_e4m3fn)
            back = dequantize_fp8_block(q, s, w.dtype)
        same = torch.equal(back, w) and torch.equal(torch.signbit(back), torch.signbit(w))
        return q if same else None

    def _quantize_fresh(self, dense, fields):
        if self.fmt == "nvfp4":
            # gate and up share one global scale (vLLM runs w13 with one, fused_moe/oracle/nvfp4.py)
            g = torch.maximum(dense["gate_proj"].abs().amax(), dense["up_proj"].abs().amax()).float() / (6.0 * 448.0)
            for p in PROJS:
                q, s, s2 = quantize_nvfp4(dense[p], g if p != "down_proj" else None)
                fields[p].update(weight=q, weight_scale=s, weight_scale_2=s2)
        else:
            for p in PROJS:
                q, s = quantize_fp8_block(dense[p])
                fields[p].update(weight=q, weight_scale=s)
        return fields


# -- loading --------------------------------------------------------------------------------------------------------
def split_quantized_experts(weights, qcfg, layout: str):
    """Take the routed experts the checkpoint stores quantized (or the config asks quantized) out of ``weights``
    (canonical (name, tensor) pairs) -> (the other pairs, {experts module: (algo, {e: {p: {field: tensor}}})}).

    Raises QuantTensorError / QuantConfigError naming the tensor or field for a mismatch between config and
    tensors."""
    rest, per = [], defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    algos: dict[str, str | None] = {}

    def algo_of(base):
        if base not in algos:
            algos[base] = None if qcfg is None else qcfg.layer_algo(base, layout)
        return algos[base]

    for name, t in weights:
        m = FUSED_EXPERTS.match(name)
        if m and (algo_of(m.group(1)) is not None or is_quantized(t, "weight") or name != f"{m.group(1)}.{m.group(2)}"):
            raise QuantTensorError(
                f"{name}: quantized routed experts must be stored per expert "
                f"({m.group(1)}.{{e}}.{{gate,up,down}}_proj.weight and scales), as ModelOpt exports them and vLLM "
                f"0.32 reads them" + (f"; the config asks {algo_of(m.group(1))} for {m.group(1)}"
                                      if algo_of(m.group(1)) else ""))
        m = EXPERT_TENSOR.match(name)
        if m and (algo_of(m.group(1)) is not None or is_quantized(t, m.group(4))):
            per[m.group(1)][int(m.group(2))][m.group(3)][m.group(4)] = t
            continue
        rest.append((name, t))
    out = {}
    for base, experts in per.items():
        algo = algo_of(base)
        if algo is None:
            e = min(experts)
            p = next(iter(experts[e]))
            field = next(f for f, t in experts[e][p].items() if is_quantized(t, f))
            why = "has no quantization config" if qcfg is None else "keeps it unquantized (excluded or not listed)"
            raise QuantTensorError(f"{base}.{e}.{p}.{field}: the checkpoint stores {base} quantized, but it {why}")
        out[base] = (algo, experts)
    return rest, out


def build_quantized_experts(base: str, algo: str, experts: dict, config, *, packed: bool, dtype: torch.dtype,
                            emulate_w4a4: bool, source: str) -> QuantizedExperts:
    """Validate one experts module's checkpoint tensors and build its QuantizedExperts."""
    E = config.num_experts
    dims = projection_dims(config)
    for e in sorted(experts):
        check_expert_index(base, e, E)
    fmt, weight_only = expert_format(algo, base=base, source=source)
    scale_name = fp8_scale_name({f for e in experts.values() for p in e.values() for f in p}) \
        if fmt == "fp8_block" else None
    if emulate_w4a4 and fmt == "nvfp4" and weight_only:
        raise QuantConfigError(f"{source}: emulate_w4a4=True needs a W4A4 checkpoint; {base} is W4A16_NVFP4 "
                               f"(weight-only, no input_scale)")
    stacked: dict[str, dict[str, list]] = {p: defaultdict(list) for p in PROJS}
    keep_input = not weight_only or all("input_scale" in experts.get(e, {}).get(p, {}) for e in range(E)
                                        for p in PROJS)
    for e in range(E):
        for p in PROJS:
            f = experts.get(e, {}).get(p, {})
            check_projection(fmt, f"{base}.{e}.{p}", f, *dims[p], weight_only=weight_only,
                             scale_name=scale_name or "weight_scale_inv")
            if fmt == "nvfp4":
                # a W4A16 checkpoint's input_scale is not read (vLLM drops it) but kept for saving
                for k in (NVFP4_FIELDS if keep_input else NVFP4_FIELDS[:3]):
                    stacked[p][k].append(f[k].reshape(()) if k in ("weight_scale_2", "input_scale") else f[k])
            else:
                stacked[p]["weight"].append(f["weight"])
                stacked[p]["weight_scale"].append(block_scale_2d(f[scale_name]))
    stacked = {p: {k: torch.stack(v) for k, v in fs.items()} for p, fs in stacked.items()}
    if fmt == "nvfp4":
        differ = (stacked["gate_proj"]["weight_scale_2"] != stacked["up_proj"]["weight_scale_2"]).nonzero()
        if differ.numel():
            # vLLM runs gate and up with the gate's global scale and warns (modelopt.py, ModelOptNvFp4FusedMoE);
            # the reference dequantizes each with its own, as stored
            log.warning("qwen4exp: %s.%d: gate_proj and up_proj weight_scale_2 differ; vLLM uses gate_proj's for "
                        "both", base, int(differ[0]))
    mod = QuantizedExperts(config, fmt, packed, dtype, emulate_w4a4=emulate_w4a4 and fmt == "nvfp4",
                           fp8_scale_name=scale_name or "weight_scale_inv")
    mod.set_tensors(stacked, weight_only)
    return mod
