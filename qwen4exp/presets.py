"""Ready-made configs: the real Qwen3.8-Flash-Next, the FN-12L benchmark config, and tiny configs for tests."""

from __future__ import annotations

from .configuration import INDEXED, LINEAR, Qwen4ExpConfig, Qwen4ExpTextConfig

FLASH_NEXT_EOS = 248044


def _flash_next_text(num_hidden_layers: int = 48, **overrides) -> dict:
    t = dict(
        vocab_size=248320,
        hidden_size=2560,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=24,
        num_key_value_heads=2,
        head_dim=256,
        hidden_act="silu",
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        moe_intermediate_size=640,
        shared_expert_intermediate_size=640,
        num_experts=512,
        num_experts_per_tok=10,
        norm_topk_prob=True,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else LINEAR for i in range(num_hidden_layers)],
        hc_count=4,
        hc_lowrank=320,
        ple_layer_ids=[2],
        ple_embed_dim=2560,
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=8,
        ngram_vocab_size_base=20_000_000,
        make_ngram_vocab_size_divisible_by=128,
        seed=1234,
        split_ngram_parts=128,
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=128,
        indexer_budget=2048,
        indexer_compress_ratio=4,
        output_gate_type="sigmoid",
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        mamba_ssm_dtype="float32",
        eos_token_id=FLASH_NEXT_EOS,
        bos_token_id=FLASH_NEXT_EOS,
        dtype="bfloat16",
    )
    t.update(overrides)
    return t


def flash_next() -> Qwen4ExpConfig:
    """The real Qwen3.8-Flash-Next (``Qwen4ExpForConditionalGeneration``) config."""
    return Qwen4ExpConfig(
        text_config=_flash_next_text(),
        vision_config=dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                           num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=2560, num_position_embeddings=2304),
        architectures=["Qwen4ExpForConditionalGeneration"],
        dtype="bfloat16",
    )


def fn12l() -> Qwen4ExpTextConfig:
    """FN-12L: the project's standard GPU benchmark config (real widths, 12 layers, n-gram base 2M)."""
    return Qwen4ExpTextConfig(**_flash_next_text(num_hidden_layers=12, ngram_vocab_size_base=2_000_000),
                              architectures=["Qwen4ExpForCausalLM"])


def tiny_text(
    num_hidden_layers: int = 4,
    hidden_size: int = 64,
    vocab_size: int = 512,
    hc_count: int = 4,
    ple_layer_ids: tuple[int, ...] = (1,),
    indexer_budget: int = 16,
    indexer_compress_ratio: int = 4,
    full_attention_every: int = 2,
    eos_token_id: int = 1,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    mtp_num_hidden_layers: int = 0,
    head_dim: int = 32,
    linear_head_dim: int = 64,
    **overrides,
) -> Qwen4ExpTextConfig:
    """A tiny config with every mechanism active; small enough for CPU tests."""
    layer_types = [INDEXED if (i + 1) % full_attention_every == 0 else LINEAR for i in range(num_hidden_layers)]
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        layer_types=layer_types,
        hc_count=hc_count,
        hc_lowrank=16,
        ple_layer_ids=list(ple_layer_ids),
        ple_embed_dim=32,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=3,
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=32,
        indexer_budget=indexer_budget,
        indexer_compress_ratio=indexer_compress_ratio,
        output_gate_type="sigmoid",
        eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
        pad_token_id=0,
        mtp_num_hidden_layers=mtp_num_hidden_layers,
        architectures=["Qwen4ExpForCausalLM"],
    )
    kw.update(overrides)
    return Qwen4ExpTextConfig(**kw)


def tiny(**text_overrides) -> Qwen4ExpConfig:
    """A tiny composite (``Qwen4ExpForConditionalGeneration``) config with a tiny vision tower."""
    text = tiny_text(**text_overrides)
    d = text.to_dict()
    d["architectures"] = None
    return Qwen4ExpConfig(
        text_config=d,
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text.hidden_size,
                           num_position_embeddings=16),
        image_token_id=text.vocab_size - 4,
        video_token_id=text.vocab_size - 3,
        vision_start_token_id=text.vocab_size - 6,
        vision_end_token_id=text.vocab_size - 5,
        architectures=["Qwen4ExpForConditionalGeneration"],
    )


def anchor_nvfp4_quantization_config() -> dict:
    """The ``quantization_config`` upstream vLLM's full-depth NVFP4 anchor run read (ModelOpt's config.json form:
    routed experts NVFP4 W4A4, everything the ignore list names BF16); a fresh dict each call."""
    group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "producer": {"name": "modelopt", "version": "0.39.0"},
            "config_groups": {"group_0": {"weights": dict(group), "input_activations": dict(group),
                                          "targets": ["Linear"]}},
            "ignore": ["lm_head", "model.embed_tokens", "*self_attn*", "*indexer*", "*linear_attn*",
                       "*shared_expert*", "*shared_expert_gate*", "*mlp.gate", "*hyper_connection*",
                       "*hyper_connection_mixer*", "*.ple", "*.ple.*", "*mtp*"]}
