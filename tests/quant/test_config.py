"""ModelOpt config parsing (both forms) and module matching, checked against vLLM's own ModelOpt config classes."""

import ast
import json
import os
import re

import pytest

from qwen4exp.presets import anchor_nvfp4_quantization_config
from qwen4exp.quant import QuantConfigError, load_quant_config, parse_quant_config
from qwen4exp.quant.config import PACKED_MODULES, PREFIX_RENAMES, layout_patterns

# what upstream's full-depth NVFP4 run read
ANCHOR = anchor_nvfp4_quantization_config()
LEGACY = {"producer": {"name": "modelopt", "version": "0.29.0"},
          "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                           "exclude_modules": ["lm_head", "*self_attn*", "model.language_model.layers.0.mlp*"]}}

# our HF classes' module names (composite Qwen4ExpForConditionalGeneration, one GDN + one QSA layer, PLE on layer 0)
HF_NAMES = [
    "model.visual.blocks.0.attn.qkv", "model.visual.blocks.0.attn.proj", "model.visual.blocks.0.mlp.linear_fc1",
    "model.visual.merger.linear_fc2", "model.language_model.embed_tokens",
    "model.language_model.layers.0.linear_attn.in_proj_qkv", "model.language_model.layers.0.linear_attn.in_proj_z",
    "model.language_model.layers.0.linear_attn.in_proj_b", "model.language_model.layers.0.linear_attn.out_proj",
    "model.language_model.layers.0.mlp.gate", "model.language_model.layers.0.mlp.experts",
    "model.language_model.layers.0.mlp.shared_expert.gate_proj",
    "model.language_model.layers.0.mlp.shared_expert.down_proj",
    "model.language_model.layers.0.mlp.shared_expert_gate",
    "model.language_model.layers.0.ple.key_proj", "model.language_model.layers.0.ple.value_proj",
    "model.language_model.layers.0.ple.ple_embedding.ngram_embedding",
    "model.language_model.layers.0.attn_hyper_connection.input_mix_weight_down",
    "model.language_model.layers.0.attn_hyper_connection.block_inject_weight",
    "model.language_model.layers.0.mlp_hyper_connection.input_mix_weight_up",
    "model.language_model.layers.1.self_attn.q_proj", "model.language_model.layers.1.self_attn.o_proj",
    "model.language_model.layers.1.self_attn.indexer.index_qk_proj", "model.language_model.layers.1.mlp.experts",
    "model.language_model.hyper_connection_mixer.input_mix_weight_down", "lm_head",
    "mtp.fc_embedding", "mtp.fc_hidden", "mtp.layers.0.self_attn.q_proj",
    "mtp.layers.0.self_attn.indexer.index_qk_proj", "mtp.layers.0.mlp.gate", "mtp.layers.0.mlp.experts",
    "mtp.layers.0.mlp.shared_expert.up_proj", "mtp.layers.0.mlp.shared_expert_gate",
    "mtp.layers.0.attn_hyper_connection.input_mix_weight_up", "mtp.hyper_connection_mixer.input_mix_weight_down",
]
# the in-tree vLLM model's module prefixes for the text part (fused as its packed_modules_mapping fuses them)
_TEXT = [
    "embed_tokens", "layers.0.linear_attn.in_proj_qkvz", "layers.0.linear_attn.in_proj_ba",
    "layers.0.linear_attn.out_proj", "layers.0.mlp.gate", "layers.0.mlp.experts",
    "layers.0.mlp.shared_expert.gate_up_proj", "layers.0.mlp.shared_expert.down_proj",
    "layers.0.mlp.shared_expert_gate", "layers.0.ple.kv_proj", "layers.0.ple.ple_embedding.ngram_embedding",
    "layers.0.attn_hyper_connection.input_mix_weight_down_block_inject",
    "layers.0.mlp_hyper_connection.input_mix_weight_up", "layers.1.self_attn.qkv_proj", "layers.1.self_attn.o_proj",
    "layers.1.mlp.experts", "layers.3.mlp.experts", "hyper_connection_mixer.input_mix_weight_down",
]
VLLM_NAMES = {
    "vllm_text": ["model." + n for n in _TEXT] + ["lm_head"],
    "vllm_composite": ["language_model.model." + n for n in _TEXT] + [
        "language_model.lm_head", "visual.blocks.0.attn.qkv", "visual.blocks.0.attn.proj",
        "visual.blocks.0.mlp.linear_fc1", "visual.merger.linear_fc2"],
}
MTP_NAMES = [  # the draft's prefixes for num_hidden_layers = 4 (nvidia/mtp.py: layers.{N + i})
    "mtp.fc_embedding", "mtp.fc_hidden", "mtp.layers.4.self_attn.qkv_proj", "mtp.layers.4.self_attn.o_proj",
    "mtp.layers.4.self_attn.indexer.index_qk_proj", "mtp.layers.4.mlp.gate", "mtp.layers.4.mlp.experts",
    "mtp.layers.4.mlp.shared_expert.gate_up_proj", "mtp.layers.4.mlp.shared_expert_gate",
    "mtp.layers.4.attn_hyper_connection.input_mix_weight_down_block_inject", "lm_head",
]
# exercises every branch of vLLM's matching: legacy substring, trailing-* split, explicit prefixes, experts rule
TRICKY = ["lm_head", "model.language_model.layers.0.mlp.shared_expert*", "layers.1.self_attn", "*visual*",
          "model.language_model.layers.3.mlp.experts*", "mtp.layers.0*", "model.visual.merger*",
          "model.language_model.layers.0.linear_attn.in_proj_qkv",
          "model.language_model.layers.0.linear_attn.in_proj_z",
          "*ple.kv_proj", "model.language_model.layers.1.mlp.experts.0.gate_proj"]


def _vllm_config(oracle, cfg, layout):
    vc = (oracle.ModelOptMixedPrecisionConfig if cfg.get("quant_algo") == "MIXED_PRECISION"
          else oracle.ModelOptNvFp4Config).from_config(json.loads(json.dumps(cfg)))
    # configure_quant_config (model_loader/utils.py:373-381): the rename part of hf_to_vllm_mapper, then the packing
    vc.apply_vllm_mapper(oracle.WeightsMapper(orig_to_new_prefix=dict(PREFIX_RENAMES[layout])).get_rename_mapper())
    vc.packed_modules_mapping = PACKED_MODULES[layout]
    return vc


def test_anchor_parses():
    c = parse_quant_config(ANCHOR)
    assert c.quant_algo == "NVFP4" and c.group_size == 16 and not c.weight_only and not c.is_mixed
    assert c.exclude_modules == tuple(ANCHOR["ignore"]) and c.kv_cache_quant_algo is None
    assert c.producer == "modelopt 0.39.0" and c.source == "config.json"
    assert parse_quant_config({**ANCHOR, "quant_algo": "nvfp4"}).quant_algo == "NVFP4"  # vLLM upper-cases
    kv = parse_quant_config({**ANCHOR, "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}})
    assert kv.kv_cache_quant_algo == "FP8"
    assert parse_quant_config({**ANCHOR, "kv_cache_scheme": "NVFP4"}).kv_cache_quant_algo is None  # vLLM ignores it


def test_weight_only_forms(vllm_oracle):
    no_act = {**ANCHOR, "config_groups": {"group_0": {"weights": ANCHOR["config_groups"]["group_0"]["weights"],
                                                      "input_activations": None, "targets": ["Linear"]}}}
    assert parse_quant_config(no_act).quant_algo == "W4A16_NVFP4"
    assert vllm_oracle.ModelOptNvFp4Config.from_config(json.loads(json.dumps(no_act))).quant_method == "W4A16_NVFP4"
    c = parse_quant_config({"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "ignore": []})
    assert c.weight_only and c.group_size == 16


def test_legacy_form_and_lookup_order(tmp_path):
    c = parse_quant_config(LEGACY, source="hf_quant_config.json")
    assert c.quant_algo == "NVFP4" and c.exclude_modules == tuple(LEGACY["quantization"]["exclude_modules"])
    assert c.source == "hf_quant_config.json" and c.kv_cache_quant_algo is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen4_exp"}))
    assert load_quant_config(tmp_path) is None
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(LEGACY))
    assert load_quant_config(tmp_path).source == "hf_quant_config.json"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen4_exp", "quantization_config": ANCHOR}))
    assert load_quant_config(tmp_path).source == "config.json"  # config.json wins, as in vLLM
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"quantization_config": ANCHOR}}))
    assert load_quant_config(tmp_path).exclude_modules == tuple(ANCHOR["ignore"])


def _legacy(**q):
    return {"producer": {"name": "modelopt"}, "quantization": {**LEGACY["quantization"], **q}}


@pytest.mark.parametrize("cfg,msg", [
    ({**ANCHOR, "quant_algo": "INT4_AWQ"}, r"quantization_config\.quant_algo: unsupported quant_algo 'INT4_AWQ'"),
    ({**ANCHOR, "quant_algo": "MXFP8"}, r"quantization_config\.quant_algo: unsupported"),
    ({**ANCHOR, "quant_algo": "FP8_BLOCK_SCALES"}, r"quant_algo: unsupported"),  # the alias is per layer only
    ({k: v for k, v in ANCHOR.items() if k != "quant_algo"}, r"quantization_config\.quant_algo is missing"),
    ({**ANCHOR, "quant_algo": 4}, r"quantization_config\.quant_algo must be a string"),
    ({**ANCHOR, "quant_method": "awq"}, r"quantization_config\.quant_method must name ModelOpt"),
    ({**ANCHOR, "group_size": 32}, r"quantization_config\.group_size: NVFP4 is served with group size 16 only"),
    ({**ANCHOR, "group_size": "abc"}, r"quantization_config\.group_size must be an integer"),
    ({**ANCHOR, "group_size": True}, r"quantization_config\.group_size must be an integer"),
    ({**ANCHOR, "config_groups": {"group_0": {"weights": {"group_size": 32}, "input_activations": {}}}},
     r"config_groups\.group_0\.weights\.group_size: NVFP4 is served with group size 16 only"),
    ({**ANCHOR, "ignore": "lm_head"}, r"quantization_config\.ignore must be a list of strings"),
    ({**ANCHOR, "ignore": ["lm_head", 3]}, r"quantization_config\.ignore must be a list of strings"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, r"quantization_config\.quantized_layers: "
                                                                    r"MIXED_PRECISION needs a non-empty mapping"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
      "quantized_layers": {"a.b": {"quant_algo": "W8A16"}}},
     r"quantized_layers\.a\.b\.quant_algo: unsupported quant_algo 'W8A16'"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
      "quantized_layers": {"a.b": {"quant_algo": "NVFP4", "group_size": 32}}}, r"quantized_layers\.a\.b\.group_size"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
      "quantized_layers": {"a.b": {"quant_algo": "FP8_PB_WO", "group_size": 64}}}, r"a\.b\.group_size: block FP8"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {"a.b": "NVFP4"}},
     r"quantized_layers\.a\.b must be a JSON object"),
    (_legacy(kv_cache_quant_algo=8), r"quantization\.kv_cache_quant_algo must be a string or null"),
    (_legacy(group_size=64), r"quantization\.group_size: NVFP4 is served with group size 16 only"),
    (_legacy(exclude_modules={"lm_head": 1}), r"quantization\.exclude_modules must be a list of strings"),
    (_legacy(quant_algo="W4A16_NVFP4"), r"quantization\.quant_algo: 'W4A16_NVFP4' is not read by vLLM 0\.32 in the "
                                        r"legacy"),
    ({"quantization": LEGACY["quantization"]}, r"producer\.name must be 'modelopt'"),
    ({"producer": {"name": "modelopt"}, "quantization": ["NVFP4"]}, r"quantization must be a JSON object"),
    ("NVFP4", r"quantization config must be a JSON object"),
])
def test_bad_configs_name_the_field(cfg, msg):
    with pytest.raises(QuantConfigError, match=msg):
        parse_quant_config(cfg)


@pytest.mark.parametrize("field", ["group_size", "kv_cache_quant_algo", "exclude_modules"])
def test_legacy_nvfp4_required_fields(field, vllm_oracle):
    q = {k: v for k, v in LEGACY["quantization"].items() if k != field}
    cfg = {"producer": {"name": "modelopt"}, "quantization": q}
    with pytest.raises(QuantConfigError, match=rf"quantization: NVFP4 needs the field\(s\) {field}"):
        parse_quant_config(cfg, source="hf_quant_config.json")
    with pytest.raises(ValueError, match=field):  # vLLM refuses it too
        vllm_oracle.ModelOptNvFp4Config.from_config(cfg)


def test_legacy_without_producer_but_explicit_quant_method():
    c = parse_quant_config({"quant_method": "modelopt", "quantization": {**LEGACY["quantization"],
                                                                         "quant_algo": "W4A16_NVFP4"}})
    assert c.quant_algo == "W4A16_NVFP4"  # no producer: vLLM's normaliser does not restrict the algo


@pytest.mark.parametrize("layout", ["vllm_text", "vllm_composite"])
@pytest.mark.parametrize("ignore", [ANCHOR["ignore"], TRICKY], ids=["anchor", "tricky"])
def test_exclude_matching_equals_vllm(vllm_oracle, layout, ignore):
    cfg = {**ANCHOR, "ignore": ignore}
    ours, theirs = parse_quant_config(cfg), _vllm_config(vllm_oracle, cfg, layout)
    assert list(layout_patterns(ours.exclude_modules, layout)) == theirs.exclude_modules
    decided = {n: ours.is_excluded(n, layout) for n in VLLM_NAMES[layout]}
    assert decided == {n: theirs.is_layer_excluded(n) for n in VLLM_NAMES[layout]}
    assert any(decided.values()) and not all(decided.values())


@pytest.mark.parametrize("ignore", [ANCHOR["ignore"], TRICKY], ids=["anchor", "tricky"])
def test_mtp_draft_matching_equals_vllm(vllm_oracle, ignore):
    ours = parse_quant_config({**ANCHOR, "ignore": ignore})
    theirs = vllm_oracle.ModelOptNvFp4Config.from_config(json.loads(json.dumps({**ANCHOR, "ignore": ignore})))
    # the draft (nvidia/mtp.py:136-169): no mapper, MTP packing, mtp.layers.i -> mtp.layers.{N + i}
    theirs.packed_modules_mapping = PACKED_MODULES["vllm_mtp"]
    theirs.exclude_modules = [re.sub(r"(?<=\.layers\.)\d+", lambda m: str(4 + int(m.group(0))), n)
                              if n.startswith("mtp.") else n for n in theirs.exclude_modules]
    for n in MTP_NAMES:
        assert ours.is_excluded(n, "vllm_mtp", num_hidden_layers=4) == theirs.is_layer_excluded(n), n
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ours.is_excluded("mtp.fc_hidden", "vllm_mtp")


def _to_vllm(hf_name, layout):
    from qwen4exp.quant.config import rename_prefix
    return rename_prefix(hf_name, PREFIX_RENAMES[layout])


def test_hf_layout_agrees_with_vllm_on_the_anchor_list(vllm_oracle):
    c = parse_quant_config(ANCHOR)
    # text modules: the HF decision equals vLLM's for the same (unfused) module in both vLLM layouts
    for layout in ("vllm_text", "vllm_composite"):
        theirs = _vllm_config(vllm_oracle, ANCHOR, layout)
        for n in HF_NAMES:
            if n.startswith("mtp.") or (layout == "vllm_text" and n.startswith("model.visual.")):
                continue
            assert c.is_excluded(n) == theirs.is_layer_excluded(_to_vllm(n, layout)), (layout, n)


def test_anchor_ignore_list_quantizes_only_routed_experts_and_the_vision_tower():
    c = parse_quant_config(ANCHOR)
    quantized = sorted(n for n in HF_NAMES if c.layer_algo(n) is not None)
    # every text module but the routed experts stays BF16, mtp.* is excluded whole; the list has no entry for the
    # vision tower ("model.visual*"), and "visual" carries none of vLLM's always-BF16 vision markers, so the config
    # asks for NVFP4 there: a real export must list it (or vLLM's composite model quantizes the ViT)
    assert quantized == sorted(["model.language_model.layers.0.mlp.experts",
                                "model.language_model.layers.1.mlp.experts",
                                "model.visual.blocks.0.attn.qkv", "model.visual.blocks.0.attn.proj",
                                "model.visual.blocks.0.mlp.linear_fc1", "model.visual.merger.linear_fc2"])
    assert c.layer_algo("model.vision_tower.blocks.0.attn.qkv") is None  # vLLM's hard-coded vision names
    assert c.layer_algo("mtp.layers.0.mlp.experts", "vllm_mtp", num_hidden_layers=4) is None


MIXED = {
    "quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "producer": {"name": "modelopt", "version": "0.47.0"},
    "ignore": ["lm_head", "*self_attn*", "*linear_attn*", "*shared_expert*", "*mlp.gate", "*hyper_connection*"],
    "quantized_layers": {
        **{f"model.language_model.layers.{i}.mlp.experts.{e}.{p}": {"quant_algo": "NVFP4", "group_size": 16}
           for i in range(2) for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")},
        **{f"mtp.layers.0.mlp.experts.{e}.{p}": {"quant_algo": "fp8_pb_wo"}
           for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")},
        "model.language_model.layers.0.ple.ple_embedding.ngram_embedding": {"quant_algo": "FP8"},
    },
}


def test_mixed_precision_resolution_equals_vllm(vllm_oracle):
    c = parse_quant_config(MIXED)
    assert c.is_mixed and c.group_size == 16 and c.algos() == {"NVFP4", "FP8_PB_WO", "FP8"}
    assert dict(c.quantized_layers)["mtp.layers.0.mlp.experts.0.gate_proj"].group_size == 128
    for layout in ("vllm_text", "vllm_composite"):
        theirs = _vllm_config(vllm_oracle, MIXED, layout)
        for n in VLLM_NAMES[layout]:
            want = None if theirs.is_layer_excluded(n) else theirs._resolve_quant_algo(n)
            assert c.layer_algo(n, layout) == want, (layout, n)
    assert c.layer_algo("model.language_model.layers.1.mlp.experts") == "NVFP4"
    assert c.layer_algo("model.language_model.layers.0.ple.ple_embedding.ngram_embedding") == "FP8"
    assert c.layer_algo("mtp.layers.0.mlp.experts") == "FP8_PB_WO"
    assert c.layer_algo("mtp.layers.4.mlp.experts", "vllm_mtp", num_hidden_layers=4) == "FP8_PB_WO"
    assert c.layer_algo("model.language_model.layers.0.mlp.shared_expert.gate_proj") is None
    assert c.layer_algo("lm_head") is None


def test_mixed_fused_shards_must_agree():
    cfg = {**MIXED, "ignore": [], "quantized_layers": {
        "model.layers.0.linear_attn.in_proj_qkv": {"quant_algo": "NVFP4"},
        "model.layers.0.linear_attn.in_proj_z": {"quant_algo": "FP8"}}}
    with pytest.raises(QuantConfigError, match=r"in_proj_qkvz mix"):
        parse_quant_config(cfg).layer_algo("model.layers.0.linear_attn.in_proj_qkvz", "vllm_text")
    with pytest.raises(QuantConfigError, match=r"not all shards of model\.layers\.0\.linear_attn\.in_proj_qkvz"):
        parse_quant_config({**ANCHOR, "ignore": ["model.layers.0.linear_attn.in_proj_z"]}).is_excluded(
            "model.layers.0.linear_attn.in_proj_qkvz", "vllm_text")


def _vllm_source(*parts):
    import vllm
    return open(os.path.join(os.path.dirname(vllm.__file__), *parts)).read()


def _class_attr(source, cls, attr):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for stmt in node.body:
                targets = [stmt.target] if isinstance(stmt, ast.AnnAssign) else getattr(stmt, "targets", [])
                if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                    return stmt.value
    raise AssertionError(f"{cls}.{attr} not found")


def test_layout_tables_match_the_installed_vllm_source(vllm_oracle):
    model = _vllm_source("models", "qwen4_exp", "nvidia", "model.py")
    assert ast.literal_eval(_class_attr(model, "Qwen4ExpForCausalLM", "packed_modules_mapping")) \
        == PACKED_MODULES["vllm_text"]
    mapper = _class_attr(model, "Qwen4ExpForCausalLM", "hf_to_vllm_mapper")
    assert ast.literal_eval(mapper.keywords[0].value) == dict(PREFIX_RENAMES["vllm_text"])
    mtp = _vllm_source("models", "qwen4_exp", "nvidia", "mtp.py")
    assert ast.literal_eval(_class_attr(mtp, "Qwen4ExpMTP", "packed_modules_mapping")) == PACKED_MODULES["vllm_mtp"]
    assert "hf_to_vllm_mapper" not in ast.get_source_segment(
        mtp, next(n for n in ast.walk(ast.parse(mtp)) if isinstance(n, ast.ClassDef) and n.name == "Qwen4ExpMTP"))
    vl = _vllm_source("model_executor", "models", "qwen3_vl.py")
    vl_map = _class_attr(vl, "Qwen3VLForConditionalGeneration", "hf_to_vllm_mapper")
    assert list(ast.literal_eval(vl_map.keywords[0].value).items()) == list(PREFIX_RENAMES["vllm_composite"])
    vl_packed = ast.literal_eval(_class_attr(vl, "Qwen3VLForConditionalGeneration", "packed_modules_mapping"))
    q35 = ast.literal_eval(_class_attr(_vllm_source("model_executor", "models", "qwen3_5.py"),
                                       "Qwen3_5ForConditionalGeneration", "packed_modules_mapping").right)
    composite = _class_attr(model, "Qwen4ExpForConditionalGeneration", "packed_modules_mapping").right
    resolved = {**vl_packed, **q35}
    for k, v in zip(composite.keys, composite.values):
        # "qkv_proj" is Qwen4ExpForCausalLM's, by reference
        resolved[ast.literal_eval(k)] = (PACKED_MODULES["vllm_text"]["qkv_proj"] if isinstance(v, ast.Subscript)
                                         else ast.literal_eval(v))
    assert resolved == PACKED_MODULES["vllm_composite"]


@pytest.mark.parametrize("ignore", [ANCHOR["ignore"], TRICKY], ids=["anchor", "tricky"])
def test_hf_text_layout_matches_vllm_on_unfused_names(vllm_oracle, ignore):
    cfg = {**ANCHOR, "ignore": ignore}
    ours, theirs = parse_quant_config(cfg), _vllm_config(vllm_oracle, cfg, "vllm_text")
    theirs.packed_modules_mapping = {}  # our text-only HF modules are not fused
    names = [_to_vllm(n, "hf_text") for n in HF_NAMES if n.startswith("model.language_model.") or n == "lm_head"]
    assert all(n.startswith(("model.layers.", "model.embed", "model.hyper", "lm_head")) for n in names)
    assert {n: ours.is_excluded(n, "hf_text") for n in names} == {n: theirs.is_layer_excluded(n) for n in names}
    with pytest.raises(ValueError, match="unknown module-name layout"):
        ours.is_excluded("lm_head", "vllm")
