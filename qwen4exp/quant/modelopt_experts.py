"""Our routed experts under NVIDIA ModelOpt (nvidia-modelopt 0.47, ``modelopt.torch.quantization``), for calibration.

``qwen4exp.layers.moe.Experts`` is not a set of ``nn.Linear``: it holds the fused 3-D parameters of the official
checkpoint, ``gate_up_proj`` [E, 2I, D] and ``down_proj`` [E, D, I], so ``mtq.quantize`` would find nothing to
quantize in it. ModelOpt 0.47 has a wrapper for exactly this layout, ``_QuantFusedExperts``
(``modelopt/torch/quantization/plugins/huggingface.py``, the transformers 5 fused experts of Mixtral, Qwen3-MoE,
DeepSeek-V3, ...): one weight quantizer per expert and projection (``gate_up_proj_weight_quantizers[e]``,
``down_proj_weight_quantizers[e]``; gate and up share one, so their amax is the maximum of both, as vLLM and
ModelOpt's export want) and one input quantizer per projection shared by all experts (``gate_up_proj_input_quantizer``,
``down_proj_input_quantizer``: the single static activation scale the NVFP4 MoE kernels take). Its quantizer names
match the stock wildcards (``*.experts.*weight_quantizer`` in ``NVFP4_EXPERTS_ONLY_CFG``: ModelOpt normalises the
per-expert list names), ``max_calibrate`` calibrates every expert's weight directly (``iter_weights_for_calibration``,
so experts no token reached still get an amax) and ModelOpt's export helpers recognise it.

Its own auto-registration (``register_fused_experts_on_the_fly``) would claim our class too, but its hook does not fit
our forward: it intercepts ``F.linear`` and recovers the expert from the weight's storage offset into the 3-D
parameter, while ``Experts.forward`` hands ``F.linear`` the weight cast to fp32 (fp32 accumulation, see
``Experts``): in a BF16 model that cast is a copy, every expert's offset reads 0, and every routed expert's weight
goes through expert 0's quantizer, silently (on the tiny-coder, expert 0's calibrated gate_up amax came out as the
maximum over all its layer's experts, 0.2832 for 0.2656; a fake-quant forward would quantize every expert with
expert 0's scale). So we register our class with a subclass that keeps the wrapper (quantizers,
naming, calibration, export) and only moves the hook to the two points ``Experts`` already has for quantization:
``expert_weights(e)`` (each expert's weights, through its weight quantizers) and ``quant_input(x, proj)`` (each
GEMM's input over the tokens routed to the expert, through the shared input quantizer). Nothing else of the model is
quantized by the experts-only config (attention, shared experts, router, MTP head ``mtp.*``, PLE, hyper-connections).

``experts_scales(model)``: the calibrated scales of every enabled experts module, with ModelOpt's own export
formulas (``NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer``, ``get_activation_scaling_factor``:
amax / (6 * 448)), in the form ``qwen4exp.quant.export.quantize_checkpoint(input_scales=..., weight_scales_2=...)``
takes.

Importing this module imports modelopt (``make quant`` installs it).
"""

from __future__ import annotations

import logging

import torch
from modelopt.torch.quantization.nn import QuantModuleRegistry
from modelopt.torch.quantization.plugins.huggingface import _QuantFusedExperts
from modelopt.torch.quantization.qtensor import NVFP4QTensor

from ..layers.moe import Experts
from .export import DEFAULT_INPUT_SCALE
from .nvfp4 import E2M1_MAX, E4M3_MAX

log = logging.getLogger("qwen4exp")

PROJS = ("gate_up", "down")


class QuantExperts(_QuantFusedExperts):
    """ModelOpt's fused-experts wrapper on ``qwen4exp.layers.moe.Experts``, hooked at ``expert_weights`` /
    ``quant_input`` instead of ``F.linear`` (see the module docstring)."""

    @property
    def functionals_to_replace(self):
        return iter(())  # no F.linear interception: the two hooks below see each expert's tensors

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = super().expert_weights(e)
        return self.gate_up_proj_weight_quantizers[e](gate_up), self.down_proj_weight_quantizers[e](down)

    def quant_input(self, x: torch.Tensor, proj: str) -> torch.Tensor:
        x = super().quant_input(x, proj)
        q = self.gate_up_proj_input_quantizer if proj == "gate_up" else self.down_proj_input_quantizer
        return q(x)


def register() -> None:
    """Register ``Experts`` with ModelOpt's QuantModuleRegistry as ``QuantExperts`` (idempotent; replaces the
    generic ``_QuantFusedExperts`` if ModelOpt's auto-detection claimed the class first)."""
    dm = QuantModuleRegistry.get(Experts)
    if dm is not None and issubclass(dm, QuantExperts):
        return
    if dm is not None:
        QuantModuleRegistry.unregister(Experts)
    QuantModuleRegistry.register({Experts: "qwen4exp.Experts"})(QuantExperts)


def _enabled(q) -> bool:
    return bool(getattr(q, "is_enabled", False))


def experts_scales(model: torch.nn.Module) -> dict:
    """The calibrated routed experts of ``model`` (after ``mtq.quantize``), every ``QuantExperts`` module whose weight
    quantizers are enabled (the MTP head's are not, in the experts-only config) ->

    ``{"weight_scales_2": {module: {e: {"gate_up": s, "down": s}}}, "input_scales": {module: {"gate_up": s,
    "down": s}} (only modules with enabled input quantizers), "weight_amax": {module: {e: {...}}},
    "input_amax": {module: {...}}}``, scales as float32 scalars. An all-zero weight (amax 0) gets the writer's
    convention (amax 6); an input quantizer that saw no token gets ``DEFAULT_INPUT_SCALE`` (with a warning)."""
    w_s, in_s, w_a, in_a = {}, {}, {}, {}
    for name, mod in model.named_modules():
        if not isinstance(mod, QuantExperts):
            continue
        wq = {"gate_up": mod.gate_up_proj_weight_quantizers, "down": mod.down_proj_weight_quantizers}
        if not all(_enabled(q) for qs in wq.values() for q in qs):
            continue
        w_s[name], w_a[name] = {}, {}
        for e in range(mod.num_experts):
            w_s[name][e], w_a[name][e] = {}, {}
            for p in PROJS:
                q = wq[p][e]
                amax = q.amax
                if amax is None:
                    raise RuntimeError(f"{name}: expert {e} {p} weight quantizer has no amax after calibration")
                s = NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(q).float().reshape(())
                if float(amax) == 0:
                    s = torch.tensor(E2M1_MAX / (E2M1_MAX * E4M3_MAX))
                w_s[name][e][p], w_a[name][e][p] = s.cpu(), float(amax)
        iq = {"gate_up": mod.gate_up_proj_input_quantizer, "down": mod.down_proj_input_quantizer}
        if not all(_enabled(q) for q in iq.values()):
            continue
        in_s[name], in_a[name] = {}, {}
        for p in PROJS:
            amax = iq[p].amax
            if amax is None or float(amax) == 0:
                log.warning("qwen4exp: %s: no calibration token reached the %s GEMM; input_scale %g (default)",
                            name, p, DEFAULT_INPUT_SCALE)
                in_s[name][p], in_a[name][p] = torch.tensor(DEFAULT_INPUT_SCALE), 0.0
                continue
            in_s[name][p] = NVFP4QTensor.get_activation_scaling_factor(iq[p]).float().reshape(()).cpu()
            in_a[name][p] = float(amax)
    return {"weight_scales_2": w_s, "input_scales": in_s, "weight_amax": w_a, "input_amax": in_a}
