"""Configuration classes for Qwen4Exp (Qwen3.8-Flash-Next).

They read and write the official ``config.json`` (``model_type`` ``qwen4_exp`` with a ``text_config`` of type
``qwen4_exp_text`` and a ``vision_config`` of type ``qwen4_exp_vision``). They are our own classes: they are not
registered with ``AutoConfig``, so an installed transformers that ships its own ``qwen4_exp`` keeps its classes.

Every runtime in this package reads configs by attribute only, so upstream's config objects (which vLLM hands us)
work the same as these.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig
from transformers import configuration_utils as _tcu

LINEAR = "linear_attention"
# The QSA layers' name in layer_types: transformers' validator accepts only its own list, which calls them
# "indexed_attention" from 5.18 on and "qwen_sparse_attention" before (5.16.1, 5.17: the name upstream vLLM 0.32's
# range still allows); our configs read either and write the installed transformers' name.
INDEXED = ("indexed_attention" if "indexed_attention" in getattr(_tcu, "ALLOWED_LAYER_TYPES", ("indexed_attention",))
           else "qwen_sparse_attention")
_INDEXED_ALIASES = {"full_attention", "qwen_sparse_attention", "indexed_attention"}
_LINEAR_ALIASES = {"mamba", LINEAR}  # transformers remaps the legacy "mamba" the same way
_QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


class ConfigError(ValueError):
    """A config field has a value this model cannot run with. The message names the field."""


def _fail(field: str, msg: str) -> None:
    raise ConfigError(f"Qwen4Exp config field `{field}`: {msg}")


# Fields a checkpoint's config.json must set: they fix every tensor's shape, so a default would build another model.
REQUIRED_TEXT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                        "linear_value_head_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
                        "num_experts", "num_experts_per_tok")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_field_types(values) -> None:
    """Each text-config field against the type ``Qwen4ExpTextConfig`` declares for it (``int``, ``int | None``,
    ``float``, ``list[int] | None``, ``int | list[int] | None``): ``"big"``, ``1.5`` or ``null`` where an int is
    required fails naming the field. ``values``: a mapping, or any object with the fields as attributes (upstream's
    config objects); fields it lacks are not checked here."""
    get = values.get if isinstance(values, dict) else (lambda k, d=None: getattr(values, k, d))
    missing = object()
    for name, kind in _field_kinds().items():
        v = get(name, missing)
        if v is missing:
            continue
        optional = kind.endswith("| None")
        if v is None:
            if not optional:
                _fail(name, f"must be {kind}, got null")
            continue
        base = kind.removesuffix(" | None")
        if base == "int":
            ok = _is_int(v)
        elif base == "float":
            ok = _is_int(v) or isinstance(v, float)
        elif base == "list[int]":
            ok = isinstance(v, (list, tuple)) and all(_is_int(x) for x in v)
        elif base == "int | list[int]":
            ok = _is_int(v) or (isinstance(v, (list, tuple)) and all(_is_int(x) for x in v))
        else:
            continue
        if not ok:
            _fail(name, f"must be {kind}, got {v!r}")


def _field_kinds() -> dict[str, str]:
    """Field name -> its declared type, as written in ``Qwen4ExpTextConfig``'s own field annotations."""
    return {n: str(t) for n, t in Qwen4ExpTextConfig.__dict__["__annotations__"].items()}


def normalize_layer_types(layer_types: list[str] | None, num_hidden_layers: int, interval: int = 4) -> list[str]:
    """Official checkpoints write ``full_attention`` for the QSA layers; older ones ``qwen_sparse_attention``."""
    if layer_types is None:
        return [INDEXED if (i + 1) % interval == 0 else LINEAR for i in range(num_hidden_layers)]
    return [INDEXED if t in _INDEXED_ALIASES else LINEAR if t in _LINEAR_ALIASES else t for t in layer_types]


def _check_layer_types(layer_types: list[str], num_hidden_layers: int) -> None:
    if len(layer_types) != num_hidden_layers:
        _fail("layer_types", f"has {len(layer_types)} entries but num_hidden_layers is {num_hidden_layers}")
    bad = sorted(set(layer_types) - {LINEAR, INDEXED})
    if bad:
        _fail("layer_types", f"unsupported layer types {bad} (expected linear_attention / full_attention)")


def first_eos(eos_token_id: int | list[int] | None) -> int | None:
    if isinstance(eos_token_id, (list, tuple)):
        return int(eos_token_id[0]) if eos_token_id else None
    return None if eos_token_id is None else int(eos_token_id)


def standardize_rope(rope_parameters: dict | None, kwargs: dict) -> dict:
    """Accept ``rope_parameters`` (transformers >= 5) or the legacy top-level ``rope_theta`` /
    ``partial_rotary_factor`` / ``rope_scaling`` keys, and return one dict."""
    rp = dict(rope_parameters or {})
    legacy_scaling = kwargs.pop("rope_scaling", None)
    if legacy_scaling:
        for k, v in legacy_scaling.items():
            rp.setdefault(k, v)
        if "type" in rp and "rope_type" not in rp:
            rp["rope_type"] = rp.pop("type")
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in kwargs:
            rp.setdefault(key, kwargs.pop(key))
    rp.setdefault("rope_type", "default")
    rp.setdefault("rope_theta", 10000.0)
    rp.setdefault("partial_rotary_factor", 1.0)
    return rp


class Qwen4ExpTextConfig(PretrainedConfig):
    """The text model. Fields are declared typed, as transformers 5 declares config fields (the base class makes
    every config class a keyword-only dataclass); ``__post_init__`` checks each value against its declared type,
    normalises ``rope_parameters`` / ``layer_types`` / ``ple_*`` and ends with ``validate()``, which runs
    transformers' own validators and then ``validate_text_config``. Every error names the field."""

    model_type = "qwen4_exp_text"
    base_config_key = "text_config"
    keys_to_ignore_at_inference = ["past_key_values"]
    ignore_keys_at_rope_validation = {"mrope_section", "mrope_interleaved"}

    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    layer_types: list[str] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: list[int] | None = None
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    output_gate_type: str | None = None
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False

    def __post_init__(self, **kwargs: Any):
        check_field_types(self)
        interval = kwargs.pop("full_attention_interval", 4)
        if kwargs.get("mamba_ssm_dtype", 0) is None:  # set only when given (vLLM reads it as an optional attribute)
            kwargs.pop("mamba_ssm_dtype")
        self.rope_parameters = standardize_rope(self.rope_parameters, kwargs)
        self.layer_types = normalize_layer_types(self.layer_types, self.num_hidden_layers, interval)
        # Checked before the base class runs its own layer_types validation, which fails without naming our field.
        _check_layer_types(self.layer_types, self.num_hidden_layers)
        self.ple_layer_ids = sorted(set(self.ple_layer_ids or []))
        if self.ple_embed_dim is None:
            self.ple_embed_dim = self.hidden_size
        super().__post_init__(**kwargs)
        self.validate()

    def validate(self) -> None:
        """transformers' validators (``validate_*`` of the base class), then this model's invariants."""
        base = getattr(super(), "validate", None)
        if base is not None:
            base()
        validate_text_config(self)


def validate_text_config(c) -> None:
    """Check the invariants every runtime relies on. Works on any object with the text-config attributes."""
    check_field_types(c)
    _check_layer_types(c.layer_types, c.num_hidden_layers)
    for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "hc_lowrank", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if int(getattr(c, f)) <= 0:
            _fail(f, f"must be > 0, got {getattr(c, f)}")
    for f in ("max_position_embeddings", "linear_conv_kernel_dim"):
        if int(getattr(c, f)) <= 0:
            _fail(f, f"must be > 0, got {getattr(c, f)}")
    if not c.rms_norm_eps > 0:
        _fail("rms_norm_eps", f"must be > 0, got {c.rms_norm_eps}")
    gate = c.output_gate_type or c.hidden_act
    if gate not in ("sigmoid", "silu"):
        _fail("output_gate_type", f"must be 'sigmoid' or 'silu', got {gate!r}")
    if c.hc_count <= 1:
        _fail("hc_count", f"must be > 1, got {c.hc_count}")
    if c.num_experts <= 0:
        _fail("num_experts", f"must be > 0, got {c.num_experts}")
    if not 0 < c.num_experts_per_tok <= c.num_experts:
        _fail("num_experts_per_tok", f"must be in [1, num_experts={c.num_experts}], got {c.num_experts_per_tok}")
    if c.num_attention_heads % c.num_key_value_heads:
        _fail("num_key_value_heads", f"{c.num_key_value_heads} does not divide num_attention_heads "
              f"{c.num_attention_heads}")
    if c.linear_num_value_heads % c.linear_num_key_heads:
        _fail("linear_num_value_heads", f"{c.linear_num_value_heads} is not a multiple of linear_num_key_heads "
              f"{c.linear_num_key_heads}")
    rp = c.rope_parameters or {}
    rotary_dim = int(c.head_dim * rp.get("partial_rotary_factor", 1.0))
    if rotary_dim % 2:
        _fail("rope_parameters.partial_rotary_factor", f"gives an odd rotary dim {rotary_dim}")
    vals = {f: getattr(c, f, None) for f in _QSA_FIELDS}
    if any(v is not None for v in vals.values()):
        for f, v in vals.items():
            if v is None:
                _fail(f, "is required once any indexer_* field is set (QSA)")
            if int(v) <= 0:
                _fail(f, f"must be > 0, got {v}")
        if c.indexer_kv_heads != 1:
            _fail("indexer_kv_heads", f"QSA requires exactly 1 indexer key head, got {c.indexer_kv_heads}")
        if c.indexer_budget % c.indexer_compress_ratio:
            _fail("indexer_budget", f"{c.indexer_budget} is not divisible by indexer_compress_ratio "
                  f"{c.indexer_compress_ratio}")
        if rotary_dim > c.indexer_head_dim:
            _fail("indexer_head_dim", f"{c.indexer_head_dim} is smaller than the rotary dim {rotary_dim}")
    if c.ple_layer_ids:
        g = (c.ngram_size - 1) * c.heads_per_ngram
        if c.ngram_size < 2 or g <= 0:
            _fail("ngram_size", f"PLE needs ngram_size >= 2 and heads_per_ngram >= 1, got {c.ngram_size}, "
                  f"{c.heads_per_ngram}")
        if c.ple_embed_dim <= 0 or c.ple_embed_dim % g:
            _fail("ple_embed_dim", f"{c.ple_embed_dim} must be a positive multiple of the {g} n-gram heads")
        for lid in c.ple_layer_ids:
            if not 1 <= lid <= c.num_hidden_layers:
                _fail("ple_layer_ids", f"ids are one-indexed in [1, {c.num_hidden_layers}], got {lid}")
            if c.layer_types[lid - 1] != LINEAR:
                _fail("ple_layer_ids", f"PLE layer {lid} must be a linear_attention layer")
        if first_eos(c.eos_token_id) is None:
            _fail("eos_token_id", "must be set when PLE layers are enabled (PLE resets its n-gram context at EOS)")
        if c.split_ngram_parts <= 0:
            _fail("split_ngram_parts", f"must be > 0, got {c.split_ngram_parts}")


class Qwen4ExpVisionConfig(PretrainedConfig):
    model_type = "qwen4_exp_vision"
    base_config_key = "vision_config"
    attribute_map = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    initializer_range: float = 0.02
    rope_parameters: dict | None = None

    def __post_init__(self, **kwargs: Any):
        super().__post_init__(**kwargs)
        self.validate()

    def validate(self) -> None:
        base = getattr(super(), "validate", None)
        if base is not None:
            base()
        if self.hidden_size % self.num_heads:
            _fail("vision_config.num_heads", f"{self.num_heads} does not divide hidden_size {self.hidden_size}")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            _fail("vision_config.num_position_embeddings", f"{self.num_position_embeddings} is not a square grid")


class Qwen4ExpConfig(PretrainedConfig):
    model_type = "qwen4_exp"
    sub_configs = {"text_config": Qwen4ExpTextConfig, "vision_config": Qwen4ExpVisionConfig}
    keys_to_ignore_at_inference = ["past_key_values"]

    text_config: dict | Qwen4ExpTextConfig | None = None
    vision_config: dict | Qwen4ExpVisionConfig | None = None
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs: Any):
        self.vision_config = _sub_config(self.vision_config, Qwen4ExpVisionConfig)
        self.text_config = _sub_config(self.text_config, Qwen4ExpTextConfig)
        super().__post_init__(**kwargs)
        base = getattr(super(), "validate", None)
        if base is not None:
            base()

    def get_text_config(self, *args, **kwargs):
        return self.text_config


def _sub_config(value, cls):
    """A sub-config field's value (a dict from config.json, None, ours, or another library's config object) -> ours.
    Its ``model_type`` is dropped (older checkpoints wrote ``qwen4_exp`` in ``vision_config``)."""
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    d = dict(value) if isinstance(value, dict) else _plain_dict(value)
    d.pop("model_type", None)
    return cls(**d)


def _plain_dict(cfg) -> dict:
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    d.pop("model_type", None)
    d.pop("transformers_version", None)
    return d


def text_config_of(config) -> Any:
    """The text sub-config of a composite config, or the config itself."""
    return getattr(config, "text_config", None) or config


def load_config(path_or_dict) -> Qwen4ExpConfig | Qwen4ExpTextConfig:
    """Read an official ``config.json`` (file, directory or dict) into our classes."""
    import json
    import os

    if isinstance(path_or_dict, dict):
        d = dict(path_or_dict)
    else:
        p = str(path_or_dict)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        try:
            with open(p, encoding="utf-8") as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{p}: must hold a JSON object, got {type(d).__name__}")
        try:
            return _config_from_dict(d, required=True)
        except ConfigError as e:
            raise ConfigError(f"{p}: {e}") from None
    return _config_from_dict(d)


def _config_from_dict(d: dict, required: bool = False):
    """``required``: a checkpoint's config.json, which must set ``REQUIRED_TEXT_FIELDS`` (no defaults)."""
    mt = d.pop("model_type", "qwen4_exp")
    if mt not in ("qwen4_exp", "qwen4_exp_text"):
        _fail("model_type", f"expected 'qwen4_exp' or 'qwen4_exp_text', got {mt!r}")
    text = d if mt == "qwen4_exp_text" else d.get("text_config")
    if required:
        if not isinstance(text, dict):
            _fail("text_config", f"must be a JSON object, got {'nothing' if text is None else repr(text)}")
        for f in REQUIRED_TEXT_FIELDS:
            if f not in text:
                _fail(f if mt == "qwen4_exp_text" else f"text_config.{f}", "is required in a checkpoint's config.json")
    if isinstance(text, dict):
        check_field_types(text)
    return Qwen4ExpConfig(**d) if mt == "qwen4_exp" else Qwen4ExpTextConfig(**d)
