"""Config classes and presets: the real Qwen3.8-Flash-Next values, reading official-style ``config.json`` files,
save/load round trips, validation errors that name the field, and interoperability with upstream transformers'
own ``qwen4_exp`` config classes (which importing qwen4exp must leave registered)."""

from __future__ import annotations

import copy
import json

import pytest

from qwen4exp import ConfigError, Qwen4ExpConfig, Qwen4ExpTextConfig, Qwen4ExpVisionConfig, load_config, presets
from qwen4exp.configuration import INDEXED, LINEAR, first_eos, text_config_of

from upstream import UC  # upstream's config classes: a missing module fails loudly (tests/upstream.py)

QSA_LAYERS_48 = list(range(3, 48, 4))


# ---------------------------------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------------------------------
def test_flash_next_values():
    c = presets.flash_next()
    assert isinstance(c, Qwen4ExpConfig)
    t = c.text_config
    assert isinstance(t, Qwen4ExpTextConfig)
    assert (t.vocab_size, t.hidden_size, t.num_hidden_layers) == (248320, 2560, 48)
    assert [i for i, x in enumerate(t.layer_types) if x == INDEXED] == QSA_LAYERS_48 == [3, 7, 11, 15, 19, 23, 27,
                                                                                         31, 35, 39, 43, 47]
    assert t.layer_types.count(LINEAR) == 36
    assert (t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (24, 2, 256)
    assert (t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim) == \
        (16, 48, 128, 128)
    assert t.linear_conv_kernel_dim == 4
    assert (t.num_experts, t.num_experts_per_tok, t.norm_topk_prob) == (512, 10, True)
    assert (t.moe_intermediate_size, t.shared_expert_intermediate_size) == (640, 640)
    assert (t.hc_count, t.hc_lowrank) == (4, 320)
    assert t.ple_layer_ids == [2] and t.layer_types[1] == LINEAR  # one-indexed: 0-based layer 1, a GDN layer
    assert (t.ple_embed_dim, t.ple_conv_kernel_size, t.ngram_size, t.heads_per_ngram) == (2560, 4, 3, 8)
    assert (t.ngram_vocab_size_base, t.make_ngram_vocab_size_divisible_by, t.seed) == (20_000_000, 128, 1234)
    assert t.split_ngram_parts == 128
    assert (t.indexer_n_heads, t.indexer_kv_heads, t.indexer_head_dim, t.indexer_budget,
            t.indexer_compress_ratio) == (4, 1, 128, 2048, 4)
    rp = t.rope_parameters
    assert rp["rope_theta"] == 1e7 and rp["partial_rotary_factor"] == 0.25 and rp["rope_type"] == "default"
    assert rp["mrope_section"] == [11, 11, 10] and rp["mrope_interleaved"] is True
    assert int(t.head_dim * rp["partial_rotary_factor"]) == 64
    assert t.output_gate_type == "sigmoid"
    assert first_eos(t.eos_token_id) == 248044 and t.bos_token_id == 248044
    assert t.mtp_num_hidden_layers == 1 and t.mtp_use_dedicated_embeddings is False
    assert t.mamba_ssm_dtype == "float32"
    assert (t.max_position_embeddings, t.rms_norm_eps, t.tie_word_embeddings) == (262144, 1e-6, False)
    v = c.vision_config
    assert isinstance(v, Qwen4ExpVisionConfig)
    assert v.out_hidden_size == 2560 == t.hidden_size
    assert (v.depth, v.hidden_size, v.num_heads, v.patch_size, v.temporal_patch_size, v.spatial_merge_size) == \
        (27, 1152, 16, 16, 2, 2)
    assert (c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id) == \
        (248056, 248057, 248053, 248054)
    assert c.get_text_config() is t and text_config_of(c) is t and text_config_of(t) is t


def test_fn12l_and_tiny_presets():
    f = presets.fn12l()
    assert isinstance(f, Qwen4ExpTextConfig)
    assert f.num_hidden_layers == 12 and [i for i, x in enumerate(f.layer_types) if x == INDEXED] == [3, 7, 11]
    assert f.hidden_size == 2560 and f.ngram_vocab_size_base == 2_000_000 and f.ple_layer_ids == [2]
    t = presets.tiny_text()
    assert t.layer_types == [LINEAR, INDEXED, LINEAR, INDEXED]
    assert t.ple_layer_ids == [1] and t.indexer_budget % t.indexer_compress_ratio == 0
    c = presets.tiny()
    assert isinstance(c, Qwen4ExpConfig) and c.vision_config.out_hidden_size == c.text_config.hidden_size
    big = presets.tiny_text(num_hidden_layers=4, hidden_size=256, indexer_budget=256, full_attention_every=4)
    assert big.layer_types == [LINEAR, LINEAR, LINEAR, INDEXED] and big.indexer_budget == 256


# ---------------------------------------------------------------------------------------------------------------------
# official-style config.json
# ---------------------------------------------------------------------------------------------------------------------
def official_config_dict(eos=248044) -> dict:
    """A config.json as the official release writes it: "full_attention" layer types, legacy top-level
    rope_theta / partial_rotary_factor with the M-RoPE keys in rope_scaling, extra keys vLLM reads."""
    text = {
        "model_type": "qwen4_exp_text",
        "vocab_size": 248320, "hidden_size": 2560, "num_hidden_layers": 48, "num_attention_heads": 24,
        "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu", "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        "rope_scaling": {"rope_type": "default", "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "moe_intermediate_size": 640,
        "shared_expert_intermediate_size": 640, "num_experts": 512, "num_experts_per_tok": 10,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)],
        "hc_count": 4, "hc_lowrank": 320, "ple_layer_ids": [2], "ple_embed_dim": 2560, "split_ngram_parts": 128,
        "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048,
        "indexer_compress_ratio": 4, "output_gate_type": "sigmoid", "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "eos_token_id": eos, "bos_token_id": 248044, "dtype": "bfloat16",
    }
    vision = {"model_type": "qwen4_exp", "depth": 27, "hidden_size": 1152, "num_heads": 16,
              "intermediate_size": 4304, "out_hidden_size": 2560}  # legacy vision model_type
    return {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
            "text_config": text, "vision_config": vision, "image_token_id": 248056, "video_token_id": 248057,
            "vision_start_token_id": 248053, "vision_end_token_id": 248054, "tie_word_embeddings": False}


def _same_architecture(a, b):
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
            "num_experts_per_tok", "layer_types", "hc_count", "hc_lowrank", "ple_layer_ids", "ple_embed_dim",
            "split_ngram_parts", "indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
            "indexer_compress_ratio", "output_gate_type", "ngram_size", "heads_per_ngram", "seed",
            "ngram_vocab_size_base", "make_ngram_vocab_size_divisible_by")
    for k in keys:
        assert getattr(a, k) == getattr(b, k), k
    for k in ("rope_theta", "partial_rotary_factor", "mrope_section"):
        assert a.rope_parameters[k] == b.rope_parameters[k], k
    assert first_eos(a.eos_token_id) == first_eos(b.eos_token_id)


@pytest.mark.parametrize("eos", [248044, [248044, 248046]])
@pytest.mark.parametrize("source", ["dir", "file", "dict"])
def test_load_official_config(tmp_path, eos, source):
    d = official_config_dict(eos)
    (tmp_path / "config.json").write_text(json.dumps(d))
    arg = {"dir": tmp_path, "file": tmp_path / "config.json", "dict": copy.deepcopy(d)}[source]
    c = load_config(arg)
    assert isinstance(c, Qwen4ExpConfig)
    t = c.text_config
    assert [i for i, x in enumerate(t.layer_types) if x == INDEXED] == QSA_LAYERS_48
    assert set(t.layer_types) == {LINEAR, INDEXED}
    assert t.eos_token_id == eos and first_eos(t.eos_token_id) == 248044
    assert t.mamba_ssm_dtype == "float32" and t.split_ngram_parts == 128
    assert t.rope_parameters["rope_theta"] == 1e7 and t.rope_parameters["partial_rotary_factor"] == 0.25
    assert t.rope_parameters["mrope_section"] == [11, 11, 10] and t.rope_parameters["mrope_interleaved"] is True
    assert c.vision_config.model_type == "qwen4_exp_vision" and c.vision_config.out_hidden_size == 2560
    _same_architecture(t, presets.flash_next().text_config)
    if source == "dict":
        assert arg == d  # the caller's dict is not consumed


def test_load_config_text_only_and_defaults(tmp_path):
    d = official_config_dict()["text_config"]
    d.pop("rope_theta"), d.pop("rope_scaling"), d.pop("layer_types")
    d["full_attention_interval"] = 4  # no layer_types: derived from the interval
    t = load_config(d)
    assert isinstance(t, Qwen4ExpTextConfig)
    assert [i for i, x in enumerate(t.layer_types) if x == INDEXED] == QSA_LAYERS_48
    assert t.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    assert not hasattr(t, "full_attention_interval")
    # older name of the QSA layers
    d2 = official_config_dict()["text_config"]
    d2["layer_types"] = ["qwen_sparse_attention" if x == "full_attention" else x for x in d2["layer_types"]]
    assert [i for i, x in enumerate(load_config(d2).layer_types) if x == INDEXED] == QSA_LAYERS_48
    with pytest.raises(ConfigError, match="model_type"):
        load_config({"model_type": "llama", "hidden_size": 8})


def test_rope_parameters_take_precedence_over_legacy_keys():
    t = presets.tiny_text(rope_theta=5.0)  # tiny_text passes rope_parameters with theta 10000
    assert t.rope_parameters["rope_theta"] == 10000.0
    t2 = presets.tiny_text(rope_parameters=None, rope_theta=5.0, partial_rotary_factor=0.5)
    assert t2.rope_parameters["rope_theta"] == 5.0 and t2.rope_parameters["partial_rotary_factor"] == 0.5


# ---------------------------------------------------------------------------------------------------------------------
# save / load round trips
# ---------------------------------------------------------------------------------------------------------------------
def _plain(cfg) -> dict:
    d = cfg.to_dict()
    d.pop("transformers_version", None)
    return d


def test_composite_round_trip(tmp_path):
    c = presets.flash_next()
    c.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "qwen4_exp" and saved["text_config"]["model_type"] == "qwen4_exp_text"
    assert saved["vision_config"]["model_type"] == "qwen4_exp_vision"
    assert saved["text_config"]["mamba_ssm_dtype"] == "float32"
    assert saved["text_config"]["split_ngram_parts"] == 128
    for back in (Qwen4ExpConfig.from_pretrained(tmp_path), load_config(tmp_path)):
        assert isinstance(back, Qwen4ExpConfig) and isinstance(back.text_config, Qwen4ExpTextConfig)
        assert _plain(back) == _plain(c)
    # the text sub-config can be read on its own from the composite file
    t = Qwen4ExpTextConfig.from_pretrained(tmp_path)
    assert isinstance(t, Qwen4ExpTextConfig)
    _same_architecture(t, c.text_config)


def test_text_round_trip(tmp_path):
    t = presets.tiny_text(eos_token_id=3)
    t.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen4_exp_text"
    for back in (Qwen4ExpTextConfig.from_pretrained(tmp_path), load_config(tmp_path)):
        assert isinstance(back, Qwen4ExpTextConfig) and _plain(back) == _plain(t)
    # a config without the optional mamba_ssm_dtype does not grow one on the way
    assert not hasattr(Qwen4ExpTextConfig.from_pretrained(tmp_path), "mamba_ssm_dtype")


# ---------------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------------
def fn12l_kwargs(**over) -> dict:
    d = presets.fn12l().to_dict()
    for k in ("model_type", "transformers_version"):
        d.pop(k, None)
    d.update(over)
    return d


BAD = [  # overrides, field named in the error
    (dict(hc_count=1), "hc_count"),
    (dict(ple_layer_ids=[4]), "ple_layer_ids"),  # 0-based layer 3 is a QSA layer
    (dict(ple_layer_ids=[0]), "ple_layer_ids"),
    (dict(ple_layer_ids=[2, 13]), "ple_layer_ids"),
    (dict(eos_token_id=None, bos_token_id=None), "eos_token_id"),
    (dict(eos_token_id=[]), "eos_token_id"),
    (dict(indexer_budget=2050), "indexer_budget"),
    (dict(indexer_head_dim=None), "indexer_head_dim"),
    (dict(indexer_kv_heads=None, indexer_head_dim=None, indexer_budget=None, indexer_compress_ratio=None),
     "indexer_kv_heads"),  # only indexer_n_heads set
    (dict(indexer_budget=0), "indexer_budget"),
    (dict(indexer_kv_heads=2), "indexer_kv_heads"),
    (dict(indexer_head_dim=32), "indexer_head_dim"),  # smaller than the 64 rotary dims
    (dict(output_gate_type="relu"), "output_gate_type"),
    (dict(output_gate_type=None, hidden_act="gelu"), "output_gate_type"),
    (dict(layer_types=[LINEAR] * 11), "layer_types"),
    (dict(layer_types=["full_attention", "sliding_attention"] * 6), "layer_types"),
    (dict(ple_embed_dim=2561), "ple_embed_dim"),
    (dict(num_experts_per_tok=513), "num_experts_per_tok"),
    (dict(num_experts=0), "num_experts"),
    (dict(linear_num_value_heads=40), "linear_num_value_heads"),
]


@pytest.mark.parametrize("over,field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_validation_error_names_field(over, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        Qwen4ExpTextConfig(**fn12l_kwargs(**over))


def test_config_error_is_value_error_and_composite_validates():
    assert issubclass(ConfigError, ValueError)
    d = official_config_dict()
    d["text_config"]["hc_count"] = 1
    with pytest.raises(ConfigError, match="`hc_count`"):
        load_config(d)


def test_valid_variants():
    # no PLE: eos may be missing; no QSA fields at all is accepted by the config (vLLM falls back to dense)
    t = Qwen4ExpTextConfig(**fn12l_kwargs(ple_layer_ids=[], eos_token_id=None, bos_token_id=None))
    assert t.ple_layer_ids == []
    q = Qwen4ExpTextConfig(**fn12l_kwargs(indexer_n_heads=None, indexer_kv_heads=None, indexer_head_dim=None,
                                          indexer_budget=None, indexer_compress_ratio=None))
    assert q.indexer_budget is None
    # ple_layer_ids are de-duplicated and sorted; "mamba" is the legacy name of linear layers
    p = Qwen4ExpTextConfig(**fn12l_kwargs(ple_layer_ids=[6, 2, 2]))
    assert p.ple_layer_ids == [2, 6]
    m = Qwen4ExpTextConfig(**fn12l_kwargs(layer_types=["mamba", "mamba", "mamba", "full_attention"] * 3))
    assert m.layer_types == [LINEAR, LINEAR, LINEAR, INDEXED] * 3
    # ple_embed_dim defaults to hidden_size
    assert Qwen4ExpTextConfig(**fn12l_kwargs(ple_embed_dim=None)).ple_embed_dim == 2560


# ---------------------------------------------------------------------------------------------------------------------
# upstream transformers interoperability
# ---------------------------------------------------------------------------------------------------------------------
def test_upstream_reads_our_config(tmp_path):
    c = presets.flash_next()
    c.save_pretrained(tmp_path)
    u = UC.Qwen4ExpConfig.from_pretrained(tmp_path)
    assert isinstance(u.text_config, UC.Qwen4ExpTextConfig)
    _same_architecture(u.text_config, c.text_config)
    assert u.vision_config.out_hidden_size == 2560
    assert u.image_token_id == c.image_token_id
    t = presets.tiny_text()
    t.save_pretrained(tmp_path / "text")
    ut = UC.Qwen4ExpTextConfig.from_pretrained(tmp_path / "text")
    _same_architecture(ut, t)


def test_we_read_upstream_config(tmp_path):
    d = official_config_dict([248044, 248046])
    u = UC.Qwen4ExpConfig(text_config=d["text_config"], vision_config=d["vision_config"])
    u.save_pretrained(tmp_path)
    c = load_config(tmp_path)
    assert isinstance(c, Qwen4ExpConfig)
    _same_architecture(c.text_config, presets.flash_next().text_config)
    assert c.text_config.eos_token_id == [248044, 248046]
    assert c.vision_config.out_hidden_size == 2560
    assert Qwen4ExpConfig.from_pretrained(tmp_path).text_config.layer_types == c.text_config.layer_types
    # an upstream text-only config
    ut = UC.Qwen4ExpTextConfig(**{k: v for k, v in d["text_config"].items() if k != "model_type"})
    ut.save_pretrained(tmp_path / "text")
    t = load_config(tmp_path / "text")
    assert isinstance(t, Qwen4ExpTextConfig)
    _same_architecture(t, presets.flash_next().text_config)
    # an upstream config object handed over directly (as vLLM does)
    c2 = Qwen4ExpConfig(text_config=u.text_config, vision_config=u.vision_config)
    _same_architecture(c2.text_config, c.text_config)


def test_import_keeps_upstream_autoconfig(tmp_path):
    import qwen4exp.hf  # noqa: F401  (the runtimes too must not register anything with transformers)
    import qwen4exp.vllm  # noqa: F401
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert qwen4exp.Qwen4ExpForCausalLM is not None
    assert CONFIG_MAPPING["qwen4_exp"] is UC.Qwen4ExpConfig
    assert CONFIG_MAPPING["qwen4_exp_text"] is UC.Qwen4ExpTextConfig
    assert type(AutoConfig.for_model("qwen4_exp")) is UC.Qwen4ExpConfig
    presets.tiny().save_pretrained(tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)) is UC.Qwen4ExpConfig
