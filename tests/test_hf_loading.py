"""Checkpoint formats and load errors of the HF runtime."""


import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen4exp import Qwen4ExpForCausalLM, presets
from qwen4exp.hf.loading import CheckpointError
from tiny_checkpoint import split_experts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    cfg = presets.tiny_text(mtp_num_hidden_layers=1)
    m = Qwen4ExpForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("ours")
    m.save_pretrained(d)
    return cfg, m, d


def _ids(cfg, n=50):
    return torch.randint(2, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))


def _rewrite(src, dst, fn):
    sd = load_file(src / "model.safetensors")
    sd = fn(dict(sd))
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(sd, dst / "model.safetensors")
    return dst


def test_roundtrip_and_official_names(ckpt):
    cfg, m, d = ckpt
    names = set(load_file(d / "model.safetensors"))
    assert f"model.layers.0.ple.ple_embedding.ngram_embedding.shard_{cfg.split_ngram_parts - 1}.weight" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert any(n.startswith("mtp.layers.0.self_attn.indexer") for n in names)
    assert "model.hyper_connection_mixer.input_mix_weight_down.weight" in names
    m2 = Qwen4ExpForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert m2.mtp is not None  # mtp.* kept, not dropped
    torch.testing.assert_close(m2.mtp.fc_hidden.weight, m.mtp.fc_hidden.weight)
    with torch.no_grad():
        torch.testing.assert_close(m2(_ids(cfg)).logits, m(_ids(cfg)).logits)


def test_save_shards_past_max_shard_size_and_loads_back(ckpt, tmp_path):
    """``save_pretrained(max_shard_size=...)`` writes numbered files (each within the limit, a tensor never split)
    and the index; they load back to the same logits; a second save into the same folder leaves no stale file."""
    import json

    cfg, m, d = ckpt
    total = sum(t.numel() * t.element_size() for t in load_file(d / "model.safetensors").values())
    limit = total // 5
    m.save_pretrained(tmp_path, max_shard_size=limit)
    files = sorted(p.name for p in tmp_path.glob("model*.safetensors"))
    assert len(files) >= 5 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files) and index["metadata"]["total_size"] == total
    for f in files:
        sd = load_file(tmp_path / f)
        assert len(sd) == 1 or sum(t.numel() * t.element_size() for t in sd.values()) <= limit, f
    m2 = Qwen4ExpForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(m2(_ids(cfg)).logits, m(_ids(cfg)).logits)
    m.save_pretrained(tmp_path)  # the default limit: one file again, the shards and the index gone
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_per_expert_layout_and_shard_order(ckpt, tmp_path):
    cfg, m, d = ckpt

    def split(sd):
        sd = split_experts(sd)
        # checkpoints also carry an unused final-mixer injection and the composite prefix
        sd["model.hyper_connection_mixer.block_inject_weight.weight"] = torch.zeros(cfg.hc_count,
                                                                                   cfg.hc_count * cfg.hidden_size)
        return {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in sd.items()}

    d2 = _rewrite(d, tmp_path / "per_expert", split)
    m2 = Qwen4ExpForCausalLM.from_pretrained(d2, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(m2(_ids(cfg)).logits, m(_ids(cfg)).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_persistent_buffers_rebuilt(ckpt, dtype):
    """Buffers no checkpoint holds (the RoPE frequencies and axis maps) are left uninitialised by the loader's
    meta-device build: after loading, every one equals a freshly constructed model's (values, dtype, device), and
    the 3-axis RoPE path that reads ``axis_cols`` gives the fresh model's cos / sin."""
    cfg, _, d = ckpt
    loaded = Qwen4ExpForCausalLM.from_pretrained(d, dtype=dtype)
    fresh = Qwen4ExpForCausalLM(cfg)
    persistent = set(fresh.state_dict())
    want = {k: b for k, b in fresh.named_buffers() if k not in persistent}
    got = {k: b for k, b in loaded.named_buffers() if k not in persistent}
    assert {"model.rotary_emb.inv_freq", "model.rotary_emb.axis", "model.rotary_emb.axis_cols"} <= set(want)
    assert set(got) == set(want)
    for k, b in want.items():
        assert got[k].dtype == b.dtype and got[k].device == b.device and torch.equal(got[k], b), k
    pos = torch.stack([torch.arange(9), torch.arange(9) // 3, torch.arange(9) % 3])  # t, h, w differ
    for rot in (loaded.model.rotary_emb, fresh.model.rotary_emb):
        rot.use_table(16)
    for a, b in zip(loaded.model.rotary_emb(pos, torch.float32), fresh.model.rotary_emb(pos, torch.float32)):
        assert torch.equal(a, b)


def test_missing_tensor_named(ckpt, tmp_path):
    cfg, _, d = ckpt
    name = "model.layers.1.self_attn.indexer.index_qk_proj.weight"
    d2 = _rewrite(d, tmp_path / "missing", lambda sd: {k: v for k, v in sd.items() if k != name})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        Qwen4ExpForCausalLM.from_pretrained(d2)


def test_misshaped_tensor_named(ckpt, tmp_path):
    cfg, _, d = ckpt
    name = "model.layers.0.linear_attn.in_proj_z.weight"

    def bad(sd):
        sd[name] = sd[name][:-1].clone()
        return sd

    d2 = _rewrite(d, tmp_path / "misshaped", bad)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.linear_attn\.in_proj_z\.weight has shape"):
        Qwen4ExpForCausalLM.from_pretrained(d2)


def test_missing_ple_shard_named(ckpt, tmp_path):
    cfg, _, d = ckpt
    d2 = _rewrite(d, tmp_path / "shard", lambda sd: {k: v for k, v in sd.items() if "shard_1." not in k})
    with pytest.raises(CheckpointError, match=r"missing shards \[1\]"):
        Qwen4ExpForCausalLM.from_pretrained(d2)


def test_fp8_ple_table(ckpt, tmp_path):
    """FP8 release layout: F8_E4M3 shards + one per-tensor weight_scale; rows are dequantized on lookup."""
    cfg, m, d = ckpt
    scale = torch.tensor(0.01)

    def to_fp8(sd):
        for k in [k for k in sd if ".shard_" in k]:
            sd[k] = (sd[k].float() / scale).to(torch.float8_e4m3fn)
        sd["model.layers.0.ple.ple_embedding.ngram_embedding.weight_scale"] = scale
        return sd

    d2 = _rewrite(d, tmp_path / "fp8", to_fp8)
    m2 = Qwen4ExpForCausalLM.from_pretrained(d2, dtype=torch.float32)
    t = m2.model.layers[0].ple.ple_embedding.ngram_embedding
    assert t.weight.dtype == torch.float8_e4m3fn
    ref = m.model.layers[0].ple.ple_embedding.ngram_embedding.weight
    torch.testing.assert_close(t.weight.float() * t.weight_scale, ref, atol=0.01 * 0.07, rtol=0.07)
    with torch.no_grad():
        a, b = m(_ids(cfg)).logits, m2(_ids(cfg)).logits
    assert ((a - b).norm() / a.norm()) < 0.05


def test_bad_inputs_have_clear_errors(ckpt):
    cfg, m, _ = ckpt
    with pytest.raises(ValueError, match="out of range"):
        m(torch.tensor([[cfg.vocab_size]]))
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        m()
    with pytest.raises(NotImplementedError, match="text-only"):
        m(_ids(cfg, 5), pixel_values=torch.zeros(1, 3))


def test_inputs_embeds_recover_ids_for_ple(ckpt):
    cfg, m, _ = ckpt
    ids = _ids(cfg, 20)
    with torch.no_grad():
        a = m(ids).logits
        b = m(inputs_embeds=m.model.embed_tokens(ids)).logits
    torch.testing.assert_close(a, b)
