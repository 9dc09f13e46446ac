"""Official checkpoint -> vLLM parameters, for the target model and for the MTP draft head.

Accepts what the HF reference loads (``qwen4exp.hf.loading``): text-only (``model.*``) or composite
(``model.language_model.*``; ``model.visual.*`` is skipped), experts fused or per expert, PLE tables as row shards;
ModelOpt checkpoints (``qwen4exp.vllm.quant``): quantized experts per expert, each projection's tensors checked
together (``qwen4exp.quant.experts``) and then handed to vLLM's quantized MoE method or dequantized, an FP8 PLE
table with its per-tensor scale.
The layout (names, joins, merged projections, expected shapes) is ``qwen4exp.checkpoint_layout``; this loader walks
it. Which tensors a vLLM module takes, and under which parameter names, is one declarative ``NameMap`` per module
(``TARGET``, ``MTP_DRAFT``). Every tensor a module takes is checked against the shape the layout expects (the shared
model assembly built on the meta device from the same config, with the MTP layers for the draft) before it is
handed to a vLLM weight loader, and tensors that never arrive are reported by their checkpoint names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from vllm.logger import init_logger
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from ..checkpoint_layout import (EXPERT_PART, FUSED_EXPERTS, MERGED, PLE_ROWS, TABLE_SCALE_OF, CheckpointError,
                                 canonical_name, check_rows, classify, expected_tensors, expert_shapes,
                                 is_hashing_buffer, missing_error, missing_experts, shard_span)
from ..quant import QuantTensorError, validate_fp8_per_tensor
from ..quant.experts import (check_expert_index, check_projection, dequantize_projection, fp8_scale_name,
                             is_quantized, projection_dims, required_fields)
from .quant import ExpertsQuant

log = init_logger("vllm.plugins.qwen4exp")  # (under vLLM's logger: shown like its own lines)

# the shared expert's gate / up -> halves 0 / 1 of vllm.layers.MergedSwiGLU's gate_up_proj (the layout's MERGED)
_SWIGLU_MERGED = {leaf: shard for leaf, (_, shard) in MERGED["shared_expert"].items()}


@dataclass(frozen=True)
class NameMap:
    """The checkpoint tensors a vLLM module takes and its parameter names for them: ``rules`` are (checkpoint
    prefix, parameter prefix) pairs over canonical checkpoint names (``checkpoint_layout.canonical_name``), first match
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


def _expected(config, names: NameMap, mtp_layers: int):
    """The layout's float tensors (``checkpoint_layout.expected_tensors``) that ``names`` selects; the PLE hashing
    buffers are checked against the modules' own (from the config) where a checkpoint has them."""
    from ..configuration import load_config

    ours = load_config(config.to_dict())
    ours = ours.get_text_config() if hasattr(ours, "get_text_config") else ours
    return {k: e for k, e in expected_tensors(ours, mtp_layers).items() if e.floating and names.param(k) is not None}


def _experts_dtype(experts) -> torch.dtype:
    """The dtype of a FusedMoE module's (unquantized) expert weights."""
    return next(p.dtype for n, p in experts.named_parameters() if n.endswith("w13_weight"))


def load_qwen4exp_weights(model, weights: Iterable[tuple[str, torch.Tensor]], names: NameMap = TARGET,
                          mtp_layers: int = 0) -> set[str]:
    """Load the tensors ``names`` selects into ``model``; returns the names of the parameters written.
    ``mtp_layers``: the number of MTP layers the reference is built with (the draft's)."""
    cfg = model.config
    expected = _expected(cfg, names, mtp_layers)
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

    def load_rows(ck_name: str, table: str, s: int, t: torch.Tensor):
        """Row shard ``s`` of PLE table ``table`` into its rows of the (whole-table) parameter."""
        if f"{table}.weight" not in expected:
            check(ck_name, t, None)
        rows, dim = expected[f"{table}.weight"].shape
        start, n = shard_span(rows, cfg.split_ngram_parts, s)
        check(ck_name, t, (n, dim))
        pbase = names.param(f"{table}.weight")
        p = params[pbase]
        if t.dtype == torch.float8_e4m3fn:
            tables_fp8.setdefault(table, None)
            if p.dtype != t.dtype:  # a table the config does not list as FP8 (small models): re-typed here
                p.data = torch.empty(p.shape, dtype=t.dtype, device=p.device, pin_memory=p.is_pinned())
        elif p.dtype == torch.float8_e4m3fn:
            raise QuantTensorError(f"{ck_name}: the quantization config lists the PLE table as FP8, but the "
                                   f"checkpoint stores it as {t.dtype}")
        p.data[start: start + t.shape[0]].copy_(t.to(p.dtype))
        shard_rows.setdefault(table, {})[s] = t.shape[0]
        loaded.add(pbase)

    def load_tensor(pname: str, t: torch.Tensor):
        """One tensor as stored, into its parameter, or into its shard(s) of a fused one (the layout's MERGED)."""
        pmod, leaf = pname.rsplit(".", 1)
        owner, _, leafmod = pmod.rpartition(".")
        merged = MERGED.get(owner.rpartition(".")[2], {}).get(leafmod)
        if pmod.endswith(".mlp.experts") and leaf in FUSED_EXPERTS:
            load_experts(pmod, [(leaf, t)])
        elif merged is not None and hasattr(modules[owner], merged[0]):
            fused, shard = merged
            if isinstance(shard, tuple):  # rows split by the owner's sizes (GDN [q | k | v]) -> shards 0, 1, ...
                for i, part in enumerate(t.split([getattr(modules[owner], a) for a in shard], 0)):
                    load_param(f"{owner}.{fused}.weight", part, i)
            else:
                load_param(f"{owner}.{fused}.weight", t, shard)
        else:
            load_param(pname, t)

    for ck_name, t in weights:
        name = canonical_name(ck_name, composite=False)
        if name is None or (pname := names.param(name)) is None:
            continue
        part = classify(name)
        if part.kind == TABLE_SCALE_OF:  # an FP8 PLE table's per-tensor scale
            if f"{part.target}.weight" not in expected:
                check(ck_name, t, None)
            tables_fp8[part.target] = t
        elif part.kind == PLE_ROWS:
            load_rows(ck_name, part.target, part.index, t)
        elif part.kind == EXPERT_PART and (experts_quant_of(part.target).fmt is not None
                                           or is_quantized(t, part.field)):
            base, e, proj = part.target, part.index, part.proj
            if experts_quant_of(base).fmt is None:
                raise QuantTensorError(f"{ck_name}: the checkpoint stores {base} quantized, but its quantization "
                                       f"config keeps it unquantized (excluded, not listed, or no config)")
            check_expert_index(base, e, cfg.num_experts, ck_name)
            if (base, e, proj) in done:
                continue  # a field the format does not read (a weight-only checkpoint's input_scale)
            f = pending.setdefault((base, e, proj), {})
            f[part.field] = t
            if flush(base, e, proj, f):
                del pending[(base, e, proj)]
        elif part.kind == EXPERT_PART:  # one unquantized expert's projection weight
            shapes = expert_shapes(expected, part.target)
            if shapes is None or part.index >= shapes[0]:
                check(ck_name, t, None)
            check(ck_name, t, shapes[1][part.proj])
            load_experts(names.param(part.target), [(f"{part.index}.{part.proj}.weight", t)])
            per_expert.setdefault(part.target, set()).add((part.index, part.proj))
        elif is_hashing_buffer(name):
            pmod, leaf = pname.rsplit(".", 1)
            ours = getattr(modules[pmod], leaf)
            if tuple(t.shape) != tuple(ours.shape) or not torch.equal(t.to(ours.dtype).cpu(), ours.cpu()):
                raise CheckpointError(f"qwen4exp: tensor {ck_name} does not match the config's PLE hashing")
        else:
            want = expected.get(name)
            check(ck_name, t, None if want is None else want.shape)
            seen.add(name)
            load_tensor(pname, t)

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
    for table, got in shard_rows.items():
        check_rows(table, got, expected[f"{table}.weight"].shape[0], cfg.split_ngram_parts)
        seen.add(f"{table}.weight")
    for base, got in per_expert.items():
        if (absent := missing_experts(base, got, expected[f"{base}.gate_up_proj"].shape[0])):
            raise CheckpointError(f"qwen4exp: missing tensor {absent[0]}")
        seen.update(f"{base}.{f}" for f in FUSED_EXPERTS)
    if (missing := [k for k in expected if k not in seen]):
        raise missing_error(missing)
    return loaded
