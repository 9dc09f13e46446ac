"""Official checkpoint -> vLLM parameters, for the target model and for the MTP draft head.

Accepts what the HF reference loads (``qwen4exp.hf.loading``): text-only (``model.*``) or composite
(``model.language_model.*``; ``model.visual.*`` is skipped), experts fused or per expert, PLE tables as row shards;
ModelOpt checkpoints (``qwen4exp.vllm.quant``): quantized experts per expert, each projection's tensors checked
together (``qwen4exp.quant.experts``) and then handed to vLLM's quantized MoE method or dequantized, an FP8 PLE
table with its per-tensor scale.
Which tensors a vLLM module takes, and under which parameter names, is one declarative ``NameMap`` per module
(``TARGET``, ``MTP_DRAFT``). Every tensor a module takes is checked against the shape our reference model expects
(built on the meta device from the same config, with the MTP head for the draft) before it is handed to a vLLM
weight loader, and tensors that never arrive are reported by their checkpoint names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from vllm.logger import init_logger
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from ..checkpoint import EXPERT, PLE_SHARD, CheckpointError, canonical_name
from ..quant import QuantTensorError, validate_fp8_per_tensor
from ..quant.experts import (EXPERT_TENSOR, check_expert_index, check_projection, dequantize_projection,
                             fp8_scale_name, is_quantized, projection_dims, required_fields)
from .quant import ExpertsQuant

log = init_logger("vllm.plugins.qwen4exp")  # (under vLLM's logger: shown like its own lines)

_GDN_FUSED = {"in_proj_qkv": ("in_proj_qkvz", None), "in_proj_z": ("in_proj_qkvz", 3),
              "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)}
_SWIGLU_MERGED = {"gate_proj": 0, "up_proj": 1}  # vllm.layers.MergedSwiGLU
_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


@dataclass(frozen=True)
class NameMap:
    """The checkpoint tensors a vLLM module takes and its parameter names for them: ``rules`` are (checkpoint
    prefix, parameter prefix) pairs over canonical checkpoint names (``checkpoint.canonical_name``), first match
    wins; a tensor whose first match has no parameter prefix (None), or that matches no rule, is not this module's
    (skipped, and not required)."""

    rules: tuple[tuple[str, str | None], ...]

    def param(self, name: str) -> str | None:
        for ck, ours in self.rules:
            if name.startswith(ck):
                return None if ours is None else ours + name[len(ck):]
        return None


# the target: everything but the MTP head, same names
TARGET = NameMap((("mtp.", None), ("", "")))
# the MTP draft (``mtp.Qwen4ExpMTP``): ``mtp.*`` under ``model.``, plus the embedding and LM head it shares with the
# target. They are loaded into the draft too; vLLM's proposer then swaps in the target's modules (the embedding
# only without pipeline parallelism: there the draft keeps its own copy).
MTP_DRAFT = NameMap((("mtp.", "model."), ("model.embed_tokens.weight", "model.embed_tokens.weight"),
                     ("lm_head.weight", "lm_head.weight")))


def _reference_shapes(config, mtp_layers: int = 0) -> dict[str, tuple[int, ...]]:
    from ..configuration import load_config
    from ..hf.modeling import Qwen4ExpForCausalLM as Reference

    ours = load_config(config.to_dict())
    ours = ours.get_text_config() if hasattr(ours, "get_text_config") else ours
    with torch.device("meta"):
        ref = Reference(ours, mtp_layers=mtp_layers)
    return {k: tuple(v.shape) for k, v in ref.named_parameters()}


def _experts_dtype(experts) -> torch.dtype:
    """The dtype of a FusedMoE module's (unquantized) expert weights."""
    return next(p.dtype for n, p in experts.named_parameters() if n.endswith("w13_weight"))


def load_qwen4exp_weights(model, weights: Iterable[tuple[str, torch.Tensor]], names: NameMap = TARGET,
                          mtp_layers: int = 0) -> set[str]:
    """Load the tensors ``names`` selects into ``model``; returns the names of the parameters written.
    ``mtp_layers``: the number of MTP layers the reference is built with (the draft's)."""
    cfg = model.config
    expected = {k: s for k, s in _reference_shapes(cfg, mtp_layers).items() if names.param(k) is not None}
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    seen: set[str] = set()  # checkpoint names (canonical) that arrived
    loaded: set[str] = set()  # our parameter names written
    shard_rows: dict[str, dict[int, int]] = {}
    per_expert: dict[str, set[tuple[int, str]]] = {}

    def check(ck_name: str, t: torch.Tensor, shape: tuple[int, ...] | None):
        if shape is None:
            hint = (" (an MTP LM head of its own is not supported: vLLM's MTP proposer uses the target's)"
                    if ".shared_head." in ck_name else "")
            raise CheckpointError(f"qwen4exp: unexpected tensor {ck_name} in the checkpoint{hint}")
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"qwen4exp: tensor {ck_name} has shape {tuple(t.shape)}, expected {tuple(shape)}")

    def load_param(pname: str, t: torch.Tensor, *shard):
        p = params.get(pname)
        if p is None:
            raise CheckpointError(f"qwen4exp: no parameter {pname} for checkpoint tensor")
        getattr(p, "weight_loader", default_weight_loader)(p, t, *shard)
        loaded.add(pname)

    def load_experts(pmod: str, items):
        loaded.update(f"{pmod}.{n}" for n in modules[pmod].load_weights(items))

    # quantized experts: one projection's tensors gather here until complete, then go to vLLM (native) or are
    # dequantized into the module's model-dtype weights
    pending: dict[tuple[str, int, str], dict[str, torch.Tensor]] = {}
    done: set[tuple[str, int, str]] = set()
    dequantized: dict[str, set[str]] = {}  # format -> the experts modules dequantized at load
    dequantized_dtype: list[torch.dtype] = []  # (the dtype they were dequantized to, for the INFO line)
    dims = projection_dims(cfg)

    def experts_quant_of(base: str) -> ExpertsQuant:
        return getattr(modules.get(names.param(base) or ""), "qwen4exp_quant", None) or ExpertsQuant()

    def flush(base: str, e: int, proj: str, f: dict[str, torch.Tensor], final: bool = False) -> bool:
        eq = experts_quant_of(base)
        scale = fp8_scale_name(f) if eq.fmt == "fp8_block" else "weight_scale_inv"
        if not final and not all(k in f for k in required_fields(eq.fmt, eq.weight_only, scale)):
            return False
        name = f"{base}.{e}.{proj}"
        check_projection(eq.fmt, name, f, *dims[proj], weight_only=eq.weight_only, scale_name=scale)
        pmod = names.param(base)
        if eq.native:  # vLLM's method loads them (its block-FP8 scale parameter is named weight_scale_inv)
            load_experts(pmod, [(f"{e}.{proj}.{'weight_scale_inv' if k == scale and eq.fmt == 'fp8_block' else k}",
                                 f[k]) for k in required_fields(eq.fmt, eq.weight_only, scale)])
        else:
            dtype = _experts_dtype(modules[pmod])
            load_experts(pmod, [(f"{e}.{proj}.weight", dequantize_projection(eq.fmt, f, dtype, scale))])
            dequantized.setdefault(eq.fmt, set()).add(base)
            dequantized_dtype[:] = [dtype]
        per_expert.setdefault(base, set()).add((e, proj))
        done.add((base, e, proj))
        return True

    tables_fp8: dict[str, torch.Tensor | None] = {}  # FP8 PLE table -> its scale (None until it arrives)

    for ck_name, t in weights:
        name = canonical_name(ck_name, composite=False)
        if name is None:
            continue
        pname = names.param(name)
        if pname is None:
            continue
        if name.endswith(".ngram_embedding.weight_scale"):  # an FP8 PLE table's per-tensor scale
            table = name[: -len(".weight_scale")]
            if f"{table}.weight" not in expected:
                check(ck_name, t, None)
            tables_fp8[table] = t
            continue
        m = PLE_SHARD.match(name)
        if m:
            base = f"{m.group(1)}.weight"
            rows, dim = expected.get(base, (None, None))
            if rows is None:
                check(ck_name, t, None)
            s = int(m.group(2))
            step = math.ceil(rows / cfg.split_ngram_parts)
            check(ck_name, t, (max(0, min(step, rows - s * step)), dim))
            pbase = names.param(base)
            p = params[pbase]
            if t.dtype == torch.float8_e4m3fn:
                tables_fp8.setdefault(m.group(1), None)
                if p.dtype != t.dtype:  # a table the config does not list as FP8 (small models): re-typed here
                    p.data = torch.empty(p.shape, dtype=t.dtype, device=p.device, pin_memory=p.is_pinned())
            elif p.dtype == torch.float8_e4m3fn:
                raise QuantTensorError(f"{ck_name}: the quantization config lists the PLE table as FP8, but the "
                                       f"checkpoint stores it as {t.dtype}")
            p.data[s * step: s * step + t.shape[0]].copy_(t.to(p.dtype))
            shard_rows.setdefault(base, {})[s] = t.shape[0]
            loaded.add(pbase)
            continue
        m = EXPERT_TENSOR.match(name)
        if m and (experts_quant_of(m.group(1)).fmt is not None or is_quantized(t, m.group(4))):
            base, e, proj, field = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            eq = experts_quant_of(base)
            if eq.fmt is None:
                raise QuantTensorError(f"{ck_name}: the checkpoint stores {base} quantized, but its quantization "
                                       f"config keeps it unquantized (excluded, not listed, or no config)")
            check_expert_index(base, e, cfg.num_experts, ck_name)
            if (base, e, proj) in done:
                continue  # a field the format does not read (a weight-only checkpoint's input_scale)
            f = pending.setdefault((base, e, proj), {})
            f[field] = t
            if flush(base, e, proj, f):
                del pending[(base, e, proj)]
            continue
        m = EXPERT.match(name)
        if m:
            base, e, proj = m.group(1), int(m.group(2)), m.group(3)
            E, twoI, D = expected.get(f"{base}.gate_up_proj", (0, 0, 0))
            I = twoI // 2
            if e >= E:
                check(ck_name, t, None)
            check(ck_name, t, (D, I) if proj == "down_proj" else (I, D))
            load_experts(names.param(base), [(f"{e}.{proj}.weight", t)])
            per_expert.setdefault(base, set()).add((e, proj))
            continue
        pmod, leaf = pname.rsplit(".", 1)
        owner, _, leafmod = pmod.rpartition(".")  # (the fused projections' module and leaf names)
        if name.endswith(tuple(f".ple_embedding.{b}" for b in _BUFFERS)):
            ours = getattr(modules[pmod], leaf)
            if tuple(t.shape) != tuple(ours.shape) or not torch.equal(t.to(ours.dtype).cpu(), ours.cpu()):
                raise CheckpointError(f"qwen4exp: tensor {ck_name} does not match the config's PLE hashing")
            continue
        check(ck_name, t, expected.get(name))
        seen.add(name)
        if pmod.endswith(".mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
            load_experts(pmod, [(leaf, t)])
        elif leafmod in _SWIGLU_MERGED and hasattr(modules[owner], "gate_up_proj"):
            # the shared expert's gate / up -> halves 0 / 1 of gate_up_proj
            load_param(f"{owner}.gate_up_proj.weight", t, _SWIGLU_MERGED[leafmod])
        elif (leafmod in _GDN_FUSED and ".linear_attn." in pmod
              and hasattr(modules[owner], "in_proj_qkvz")):  # vLLM's fused GDN projections
            target, shard = _GDN_FUSED[leafmod]
            fused = f"{owner}.{target}.weight"
            if shard is None:  # [q | k | v] rows -> shards 0, 1, 2
                lin = modules[owner]
                kd, vd = lin.key_dim, lin.value_dim
                for i, part in enumerate(t.split([kd, kd, vd], 0)):
                    load_param(fused, part, i)
            else:
                load_param(fused, t, shard)
        else:
            load_param(pname, t)

    # completeness
    for (base, e, proj), f in pending.items():
        flush(base, e, proj, f, final=True)  # raises, naming the missing tensor
    for table, scale in tables_fp8.items():
        tmod, emb = names.param(table), names.param(table).rsplit(".", 1)[0]
        w = params[f"{tmod}.weight"]
        validate_fp8_per_tensor(table, w, scale, w.shape[0], w.shape[1])
        modules[tmod].set_scale(scale.to(modules[emb].layer_multipliers.device))  # (beside the hashing buffers)
    if dequantized:
        what = " and ".join(f"{len(dequantized[k])} {n}" for k, n in (("nvfp4", "NVFP4"), ("fp8_block", "block-FP8"))
                            if k in dequantized)
        log.info("qwen4exp: %s routed-experts module(s) dequantized to %s at load (vLLM has no NVFP4 or block-FP8 MoE "
                 "on this platform; the weights are the HF reference's dequantization)", what, dequantized_dtype[0])
    for base, per in shard_rows.items():
        rows = expected[base][0]
        if sum(per.values()) != rows:
            step = math.ceil(rows / cfg.split_ngram_parts)
            missing = [s for s in range(math.ceil(rows / step)) if s not in per]
            raise CheckpointError(f"qwen4exp: PLE table {base[:-len('.weight')]} is missing shard(s) "
                                  + ", ".join(f"shard_{s}" for s in missing))
        seen.add(base)
    for base, got in per_expert.items():
        E = expected[f"{base}.gate_up_proj"][0]
        for e in range(E):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if (e, proj) not in got:
                    raise CheckpointError(f"qwen4exp: missing tensor {base}.{e}.{proj}.weight")
        seen.update({f"{base}.gate_up_proj", f"{base}.down_proj"})
    missing = [k for k in expected if k not in seen]
    if missing:
        raise CheckpointError("qwen4exp: checkpoint is missing tensor(s): " + ", ".join(missing[:10])
                              + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))
    return loaded
