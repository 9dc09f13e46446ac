"""Official checkpoint -> vLLM parameters.

Accepts what the HF reference loads (``qwen4exp.hf.loading``): text-only (``model.*``) or composite
(``model.language_model.*``; ``model.visual.*`` and ``mtp.*`` are skipped), experts fused or per expert, PLE tables
as row shards. Every tensor is checked against the shape our reference model expects (built on the meta device from
the same config) before it is handed to a vLLM weight loader, and tensors that never arrive are reported by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch

from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from ..hf.loading import _EXPERT, _SHARD, CheckpointError, canonical_name

_GDN_FUSED = {"in_proj_qkv": ("in_proj_qkvz", None), "in_proj_z": ("in_proj_qkvz", 3),
              "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)}
_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


def _reference_shapes(config) -> dict[str, tuple[int, ...]]:
    from ..configuration import load_config
    from ..hf.modeling import Qwen4ExpForCausalLM as Reference

    ours = load_config(config.to_dict())
    ours = ours.get_text_config() if hasattr(ours, "get_text_config") else ours
    with torch.device("meta"):
        ref = Reference(ours, mtp_layers=0)
    return {k: tuple(v.shape) for k, v in ref.named_parameters()}


def load_qwen4exp_weights(model, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    cfg = model.config
    expected = _reference_shapes(cfg)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    seen: set[str] = set()
    shard_rows: dict[str, dict[int, int]] = {}
    per_expert: dict[str, set[tuple[int, str]]] = {}

    def check(ck_name: str, t: torch.Tensor, shape: tuple[int, ...] | None):
        if shape is None:
            raise CheckpointError(f"qwen4exp: unexpected tensor {ck_name} in the checkpoint")
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"qwen4exp: tensor {ck_name} has shape {tuple(t.shape)}, expected {tuple(shape)}")

    def load_param(pname: str, t: torch.Tensor, *shard):
        p = params.get(pname)
        if p is None:
            raise CheckpointError(f"qwen4exp: no parameter {pname} for checkpoint tensor")
        getattr(p, "weight_loader", default_weight_loader)(p, t, *shard)

    for ck_name, t in weights:
        if ck_name.startswith("mtp."):
            continue
        name = canonical_name(ck_name, composite=False)
        if name is None:
            continue
        m = _SHARD.match(name)
        if m:
            base = f"{m.group(1)}.weight"
            rows, dim = expected.get(base, (None, None))
            if rows is None:
                check(ck_name, t, None)
            s = int(m.group(2))
            step = math.ceil(rows / cfg.split_ngram_parts)
            check(ck_name, t, (max(0, min(step, rows - s * step)), dim))
            params[base].data[s * step: s * step + t.shape[0]].copy_(t.to(params[base].dtype))
            shard_rows.setdefault(base, {})[s] = t.shape[0]
            continue
        m = _EXPERT.match(name)
        if m:
            base, e, proj = m.group(1), int(m.group(2)), m.group(3)
            E, twoI, D = expected[f"{base}.gate_up_proj"]
            I = twoI // 2
            if e >= E:
                check(ck_name, t, None)
            check(ck_name, t, (D, I) if proj == "down_proj" else (I, D))
            list(modules[base].load_weights([(f"{e}.{proj}.weight", t)]))
            per_expert.setdefault(base, set()).add((e, proj))
            continue
        if name.endswith(tuple(f".ple_embedding.{b}" for b in _BUFFERS)):
            mod, leaf = name.rsplit(".", 1)
            ours = getattr(modules[mod], leaf)
            if tuple(t.shape) != tuple(ours.shape) or not torch.equal(t.to(ours.dtype).cpu(), ours.cpu()):
                raise CheckpointError(f"qwen4exp: tensor {ck_name} does not match the config's PLE hashing")
            continue
        check(ck_name, t, expected.get(name))
        seen.add(name)
        mod, leaf = name.rsplit(".", 1)
        if mod.endswith((".mlp.experts",)) and leaf in ("gate_up_proj", "down_proj"):
            list(modules[mod].load_weights([(leaf, t)]))
        elif (mod.rsplit(".", 1)[-1] in _GDN_FUSED and ".linear_attn." in mod
              and hasattr(modules[mod.rsplit(".", 1)[0]], "in_proj_qkvz")):  # vLLM's fused GDN projections
            owner, leafmod = mod.rsplit(".", 1)
            target, shard = _GDN_FUSED[leafmod]
            pname = f"{owner}.{target}.weight"
            if shard is None:  # [q | k | v] rows -> shards 0, 1, 2
                lin = modules[owner]
                kd, vd = lin.key_dim, lin.value_dim
                for i, part in enumerate(t.split([kd, kd, vd], 0)):
                    load_param(pname, part, i)
            else:
                load_param(pname, t, shard)
        else:
            load_param(name, t)

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
    return {n for n, _ in model.named_parameters()}
