"""Official checkpoint -> vLLM parameters, for the target model and for the MTP draft head.

Accepts what the HF reference loads (``qwen4exp.hf.loading``): text-only (``model.*``) or composite
(``model.language_model.*``; ``model.visual.*`` is skipped), experts fused or per expert, PLE tables as row shards.
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

from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from ..checkpoint import EXPERT, PLE_SHARD, CheckpointError, canonical_name

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

    for ck_name, t in weights:
        name = canonical_name(ck_name, composite=False)
        if name is None:
            continue
        pname = names.param(name)
        if pname is None:
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
            params[pbase].data[s * step: s * step + t.shape[0]].copy_(t.to(params[pbase].dtype))
            shard_rows.setdefault(base, {})[s] = t.shape[0]
            loaded.add(pbase)
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
