"""One source for per-sequence state shapes (the layers declare them; the HF cache allocates them), and the config's
validation hook (typed fields, ``validate()`` naming the field)."""

import dataclasses

import pytest
import torch

from qwen4exp import ConfigError, Qwen4ExpTextConfig, presets
from qwen4exp.configuration import LINEAR
from qwen4exp.hf.cache import Qwen4ExpHybridCache
from qwen4exp.layers.gdn import GatedDeltaNet
from qwen4exp.layers.ple import PLE
from qwen4exp.modeling import ple_index_of


def test_hf_cache_allocates_the_layers_state_shapes():
    cfg = presets.tiny_text()
    assert cfg.ple_layer_ids, "the tiny preset has a PLE layer"
    cache = Qwen4ExpHybridCache(cfg, 3, torch.float32)
    (conv, ssm), (ple_conv, ple_ctx) = GatedDeltaNet.state_shapes(cfg), PLE.state_shapes(cfg)
    for i, (t, st) in enumerate(zip(cfg.layer_types, cache.layers)):
        if t == LINEAR:
            assert st["conv"].shape == (3, *conv) and st["ssm"].shape == (3, *ssm)
            assert st["ssm"].dtype == torch.float32
        if ple_index_of(cfg, i) is not None:
            assert st["ple_conv"].shape == (3, *ple_conv) and st["ple_ctx"].shape == (3, *ple_ctx)


def test_gdn_state_shapes_match_the_layer_it_describes():
    cfg = presets.tiny_text()
    with torch.device("meta"):
        layer = GatedDeltaNet(cfg)
    (conv_dim, k1), ssm = GatedDeltaNet.state_shapes(cfg)
    assert (conv_dim, k1 + 1) == (layer.conv1d.weight.shape[0], layer.conv1d.weight.shape[-1])
    assert ssm == (layer.n_v, layer.d_k, layer.d_v)


def test_config_fields_are_typed_and_validate_names_the_field():
    names = {f.name: f.type for f in dataclasses.fields(Qwen4ExpTextConfig)}
    assert names["hc_count"] == "int" and names["indexer_budget"] == "int | None"
    cfg = presets.tiny_text()
    cfg.validate()
    cfg.hc_count = 1
    with pytest.raises(ConfigError, match="`hc_count`"):
        cfg.validate()
    with pytest.raises(ConfigError, match="`num_experts_per_tok`"):
        Qwen4ExpTextConfig(num_experts=4, num_experts_per_tok=5)
