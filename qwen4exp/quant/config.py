"""NVIDIA ModelOpt quantization configs, parsed as vLLM 0.32 reads them, and the per-module decision they imply.

Two forms (vLLM ``ModelOptQuantConfigBase.from_config``, ``model_executor/layers/quantization/modelopt.py:319-405``):

* ``config.json`` -> ``quantization_config`` (ModelOpt >= 0.31, ``convert_hf_quant_config_format``)::

      {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": [...],
       "kv_cache_scheme": {"type": "float", "num_bits": 8}, "config_groups": {...}, "quantized_layers": {...}}

* the older separate ``hf_quant_config.json`` (or the same dict under ``quantization_config``)::

      {"producer": {"name": "modelopt", ...}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
       "exclude_modules": [...], "kv_cache_quant_algo": null}}

Module matching (``QuantConfig.is_excluded`` / ``layer_algo``) is vLLM's own algorithm, re-implemented so the HF
reference and the plugin decide exactly what vLLM decides: ``apply_vllm_mapper``'s trailing-``*`` split and prefix
renames (modelopt.py:262-282, through ``hf_to_vllm_mapper.get_rename_mapper()``, ``model_loader/utils.py:373-381``),
then ``is_layer_excluded`` (modelopt.py:187-222: fused-aware exact match, legacy substring match, ``fnmatch``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import lru_cache
from typing import Any

from .errors import QuantConfigError

# what this package serves (top level); MIXED_PRECISION picks one of LAYER_ALGOS per module
LAYER_ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8", "FP8_PB_WO")
SUPPORTED_ALGOS = (*LAYER_ALGOS, "MIXED_PRECISION")
# early Qwen3.8-Flash-Next checkpoints name 2-D block FP8 so (vLLM keeps the alias, modelopt.py:124-128)
ALGO_ALIASES = {"FP8_BLOCK_SCALES": "FP8_PB_WO"}
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
NVFP4_GROUP_SIZE = 16
FP8_BLOCK_SIZE = 128
# vLLM requires these in a legacy NVFP4 config (modelopt.py:812-824)
LEGACY_REQUIRED_FIELDS = ("group_size", "kv_cache_quant_algo", "exclude_modules")
# the legacy form's algos vLLM's config normaliser accepts (transformers_utils/model_arch_config_convertor.py:276-289)
LEGACY_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4")
# always unquantized in a non-mixed ModelOpt config (modelopt.py:238-245)
VISION_MARKERS = ("vision_tower", "vision_model", "vit_large_projector")

# -- the runtimes' module-name layouts ------------------------------------------------------------------------------
# "hf": our HF classes (names = checkpoint names: model.language_model.*, model.visual.*, lm_head, mtp.*; text-only
#   model.*). vLLM has no such model; it is matched as vLLM matches a model whose mapper renames nothing.
# "hf_text": our text-only HF class (model.*, lm_head): matched as "vllm_text", whose names it shares.
# "vllm_text": in-tree Qwen4ExpForCausalLM (models/qwen4_exp/nvidia/model.py:715-717): model.*, lm_head.
# "vllm_composite": in-tree Qwen4ExpForConditionalGeneration, mapper inherited from Qwen3VLForConditionalGeneration
#   (model_executor/models/qwen3_vl.py:1969-1975): visual.*, language_model.model.*, language_model.lm_head.
# "vllm_mtp": in-tree Qwen4ExpMTP draft (models/qwen4_exp/nvidia/mtp.py:136-169): no mapper (no trailing-* split),
#   exclude names mtp.layers.i -> mtp.layers.{num_hidden_layers + i}; draft modules are mtp.layers.{N+i}.*, mtp.fc_*.
LAYOUTS = ("hf", "hf_text", "vllm_text", "vllm_composite", "vllm_mtp")
PREFIX_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "hf": (),
    "hf_text": (("model.language_model.", "model."),),
    "vllm_text": (("model.language_model.", "model."),),
    "vllm_composite": (("model.visual.", "visual."), ("lm_head.", "language_model.lm_head."),
                       ("model.language_model.", "language_model.model.")),
    "vllm_mtp": (),
}
_TEXT_PACKED = {  # Qwen4ExpForCausalLM.packed_modules_mapping (nvidia/model.py:703-714)
    "qkv_proj": ["q_proj", "k_proj", "v_proj", "indexer.index_qk_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "kv_proj": ["key_proj", "value_proj"],
    "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
    "in_proj_ba": ["in_proj_b", "in_proj_a"],
    "input_mix_weight_down_block_inject": ["input_mix_weight_down", "block_inject_weight", "_input_mix_padding"],
}
PACKED_MODULES: dict[str, dict[str, list[str]]] = {
    "hf": {},  # our HF modules are not fused
    "hf_text": {},
    "vllm_text": _TEXT_PACKED,
    # Qwen3VL's (qwen3_vl.py:1949-1960) | Qwen3.5's GDN pairs (qwen3_5.py:481-484)
    # | Qwen4Exp's (nvidia/model.py:954-962)
    "vllm_composite": {"qkv_proj": _TEXT_PACKED["qkv_proj"], "gate_up_proj": ["gate_proj", "up_proj"], "qkv": ["qkv"],
                       "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"],
                       "kv_proj": ["key_proj", "value_proj"],
                       "input_mix_weight_down_block_inject": _TEXT_PACKED["input_mix_weight_down_block_inject"]},
    "vllm_mtp": {  # Qwen4ExpMTP.packed_modules_mapping (nvidia/mtp.py:401-411)
        "qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"],
        "input_mix_weight_down_block_inject": _TEXT_PACKED["input_mix_weight_down_block_inject"]},
}


@dataclass(frozen=True)
class LayerQuant:
    """One module's format in a MIXED_PRECISION config: ``algo`` (one of LAYER_ALGOS) and its group / block size."""

    algo: str
    group_size: int | None = None  # NVFP4: 16 elements a scale; FP8_PB_WO: 128 (128x128 blocks); FP8: None


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's ModelOpt quantization config, as vLLM 0.32 reads it.

    ``quant_algo`` is after vLLM's normalisation (upper case; "NVFP4" whose ``config_groups`` all lack
    ``input_activations`` becomes "W4A16_NVFP4", modelopt.py:793-807). ``exclude_modules`` is the list as written
    (HF names, wildcards). ``quantized_layers`` (MIXED_PRECISION only) keeps the checkpoint's order, which vLLM's
    prefix lookups depend on."""

    quant_algo: str
    group_size: int = NVFP4_GROUP_SIZE
    exclude_modules: tuple[str, ...] = ()
    kv_cache_quant_algo: str | None = None
    quantized_layers: tuple[tuple[str, LayerQuant], ...] = ()
    source: str = "config.json"
    producer: str | None = None

    @property
    def is_mixed(self) -> bool:
        return self.quant_algo == "MIXED_PRECISION"

    @property
    def weight_only(self) -> bool:
        """NVFP4 weights with BF16 activations (no ``input_scale`` read)."""
        return self.quant_algo == "W4A16_NVFP4"

    def algos(self) -> frozenset[str]:
        """Every format the config can ask for."""
        if self.is_mixed:
            return frozenset(lq.algo for _, lq in self.quantized_layers)
        return frozenset((self.quant_algo,))

    def is_excluded(self, name: str, layout: str = "hf", *, num_hidden_layers: int | None = None,
                    packed_modules_mapping: Mapping[str, list[str]] | None = None) -> bool:
        """Whether the exclude list keeps module ``name`` (a module name in ``layout``'s runtime) unquantized,
        exactly as vLLM's ``is_layer_excluded`` decides. ``vllm_mtp`` needs ``num_hidden_layers``."""
        packed = PACKED_MODULES[_check_layout(layout)] if packed_modules_mapping is None else packed_modules_mapping
        patterns = layout_patterns(self.exclude_modules, layout, num_hidden_layers)
        return is_layer_excluded(name, patterns, packed)

    def layer_algo(self, name: str, layout: str = "hf", *, num_hidden_layers: int | None = None,
                   packed_modules_mapping: Mapping[str, list[str]] | None = None) -> str | None:
        """The format the config asks for linear / routed-experts module ``name`` (None: unquantized), as vLLM's
        ``get_quant_method`` decides it (modelopt.py:224-260, mixed: 1817-1883). Model-side BF16 islands (vLLM's
        ``quant_config=None`` layers: QSA projections, HC linears, router, shared_expert_gate) are not the config's
        business and are not applied here."""
        packed = PACKED_MODULES[_check_layout(layout)] if packed_modules_mapping is None else packed_modules_mapping
        if self.is_excluded(name, layout, num_hidden_layers=num_hidden_layers, packed_modules_mapping=packed):
            return None
        if not self.is_mixed:
            return None if any(m in name for m in VISION_MARKERS) else self.quant_algo
        layers = _layout_quantized_layers(self.quantized_layers, layout, num_hidden_layers)
        return resolve_layer_algo(name, layers, packed)


# -- parsing --------------------------------------------------------------------------------------------------------
def parse_quant_config(cfg: Mapping[str, Any], *, source: str = "config.json") -> QuantConfig:
    """Parse ``config.json``'s ``quantization_config`` or an ``hf_quant_config.json`` dict (told apart by the
    ``quantization`` key, as vLLM does). ``source`` only labels error messages. Raises QuantConfigError naming the
    field for anything this package cannot serve."""
    if not isinstance(cfg, Mapping):
        raise QuantConfigError(f"{source}: quantization config must be a JSON object, got {type(cfg).__name__}")
    legacy = "quantization" in cfg
    where = f"{source}: quantization" if legacy else f"{source}: quantization_config"
    producer = cfg.get("producer")
    producer_s = None
    if isinstance(producer, Mapping):
        producer_s = " ".join(str(producer[k]) for k in ("name", "version") if producer.get(k) is not None) or None
    if legacy:
        q = cfg["quantization"]
        if not isinstance(q, Mapping):
            raise QuantConfigError(f"{where} must be a JSON object, got {type(q).__name__}")
        # vLLM recognises a legacy config by its producer, whose algo its normaliser then restricts
        # (model_arch_config_convertor.py:270-289), or by an explicit quant_method (modelopt.py:284-306)
        by_producer = (isinstance(producer, Mapping) and producer.get("name") == "modelopt") \
            or "modelopt_quant_config" in q
        method = cfg.get("quant_method")
        if not by_producer and not (isinstance(method, str) and method.lower().startswith("modelopt")):
            raise QuantConfigError(f"{source}: producer.name must be 'modelopt' (or quant_method 'modelopt'): vLLM "
                                   f"0.32 recognises a legacy 'quantization' config only so, got producer "
                                   f"{producer!r}")
        algo_raw = q.get("quant_algo")
        kv_raw = q.get("kv_cache_quant_algo")
        group_raw = q.get("group_size")
        exclude_raw = q.get("exclude_modules", [])
        layers_raw = q.get("quantized_layers", {})
        field = {"quant_algo": f"{where}.quant_algo", "kv": f"{where}.kv_cache_quant_algo",
                 "group_size": f"{where}.group_size", "exclude": f"{where}.exclude_modules",
                 "layers": f"{where}.quantized_layers"}
    else:
        method = cfg.get("quant_method")
        if not isinstance(method, str) or not method.lower().startswith("modelopt"):
            raise QuantConfigError(f"{where}.quant_method must name ModelOpt ('modelopt'), got {method!r}")
        algo_raw = cfg.get("quant_algo")
        scheme = cfg.get("kv_cache_scheme")
        # vLLM reads only an 8-bit float scheme (FP8); anything else: no KV-cache quantization (modelopt.py:343-352)
        kv_raw = "FP8" if isinstance(scheme, Mapping) and scheme.get("type") == "float" \
            and scheme.get("num_bits") == 8 else None
        group_raw = cfg.get("group_size")
        exclude_raw = cfg.get("ignore", [])
        layers_raw = cfg.get("quantized_layers", {})
        field = {"quant_algo": f"{where}.quant_algo", "kv": f"{where}.kv_cache_scheme",
                 "group_size": f"{where}.group_size", "exclude": f"{where}.ignore",
                 "layers": f"{where}.quantized_layers"}

    algo = _algo(algo_raw, field["quant_algo"], SUPPORTED_ALGOS, aliases=False)
    if legacy and by_producer and algo not in LEGACY_ALGOS:
        raise QuantConfigError(f"{field['quant_algo']}: {algo!r} is not read by vLLM 0.32 in the legacy "
                               f"'quantization' form (only {', '.join(LEGACY_ALGOS)}); write it into config.json's "
                               f"quantization_config instead")
    if legacy and algo in NVFP4_ALGOS:
        missing = [f for f in LEGACY_REQUIRED_FIELDS if f not in q]
        if missing:
            raise QuantConfigError(f"{where}: NVFP4 needs the field(s) {', '.join(missing)} (vLLM requires them in "
                                   f"the legacy form)")
    if kv_raw is not None and not isinstance(kv_raw, str):
        raise QuantConfigError(f"{field['kv']} must be a string or null, got {type(kv_raw).__name__}")
    kv = kv_raw.upper() if isinstance(kv_raw, str) else None
    if not isinstance(exclude_raw, list) or not all(isinstance(p, str) for p in exclude_raw):
        raise QuantConfigError(f"{field['exclude']} must be a list of strings (module names / wildcards), "
                               f"got {exclude_raw!r}")
    group_size = _int_or_none(group_raw, field["group_size"])

    layers: tuple[tuple[str, LayerQuant], ...] = ()
    if algo == "MIXED_PRECISION":
        layers = _parse_quantized_layers(layers_raw, field["layers"])
        if group_size is None:  # vLLM: the first NVFP4-family entry's group size (modelopt.py:1660-1672)
            group_size = next((lq.group_size for _, lq in layers if lq.algo in NVFP4_ALGOS), None)
    if group_size is None:
        group_size = NVFP4_GROUP_SIZE
    if group_size != NVFP4_GROUP_SIZE and (algo in NVFP4_ALGOS or algo == "MIXED_PRECISION"):
        raise QuantConfigError(f"{field['group_size']}: NVFP4 is served with group size {NVFP4_GROUP_SIZE} only, "
                               f"got {group_size}")

    if algo == "NVFP4" and not legacy:
        groups = cfg.get("config_groups")
        if groups is not None and not isinstance(groups, Mapping):
            raise QuantConfigError(f"{where}.config_groups must be a JSON object, got {type(groups).__name__}")
        if groups:
            for gname, group in groups.items():
                if not isinstance(group, Mapping):
                    continue  # vLLM skips the W4A16 test for such a group; nothing else reads it
                for part in ("weights", "input_activations"):
                    spec = group.get(part)
                    if isinstance(spec, Mapping) and spec.get("group_size") is not None:
                        g = _int_or_none(spec["group_size"], f"{where}.config_groups.{gname}.{part}.group_size")
                        if g != NVFP4_GROUP_SIZE:
                            raise QuantConfigError(f"{where}.config_groups.{gname}.{part}.group_size: NVFP4 is "
                                                   f"served with group size {NVFP4_GROUP_SIZE} only, got {g}")
            # weight-only export under the "NVFP4" name: vLLM routes it through W4A16 (modelopt.py:793-807)
            if all(isinstance(g, Mapping) and g.get("input_activations") is None for g in groups.values()):
                algo = "W4A16_NVFP4"
    return QuantConfig(quant_algo=algo, group_size=group_size, exclude_modules=tuple(exclude_raw),
                       kv_cache_quant_algo=kv, quantized_layers=layers, source=source, producer=producer_s)


def load_quant_config(checkpoint_dir: str | os.PathLike) -> QuantConfig | None:
    """A checkpoint directory's quantization config, looked up as vLLM does (transformers_utils/config.py:890-902,
    model_arch_config_convertor.py:305-312): ``config.json``'s ``quantization_config`` (top level, else the text
    config's), else ``hf_quant_config.json``. None when there is none."""
    path = os.path.join(os.fspath(checkpoint_dir), "config.json")
    with open(path) as f:
        cfg = json.load(f)
    q = cfg.get("quantization_config")
    if q is None and isinstance(cfg.get("text_config"), Mapping):
        q = cfg["text_config"].get("quantization_config")
    if q is not None:
        return parse_quant_config(q, source="config.json")
    legacy = os.path.join(os.fspath(checkpoint_dir), "hf_quant_config.json")
    if os.path.exists(legacy):
        with open(legacy) as f:
            return parse_quant_config(json.load(f), source="hf_quant_config.json")
    return None


def _algo(raw: Any, field: str, allowed: tuple[str, ...], aliases: bool = True) -> str:
    if raw is None or raw == "":
        raise QuantConfigError(f"{field} is missing")
    if not isinstance(raw, str):
        raise QuantConfigError(f"{field} must be a string, got {type(raw).__name__}")
    algo = raw.upper()  # ModelOpt may write it lower case ("fp8_pb_wo")
    if aliases:  # vLLM knows the alias in quantized_layers only (for routed experts, modelopt.py:1859-1860)
        algo = ALGO_ALIASES.get(algo, algo)
    if algo not in allowed:
        raise QuantConfigError(f"{field}: unsupported quant_algo {raw!r} (qwen4exp serves {', '.join(allowed)})")
    return algo


def _int_or_none(raw: Any, field: str) -> int | None:
    # vLLM takes anything int() takes (modelopt.py:380-390); a bool or a fractional number is a mistake, not a size
    if raw is None:
        return None
    if isinstance(raw, bool):
        raise QuantConfigError(f"{field} must be an integer, got {raw!r}")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if isinstance(raw, str) and raw.strip().isdigit():
        return int(raw)
    raise QuantConfigError(f"{field} must be an integer, got {raw!r}")


def _parse_quantized_layers(raw: Any, field: str) -> tuple[tuple[str, LayerQuant], ...]:
    if not isinstance(raw, Mapping) or not raw:
        raise QuantConfigError(f"{field}: MIXED_PRECISION needs a non-empty mapping of module name -> "
                               f"{{'quant_algo': ...}}, got {raw!r}")
    out = []
    for name, info in raw.items():
        if not isinstance(info, Mapping):
            raise QuantConfigError(f"{field}.{name} must be a JSON object, got {type(info).__name__}")
        algo = _algo(info.get("quant_algo"), f"{field}.{name}.quant_algo", LAYER_ALGOS)
        g = _int_or_none(info.get("group_size"), f"{field}.{name}.group_size")
        if algo in NVFP4_ALGOS:
            g = NVFP4_GROUP_SIZE if g is None else g
            if g != NVFP4_GROUP_SIZE:
                raise QuantConfigError(f"{field}.{name}.group_size: NVFP4 is served with group size "
                                       f"{NVFP4_GROUP_SIZE} only, got {g}")
        elif algo == "FP8_PB_WO":  # vLLM's default block (modelopt.py:1584-1596)
            g = FP8_BLOCK_SIZE if g is None else g
            if g != FP8_BLOCK_SIZE:
                raise QuantConfigError(f"{field}.{name}.group_size: block FP8 is served with "
                                       f"{FP8_BLOCK_SIZE}x{FP8_BLOCK_SIZE} blocks only, got {g}")
        else:
            g = None
        out.append((name, LayerQuant(algo, g)))
    return tuple(out)


# -- vLLM's matching, re-implemented ----------------------------------------------------------------------------------
def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown module-name layout {layout!r} (one of {', '.join(LAYOUTS)})")
    return layout


def split_trailing_star(patterns) -> list[str]:
    """``apply_vllm_mapper``'s rewrite (modelopt.py:279-285): ``foo*`` (not ``foo.*``) -> ``foo`` and ``foo.*``."""
    out = []
    for p in patterns:
        if len(p) >= 2 and p[-1] == "*" and p[-2] != ".":
            out += [p[:-1], p[:-1] + ".*"]
        else:
            out.append(p)
    return out


def rename_prefix(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """``WeightsMapper``'s prefix pass (model_executor/models/utils.py:131-136): each rule in turn, first occurrence."""
    for old, new in renames:
        if name.startswith(old):
            name = name.replace(old, new, 1)
    return name


def _shift_mtp_index(name: str, start: int) -> str:
    # nvidia/mtp.py:68-83: only names that start with "mtp."
    if not name.startswith("mtp."):
        return name
    return re.sub(r"(?<=\.layers\.)\d+", lambda m: str(start + int(m.group(0))), name)


@lru_cache(maxsize=64)
def _layout_patterns(patterns: tuple[str, ...], layout: str, num_hidden_layers: int | None) -> tuple[str, ...]:
    if layout == "vllm_mtp":
        if num_hidden_layers is None:
            raise ValueError("layout 'vllm_mtp' needs num_hidden_layers (the draft's first layer index)")
        return tuple(_shift_mtp_index(p, num_hidden_layers) for p in patterns)
    return tuple(rename_prefix(p, PREFIX_RENAMES[layout]) for p in split_trailing_star(patterns))


def layout_patterns(patterns, layout: str, num_hidden_layers: int | None = None) -> tuple[str, ...]:
    """The exclude list as vLLM holds it for ``layout``'s model (our "hf" layout: split, nothing renamed)."""
    return _layout_patterns(tuple(patterns), _check_layout(layout), num_hidden_layers)


def _layout_quantized_layers(layers: tuple[tuple[str, LayerQuant], ...], layout: str,
                             num_hidden_layers: int | None) -> dict[str, LayerQuant]:
    # vLLM: apply_dict through the rename mapper (modelopt.py:1885-1888); the MTP draft shifts indices (mtp.py:86-94)
    _check_layout(layout)
    if layout == "vllm_mtp":
        if num_hidden_layers is None:
            raise ValueError("layout 'vllm_mtp' needs num_hidden_layers (the draft's first layer index)")
        return {_shift_mtp_index(k, num_hidden_layers): v for k, v in layers}
    return {rename_prefix(k, PREFIX_RENAMES[layout]): v for k, v in layers}


def is_layer_skipped(prefix: str, ignored: list[str] | tuple[str, ...],
                     fused_mapping: Mapping[str, list[str]]) -> bool:
    """vLLM's ``is_layer_skipped`` in its default exact mode (quantization/utils/quant_utils.py:617-691)."""
    proj_name = prefix.split(".")[-1]
    if proj_name in fused_mapping and prefix in ignored:
        return True
    if proj_name in fused_mapping:
        skipped = None
        for shard in fused_mapping[proj_name]:
            s = prefix.replace(proj_name, shard) in ignored
            if skipped is None:
                skipped = s
            elif s != skipped:
                raise QuantConfigError(f"exclude list: some but not all shards of {prefix} are excluded; the shards "
                                       f"of a fused layer must share one precision")
        return bool(skipped)
    if "experts" in prefix:
        return any(prefix in layer for layer in ignored if "experts" in layer)
    return prefix in ignored


def is_layer_excluded(prefix: str, patterns, packed_modules_mapping: Mapping[str, list[str]]) -> bool:
    """vLLM's ``ModelOptQuantConfigBase.is_layer_excluded`` (modelopt.py:187-222) on already-mapped ``patterns``."""
    patterns = list(patterns)
    if not patterns:
        return False
    if is_layer_skipped(prefix, patterns, packed_modules_mapping):
        return True
    for p in patterns:  # legacy substring match (checkpoints from ModelOpt < 0.39)
        if p != prefix and (p in prefix or (prefix.startswith("language_model.")
                                            and p in prefix.removeprefix("language_model."))):
            return True
    return any(fnmatch(prefix, p) for p in patterns)


def _candidates(prefix: str) -> tuple[str, ...]:
    # modelopt.py:1795-1808
    c = [prefix]
    if prefix.endswith(".lm_head"):
        c.append("lm_head")
    if prefix.startswith("language_model.model."):
        c.append("model.language_model." + prefix[len("language_model.model."):])
    elif prefix.startswith("model.language_model."):
        c.append("language_model.model." + prefix[len("model.language_model."):])
    return tuple(dict.fromkeys(c))


def resolve_layer_algo(prefix: str, layers: Mapping[str, LayerQuant],
                       packed_modules_mapping: Mapping[str, list[str]]) -> str | None:
    """vLLM's ``ModelOptMixedPrecisionConfig._resolve_quant_algo`` (modelopt.py:1717-1792), same order of lookups."""
    for c in _candidates(prefix):  # 1. the module itself
        if c in layers:
            return layers[c].algo
    proj = prefix.rsplit(".", 1)[-1]
    if packed_modules_mapping and proj in packed_modules_mapping:  # 2. a fused module's shards
        algos = set()
        for base in _candidates(prefix.rsplit(".", 1)[0]):
            for shard in packed_modules_mapping[proj]:
                if f"{base}.{shard}" in layers:
                    algos.add(layers[f"{base}.{shard}"].algo)
        if len(algos) > 1:
            raise QuantConfigError(f"quantized_layers: the shards of fused layer {prefix} mix {sorted(algos)}")
        if algos:
            return algos.pop()
    for c in _candidates(prefix):  # 3. a parent module (routed experts: experts.0.gate_proj ...)
        for key, lq in layers.items():
            if key.startswith(c + "."):
                return lq.algo
    if prefix.endswith(".experts"):  # ... or entries named after the MoE block's projections
        parent = prefix.rsplit(".experts", 1)[0] + "."
        for key, lq in layers.items():
            if key.startswith(parent):
                return lq.algo
    shards = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(proj)
    if shards is not None:  # 4. fused projections listed by their shard names
        for c in _candidates(prefix):
            parent = c.rsplit(".", 1)[0] + "."
            algos = {layers[parent + s].algo for s in shards if parent + s in layers}
            if len(algos) > 1:
                raise QuantConfigError(f"quantized_layers: the shards of fused layer {prefix} mix {sorted(algos)}")
            if algos:
                return algos.pop()
    return None
