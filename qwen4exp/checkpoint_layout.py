"""The official checkpoint's layout, described once, as data. The validator (``checkpoint.check_tensors``), the HF
loader (``hf.loading``) and the vLLM loader (``vllm.weights``) only walk it.

* Names: ``canonical_name`` maps a checkpoint name to the text model's (composite ``model.language_model.*`` or
  text-only ``model.*``); ``IGNORED`` tensors are read by no runtime.
* Parts: ``classify`` says what a canonical name is: a model tensor as stored (``TENSOR``), one row shard of a PLE
  table (``PLE_ROWS``), the FP8 scale companion of a PLE table (``TABLE_SCALE_OF``), or one tensor of one routed
  expert (``EXPERT_PART``: its projection and field).
* Joins: the checkpoint tensors one model tensor is made of. PLE row shards -> one table, shard s holding rows
  [s * ceil(R / S), ...) of R, S = split_ngram_parts (``join_rows``, ``shard_span``, ``check_rows``; ``split_rows``
  writes them); per-expert projections -> the fused experts, gate_up_proj[e] = [gate_proj; up_proj] and
  down_proj[e] (``fuse_experts``, ``expert_shapes``, ``missing_experts``). ``MERGED``: projections a runtime may
  hold as shards of one fused parameter (the shared expert's gate/up, GDN's q/k/v/z and b/a: vLLM's merged
  linears).
* Quantized routed experts: their field sets per format (``EXPERT_FIELDS``; the checks in ``quant.experts``).
* Expected tensors: ``expected_tensors`` gives the shape and dtype kind of every tensor of the text model (and its MTP
  head), from the shared model assembly (``modeling.DecoderLayer``, ``layers/*``) built on the meta device.

Nothing here imports a runtime (``qwen4exp.hf``, ``qwen4exp.vllm``); torch and the model assembly are imported only
by ``expected_tensors``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: the message names the tensor (missing, unexpected, mis-shaped)."""


# -- names ------------------------------------------------------------------------------------------------------------

# the final mixer's unused injection, and training artefacts (hashstats_*, token_lookup)
IGNORED = (re.compile(r"(^|\.)hyper_connection_mixer\.block_inject_weight\.weight$"),
           re.compile(r"\.hashstats_"), re.compile(r"\.token_lookup"))
# a PLE table's row shard s: groups (table module, s)
PLE_SHARD = re.compile(r"^(.*\.ngram_embedding)\.shards?[._](\d+)\.weight$")
# an FP8 PLE table's per-tensor scale: group (table module)
TABLE_SCALE = re.compile(r"^(.*\.ngram_embedding)\.weight_scale$")
# any tensor of one expert's projection (weight or a quantization scale): groups (experts module, expert, projection,
# field)
EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                           r"(weight|weight_scale|weight_scale_2|input_scale|weight_scale_inv)$")
PROJS = ("gate_proj", "up_proj", "down_proj")
# the fused experts' two tensors: gate_up_proj [E, 2I, D] (gate rows first), down_proj [E, D, I]
FUSED_EXPERTS = ("gate_up_proj", "down_proj")
# the PLE hashing constants (integer buffers): derived from the config, checked against it where a checkpoint has them
HASHING_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")

# quantized routed experts: the tensors one projection carries, per format (``quant.experts`` checks them).
# NVFP4: input_scale only W4A4 (weight-only checkpoints' is not read); block FP8: the scale is named
# weight_scale_inv (vLLM's block-FP8 MoE name) or weight_scale (ModelOpt's linear name)
NVFP4_FIELDS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
EXPERT_FIELDS = {"nvfp4": NVFP4_FIELDS, "fp8_block": ("weight", "weight_scale_inv")}

# checkpoint leaf -> (fused leaf, shard) for projections a runtime holds fused, keyed by the owning module's leaf name.
# shard: the fused parameter's shard index, or a tuple of the owner's attributes giving row counts: the tensor's rows
# split in that order into shards 0, 1, ...
MERGED = {
    "shared_expert": {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)},
    "linear_attn": {"in_proj_qkv": ("in_proj_qkvz", ("key_dim", "key_dim", "value_dim")),
                    "in_proj_z": ("in_proj_qkvz", 3), "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)},
}


def canonical_name(name: str, composite: bool) -> str | None:
    """Checkpoint name -> our parameter name (None: ignore). ``composite``: the model is the composite one
    (``model.language_model.*``); otherwise text-only (``model.*``, vision tensors ignored)."""
    if any(p.search(name) for p in IGNORED):
        return None
    if composite:
        if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
            name = "model.language_model." + name[len("model."):]
    else:
        if name.startswith("model.visual."):
            return None
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
    return name


TENSOR, PLE_ROWS, TABLE_SCALE_OF, EXPERT_PART = "tensor", "ple_rows", "table_scale", "expert"


@dataclass(frozen=True)
class Part:
    """What one canonical checkpoint name is. ``target``: the name itself (``TENSOR``), the PLE table module
    (``PLE_ROWS``, ``TABLE_SCALE_OF``) or the routed-experts module (``EXPERT_PART``); ``index``: the shard or the
    expert; ``proj`` / ``field``: the expert's projection and tensor (weight or a scale)."""

    kind: str
    target: str
    index: int = 0
    proj: str = ""
    field: str = ""


def classify(name: str) -> Part:
    if (m := PLE_SHARD.match(name)):
        return Part(PLE_ROWS, m.group(1), int(m.group(2)))
    if (m := TABLE_SCALE.match(name)):
        return Part(TABLE_SCALE_OF, m.group(1))
    if (m := EXPERT_TENSOR.match(name)):
        return Part(EXPERT_PART, m.group(1), int(m.group(2)), m.group(3), m.group(4))
    return Part(TENSOR, name)


def mtp_layout(names) -> tuple[int, bool]:
    """(MTP layers, has an MTP LM head of its own) from a checkpoint's (canonical) tensor names."""
    ids = {int(m.group(1)) for n in names if (m := re.match(r"^mtp\.layers\.(\d+)\.", n))}
    return (max(ids) + 1 if ids else 0), any(n.startswith("mtp.shared_head.") for n in names)


def is_hashing_buffer(name: str) -> bool:
    return name.endswith(tuple(f".ple_embedding.{b}" for b in HASHING_BUFFERS))


# -- joins ------------------------------------------------------------------------------------------------------------

def check_shard_order(table: str, shards) -> list[int]:
    """The shard numbers of a PLE table in order; a gap raises CheckpointError naming the table and the shards."""
    order = sorted(shards)
    if order != list(range(len(order))):
        raise CheckpointError(f"qwen4exp: PLE table {table} is missing shards "
                              f"{sorted(set(range(order[-1] + 1)) - set(order))[:8]}")
    return order


def shard_span(rows: int, parts: int, s: int) -> tuple[int, int]:
    """(first row, row count) of shard ``s`` of a table of ``rows`` rows written in ``parts`` shards."""
    step = math.ceil(rows / parts)
    return s * step, max(0, min(step, rows - s * step))


def check_rows(table: str, got: dict[int, int], rows: int, parts: int) -> None:
    """A table's shards (shard -> rows) hold all ``rows`` rows; else CheckpointError naming the missing shards."""
    if sum(got.values()) != rows:
        step = math.ceil(rows / parts)
        missing = [s for s in range(math.ceil(rows / step)) if s not in got]
        raise CheckpointError(f"qwen4exp: PLE table {table} is missing shards {missing[:8]}")


def join_rows(table: str, shards: dict):
    """The shards of one table (shard -> [rows_s, d] tensor) as one [rows, d] tensor."""
    import torch

    return torch.cat([shards[s] for s in check_shard_order(table, shards)], 0)


def split_rows(table: str, t, parts: int) -> dict:
    """The inverse join, for writing: one table as the row shards the official checkpoint stores."""
    import torch

    return {f"{table}.shard_{s}.weight": part.contiguous() for s, part in enumerate(torch.chunk(t, parts, 0))}


def expert_shapes(expected: dict, base: str) -> tuple[int, dict[str, tuple[int, ...]]] | None:
    """(number of experts, projection -> [out, in]) of the fused experts ``base`` from their expected tensors;
    None where the model has no such experts."""
    gu, dn = (expected.get(f"{base}.{f}") for f in FUSED_EXPERTS)
    if gu is None or dn is None:
        return None
    n, i2, d = gu.shape
    return n, {"gate_proj": (i2 // 2, d), "up_proj": (i2 // 2, d), "down_proj": tuple(dn.shape[1:])}


def missing_experts(base: str, got, n: int) -> list[str]:
    """The per-expert weights of ``base`` (experts 0..n-1) not in ``got`` ((expert, projection) pairs)."""
    return [f"{base}.{e}.{p}.weight" for e in range(n) for p in PROJS if (e, p) not in got]


def fuse_experts(base: str, per: dict) -> dict:
    """Per-expert weights (expert -> projection -> tensor) -> the fused experts' tensors (name -> tensor)."""
    import torch

    n = max(per) + 1
    if (absent := missing_experts(base, {(e, p) for e, ps in per.items() for p in ps}, n)):
        raise CheckpointError(f"qwen4exp: missing tensor {absent[0]}")
    return {f"{base}.gate_up_proj": torch.stack([torch.cat([per[e]["gate_proj"], per[e]["up_proj"]], 0)
                                                 for e in range(n)]),
            f"{base}.down_proj": torch.stack([per[e]["down_proj"] for e in range(n)])}


def missing_error(names, where: str = "checkpoint") -> CheckpointError:
    names = list(names)
    return CheckpointError(f"qwen4exp: {where} is missing tensor(s): {', '.join(names[:10])}"
                           + (f" (+{len(names) - 10} more)" if len(names) > 10 else ""))


# -- expected tensors -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Expected:
    """One tensor of the model: its shape, and whether it is a float weight (else an integer buffer)."""

    shape: tuple[int, ...]
    floating: bool


def expected_tensors(config, mtp_layers: int = 0, mtp_shared_head: bool = False) -> dict[str, Expected]:
    """Every tensor of the text model that text config ``config`` builds, by checkpoint name (text-only names:
    ``model.*``, ``lm_head.weight``, ``mtp.*`` with ``mtp_layers`` MTP layers), with fused experts and whole PLE
    tables. Built from the shared model assembly on the meta device: nothing is allocated."""
    import torch
    from torch import nn

    from .configuration import INDEXED
    from .layers.hyper_connection import HyperConnection
    from .layers.mtp import MTPInput
    from .modeling import DecoderLayer

    D, V = config.hidden_size, config.vocab_size
    with torch.device("meta"):
        root, model = nn.Module(), nn.Module()
        model.embed_tokens = nn.Embedding(V, D)
        model.layers = nn.ModuleList(DecoderLayer(config, i, prefix=f"model.layers.{i}")
                                     for i in range(config.num_hidden_layers))
        model.hyper_connection_mixer = HyperConnection(config, inject=False)
        root.model = model
        root.lm_head = nn.Linear(D, V, bias=False)
        if mtp_layers:
            mtp = MTPInput(config, prefix="mtp")
            mtp.layers = nn.ModuleList(DecoderLayer(config, i, prefix=f"mtp.layers.{i}", layer_type=INDEXED,
                                                    with_ple=False) for i in range(mtp_layers))
            mtp.hyper_connection_mixer = HyperConnection(config, inject=False)
            if mtp_shared_head:
                mtp.shared_head = nn.Module()
                mtp.shared_head.head = nn.Linear(D, V, bias=False)
            root.mtp = mtp
    return {k: Expected(tuple(v.shape), v.dtype.is_floating_point) for k, v in root.state_dict().items()}
