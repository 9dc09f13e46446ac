"""Our NVFP4 checkpoint writer: a BF16 Qwen4Exp checkpoint -> the ModelOpt NVFP4 format vLLM 0.32 reads, made with
this package's reference quantizers (``nvfp4.quantize_nvfp4``, ``fp8``), without modelopt.

What it writes (what ``NVFP4_EXPERTS_ONLY_CFG`` would give, plus NVIDIA's Flash-Next extras):

* routed experts of the target model NVFP4, per expert (``...experts.{e}.{gate,up,down}_proj.{weight,
  weight_scale, weight_scale_2, input_scale}``), weight-only calibration: ``weight_scale_2`` = amax / (6 * 448),
  gate and up sharing one (vLLM runs them with one, and ModelOpt ties fused projections' amax);
  ``input_scale`` = amax / (6 * 448) of the expert GEMM's input over the calibration batches (``calibration``: token
  ids run through our HF model in BF16; one value a layer and GEMM, written to every expert, as vLLM takes the
  maximum over experts anyway), else ``DEFAULT_INPUT_SCALE``;
* the MTP head's routed experts FP8 in 128x128 blocks (``weight`` e4m3 + ``weight_scale_inv``, the name vLLM 0.32's
  block-FP8 MoE method loads; ``fp8_scale_name="weight_scale"`` for ModelOpt's linear name) when both expert dims are
  multiples of 128 (vLLM's requirement), else BF16;
* the PLE n-gram table FP8 per tensor (its shards e4m3 + one ``ngram_embedding.weight_scale``);
* everything else unchanged (BF16), in the ignore list.

Scales may also come from outside (``quantize_checkpoint(input_scales=..., weight_scales_2=...)``): the recipe
``recipes/quantize_nvfp4.py`` calibrates with NVIDIA ModelOpt and hands its scales to this writer.

The config: ``quant_algo`` "NVFP4" (or "W4A16_NVFP4", ``weight_only=True``) when the experts are the only quantized
modules, else "MIXED_PRECISION" with module-level ``quantized_layers`` entries (as NVIDIA's Flash-Next checkpoint
has), both in config.json's ``quantization_config`` form.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch
from safetensors.torch import save_file

from .config import parse_quant_config
from .fp8 import quantize_fp8_block, quantize_fp8_per_tensor
from .nvfp4 import E2M1_MAX, E4M3_MAX, quantize_nvfp4

log = logging.getLogger("qwen4exp")

# input_scale without calibration: 1/6, i.e. a global activation factor of 6 (1 / input_scale), so each 16-block's
# E4M3 scale is the block's amax itself: exact for block amaxes in E4M3's normal range [2^-6, 448], nothing clipped
# below 448. A calibrated scale (amax / 2688) only gains resolution for blocks far below the tensor's amax.
DEFAULT_INPUT_SCALE = 1.0 / 6.0
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARD = re.compile(r"^(.*\.ngram_embedding)\.(shards?[._])(\d+)\.weight$")
PRODUCER = {"name": "qwen4exp.quant.export", "version": "1"}
ScaleLike = float | torch.Tensor


def ignore_list(composite: bool, *, mtp_quantized: bool, ple_quantized: bool) -> list[str]:
    """Every module but the quantized ones, as wildcards in the checkpoint's names (the anchor's list, with the PLE
    projections named so that the table itself can be quantized, vLLM's fused names included)."""
    lm = "model.language_model." if composite else "model."
    out = ["lm_head", f"{lm}embed_tokens", "*self_attn*", "*indexer*", "*linear_attn*", "*shared_expert*",
           "*shared_expert_gate*", "*mlp.gate", "*hyper_connection*", "*hyper_connection_mixer*",
           "*ple.key_proj", "*ple.value_proj", "*ple.kv_proj", "*ple.conv1d", "*visual*"]
    if not ple_quantized:
        out.append("*ple.ple_embedding*")
    out += ["mtp.fc_embedding", "mtp.fc_hidden", "mtp.shared_head*"] if mtp_quantized else ["*mtp*"]
    return out


def quantization_config(composite: bool, nvfp4_bases: list[str], fp8_block_bases: list[str], ple_bases: list[str],
                        weight_only: bool) -> dict:
    """config.json's ``quantization_config`` for the given quantized modules (checkpoint names)."""
    algo = "W4A16_NVFP4" if weight_only else "NVFP4"
    ignore = ignore_list(composite, mtp_quantized=bool(fp8_block_bases), ple_quantized=bool(ple_bases))
    if not fp8_block_bases and not ple_bases:
        acts = None if weight_only else {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
        return {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16, "producer": PRODUCER,
                "config_groups": {"group_0": {
                    "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                    "input_activations": acts, "targets": ["Linear"]}},
                "ignore": ignore}
    layers = {b: {"quant_algo": algo, "group_size": 16} for b in nvfp4_bases}
    layers.update({b: {"quant_algo": "FP8_PB_WO", "group_size": 128} for b in fp8_block_bases})
    layers.update({b: {"quant_algo": "FP8"} for b in ple_bases})
    return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "group_size": 16, "producer": PRODUCER,
            "ignore": ignore, "quantized_layers": layers}


def _read(src_dir: str) -> dict[str, torch.Tensor]:
    from ..hf.loading import iter_checkpoint

    return dict(iter_checkpoint(src_dir))


def _experts(sd: dict[str, torch.Tensor]) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    """Routed experts of either layout -> {experts module: {e: {gate_proj|up_proj|down_proj: [out, in]}}}, popped
    from ``sd``."""
    out: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for k in list(sd):
        if (m := _FUSED.match(k)):
            t = sd.pop(k)
            for e in range(t.shape[0]):
                if m.group(2) == "down_proj":
                    out[m.group(1)][e]["down_proj"] = t[e]
                else:
                    g, u = t[e].chunk(2, 0)
                    out[m.group(1)][e].update(gate_proj=g, up_proj=u)
        elif (m := _PER_EXPERT.match(k)):
            out[m.group(1)][int(m.group(2))][m.group(3)] = sd.pop(k)
    return out


@torch.no_grad()
def calibrate_input_amax(src_dir: str, calibration: Iterable[torch.Tensor]) -> dict[str, dict[str, float]]:
    """Run our HF model (BF16) over ``calibration`` (token id tensors [B, S] or [S]) and record, per routed-experts
    module, the amax of each expert GEMM's input over the tokens routed to it: {module: {"gate_up": a, "down": a}}."""
    from ..hf.modeling import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration
    from ..layers.moe import Experts

    with open(os.path.join(src_dir, "config.json")) as f:
        composite = "text_config" in json.load(f)
    cls = Qwen4ExpForConditionalGeneration if composite else Qwen4ExpForCausalLM
    model = cls.from_pretrained(src_dir, dtype=torch.bfloat16)
    amax: dict[str, dict[str, float]] = defaultdict(lambda: {"gate_up": 0.0, "down": 0.0})
    for name, mod in model.named_modules():
        if isinstance(mod, Experts):
            def observe(x, proj, name=name):
                if x.numel():
                    amax[name][proj] = max(amax[name][proj], float(x.abs().max()))
                return x
            mod.quant_input = observe  # the instance attribute shadows Experts.quant_input
    for ids in calibration:
        ids = torch.as_tensor(ids, dtype=torch.long)
        model(ids.reshape(1, -1) if ids.dim() == 1 else ids, use_cache=False)
    return dict(amax)


def _scalar(name: str, v: ScaleLike) -> torch.Tensor:
    t = torch.as_tensor(v, dtype=torch.float32).detach().cpu()
    if t.numel() != 1:
        raise ValueError(f"{name} must be a scalar, got shape {tuple(t.shape)}")
    t = t.reshape(()).clone()
    if not (torch.isfinite(t) and t > 0):
        raise ValueError(f"{name} must be finite and > 0, got {float(t)}")
    return t


def _check_scales(what: str, scales: Mapping, targets: dict[str, list[int] | None]) -> dict:
    """Validate precomputed scales against the checkpoint's NVFP4 expert modules (``targets``: module -> its
    expert indices, or None for one entry a module) -> the same mapping with float32 scalar tensors."""
    missing = sorted(set(targets) - set(scales))
    extra = sorted(set(scales) - set(targets))
    if missing or extra:
        raise ValueError(f"{what} must name exactly the checkpoint's routed NVFP4 expert modules: "
                         + "; ".join(x for x in (f"missing {missing[:4]}" if missing else "",
                                                 f"unknown {extra[:4]}" if extra else "") if x))

    def projs(name: str, d) -> dict[str, torch.Tensor]:
        if not isinstance(d, Mapping) or any(p not in d for p in ("gate_up", "down")):
            raise ValueError(f"{name} must map 'gate_up' and 'down' to scales, got {d!r}")
        return {p: _scalar(f"{name}[{p!r}]", d[p]) for p in ("gate_up", "down")}

    out = {}
    for base, experts in targets.items():
        per = scales[base]
        if experts is None:
            out[base] = projs(f"{what}[{base!r}]", per)
            continue
        if sorted(per) != experts:
            raise ValueError(f"{what}[{base!r}] must have one entry per expert ({len(experts)}: {experts[0]}.."
                             f"{experts[-1]}), got {sorted(per)[:8]}")
        out[base] = {e: projs(f"{what}[{base!r}][{e}]", per[e]) for e in experts}
    return out


def quantize_checkpoint(src_dir: str | os.PathLike, dst_dir: str | os.PathLike, *,
                        calibration: Iterable[torch.Tensor] | None = None, weight_only: bool = False,
                        mtp_experts: str = "fp8_block", ple_table: str = "fp8",
                        fp8_scale_name: str = "weight_scale_inv",
                        default_input_scale: float = DEFAULT_INPUT_SCALE,
                        input_scales: Mapping[str, Mapping[str, ScaleLike]] | None = None,
                        weight_scales_2: Mapping[str, Mapping[int, Mapping[str, ScaleLike]]] | None = None,
                        producer: Mapping[str, str] | None = None) -> dict:
    """Write ``dst_dir``: the BF16 checkpoint ``src_dir`` with its routed experts NVFP4 (see the module docstring).

    ``mtp_experts``: "fp8_block" or "bf16"; ``ple_table``: "fp8" or "bf16". Every other file of ``src_dir``
    (tokenizer, generation config) is copied. -> the ``quantization_config`` written.

    Scales computed elsewhere (e.g. by a ModelOpt calibration, ``recipes/quantize_nvfp4.py``), per routed-experts
    module of the target model (checkpoint names, e.g. ``model.layers.0.mlp.experts``):

    * ``input_scales`` {module: {"gate_up": s, "down": s}}: the ``input_scale`` written for every expert of the
      module, in place of ``calibration`` (W4A4 only; the two are exclusive);
    * ``weight_scales_2`` {module: {e: {"gate_up": s, "down": s}}}: each expert's ``weight_scale_2`` (gate and up
      share the "gate_up" one), in place of amax / (6 * 448) of the weight; the block scales and codes are then
      derived with it.

    Either must name every NVFP4 module (and, for ``weight_scales_2``, every expert) and nothing else; each scale is
    a finite positive scalar. ``producer`` replaces ``quantization_config.producer``."""
    src_dir, dst_dir = os.fspath(src_dir), os.fspath(dst_dir)
    if input_scales is not None and calibration is not None:
        raise ValueError("pass either calibration (token ids to calibrate on) or input_scales (precomputed), "
                         "not both")
    if mtp_experts not in ("fp8_block", "bf16"):
        raise ValueError(f"mtp_experts must be 'fp8_block' or 'bf16', got {mtp_experts!r}")
    if ple_table not in ("fp8", "bf16"):
        raise ValueError(f"ple_table must be 'fp8' or 'bf16', got {ple_table!r}")
    if fp8_scale_name not in ("weight_scale_inv", "weight_scale"):
        raise ValueError(f"fp8_scale_name must be 'weight_scale_inv' or 'weight_scale', got {fp8_scale_name!r}")
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("quantization_config") or cfg.get("text_config", {}).get("quantization_config"):
        raise ValueError(f"{src_dir} is already quantized (config.json has a quantization_config)")
    sd = _read(src_dir)
    composite = any(k.startswith("model.language_model.") for k in sd)
    amax = calibrate_input_amax(src_dir, calibration) if calibration is not None and not weight_only else {}
    experts_all = _experts(sd)
    targets = {b: sorted(ex) for b, ex in experts_all.items() if not b.startswith("mtp.")}
    if input_scales is not None and not weight_only:
        input_scales = _check_scales("input_scales", input_scales, {b: None for b in targets})
    if weight_scales_2 is not None:
        weight_scales_2 = _check_scales("weight_scales_2", weight_scales_2, targets)

    out: dict[str, torch.Tensor] = {}
    nvfp4_bases, fp8_bases, ple_bases = [], [], []
    for base, experts in sorted(experts_all.items()):
        e0 = experts[min(experts)]
        I, D = e0["gate_proj"].shape
        if base.startswith("mtp."):
            if mtp_experts == "fp8_block" and D % 128 == 0 and I % 128 == 0:
                fp8_bases.append(base)
                for e, ps in sorted(experts.items()):
                    for p, w in ps.items():
                        q, s = quantize_fp8_block(w)
                        out[f"{base}.{e}.{p}.weight"], out[f"{base}.{e}.{p}.{fp8_scale_name}"] = q, s
                continue
            if mtp_experts == "fp8_block":
                log.info("qwen4exp: %s kept BF16: block FP8 needs both expert dims multiples of 128 (got %d, %d)",
                         base, D, I)
            for e, ps in sorted(experts.items()):
                for p, w in ps.items():
                    out[f"{base}.{e}.{p}.weight"] = w.contiguous()
            continue
        nvfp4_bases.append(base)
        a = amax.get(base, {})
        if input_scales is not None and not weight_only:
            in_scale = {proj: input_scales[base][proj] for proj in ("gate_up", "down")}
        else:
            in_scale = {proj: torch.tensor((a[proj] / (E2M1_MAX * E4M3_MAX)) if a.get(proj)
                                           else default_input_scale, dtype=torch.float32)
                        for proj in ("gate_up", "down")}
        for e, ps in sorted(experts.items()):
            w = {p: t.float() for p, t in ps.items()}
            if weight_scales_2 is not None:
                g, g_down = weight_scales_2[base][e]["gate_up"], weight_scales_2[base][e]["down"]
            else:
                g = torch.maximum(w["gate_proj"].abs().amax(), w["up_proj"].abs().amax())
                g = torch.where(g == 0, torch.tensor(E2M1_MAX), g) / (E2M1_MAX * E4M3_MAX)
                g_down = None
            for p in ("gate_proj", "up_proj", "down_proj"):
                q, s, s2 = quantize_nvfp4(w[p], g_down if p == "down_proj" else g)
                n = f"{base}.{e}.{p}"
                out[f"{n}.weight"], out[f"{n}.weight_scale"] = q, s
                out[f"{n}.weight_scale_2"] = s2.reshape(()).clone()
                if not weight_only:
                    out[f"{n}.input_scale"] = in_scale["down" if p == "down_proj" else "gate_up"].clone()

    shards: dict[str, dict[int, tuple[str, torch.Tensor]]] = defaultdict(dict)
    for k in list(sd):
        if (m := _SHARD.match(k)):
            shards[m.group(1)][int(m.group(3))] = (k, sd.pop(k))
    for base, parts in sorted(shards.items()):
        order = sorted(parts)
        if ple_table == "fp8" and parts[order[0]][1].dtype != torch.float8_e4m3fn:
            table = torch.cat([parts[i][1] for i in order], 0)
            q, s = quantize_fp8_per_tensor(table)
            rows = [parts[i][1].shape[0] for i in order]
            for (k, _), piece in zip((parts[i] for i in order), torch.split(q, rows, 0)):
                out[k] = piece.contiguous()
            out[f"{base}.weight_scale"] = s.reshape(())
            ple_bases.append(base)
        else:
            for k, t in parts.values():
                out[k] = t
            if f"{base}.weight_scale" in sd:
                ple_bases.append(base)
    out.update({k: t.contiguous() for k, t in sd.items()})

    qc = quantization_config(composite, nvfp4_bases, fp8_bases, ple_bases, weight_only)
    if producer is not None:
        qc["producer"] = dict(producer)
    parse_quant_config(qc)  # our own reader must take it
    os.makedirs(dst_dir, exist_ok=True)
    for f in os.listdir(src_dir):
        if f.endswith(".safetensors") or f in ("model.safetensors.index.json", "config.json", "hf_quant_config.json"):
            continue
        if os.path.isfile(os.path.join(src_dir, f)):
            shutil.copy2(os.path.join(src_dir, f), os.path.join(dst_dir, f))
    cfg["quantization_config"] = qc
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    save_file(out, os.path.join(dst_dir, "model.safetensors"), metadata={"format": "pt"})
    log.info("qwen4exp: wrote %s: %d NVFP4 expert module(s), %d block-FP8, %d FP8 PLE table(s)%s", dst_dir,
             len(nvfp4_bases), len(fp8_bases), len(ple_bases),
             "" if weight_only else (" (input_scale given)" if input_scales is not None else
                                     " (input_scale calibrated)" if amax else " (default input_scale)"))
    return qc
