"""Our HF reference against upstream transformers' own qwen4_exp on tiny random checkpoints (fp32).

Checkpoints are made by upstream (``save_pretrained``) and loaded by ``qwen4exp.Qwen4ExpForCausalLM.from_pretrained``.
Prompts are several times the QSA budget (block selection active) and hold EOS tokens (PLE context resets).
Configs: three fixed ones and two drawn by ``random_config`` from fixed seeds (depth, layer pattern, streams, PLE
layers, QSA budget and ratio, experts, EOS id). ``tests/test_parity_newest_transformers.py`` runs this file again
against the newest transformers release's ``qwen4_exp``.
"""

import random

import pytest
import torch

from qwen4exp import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration, presets

from prompts import prompt
import upstream
from upstream import UM, upstream_causal_lm, upstream_conditional

# 16 indexer heads: a block's score is 0 only if all 16 ReLU(q.k) are 0, so zero-score ties at the top-k boundary
# (which two implementations may break differently) do not occur; the real model has 4 heads.
CONFIGS = {
    "base": dict(),  # 4 layers (L I L I), hc 4, PLE on layer 1, budget 16 / ratio 4
    "two_ple_hc3": dict(hc_count=3, ple_layer_ids=(1, 3), indexer_budget=8, indexer_compress_ratio=2),
    "deep_ratio8": dict(num_hidden_layers=6, full_attention_every=3, ple_layer_ids=(2,), indexer_budget=32,
                        indexer_compress_ratio=8, eos_token_id=5),
}


def random_config(seed: int) -> dict:
    """A tiny config's ``presets.tiny_text`` arguments drawn from ``seed``: 2-6 layers, an indexed layer every 2 or 3,
    2-4 streams, 1-2 PLE layers among the linear ones, compress ratio 2/4/8 with a budget of 2-4 compressed blocks,
    4 or 8 experts (1-3 a token), EOS id 1-9."""
    r = random.Random(seed)
    n = r.randint(2, 6)
    every = r.choice([e for e in (2, 3) if e <= n])
    linear = [i + 1 for i in range(n) if (i + 1) % every]
    ratio = r.choice((2, 4, 8))
    return dict(num_hidden_layers=n, full_attention_every=every, hc_count=r.randint(2, 4),
                ple_layer_ids=tuple(sorted(r.sample(linear, r.randint(1, min(2, len(linear)))))),
                indexer_compress_ratio=ratio, indexer_budget=ratio * r.randint(2, 4), num_experts=r.choice((4, 8)),
                num_experts_per_tok=r.randint(1, 3), eos_token_id=r.randint(1, 9))


CONFIGS.update({f"random{seed}": random_config(seed) for seed in (0, 1)})


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    cfg = presets.tiny_text(indexer_n_heads=16, **CONFIGS[request.param])
    up = upstream_causal_lm(cfg, seed=hash(request.param) % 1000)
    d = tmp_path_factory.mktemp(request.param)
    up.save_pretrained(d)
    ours = Qwen4ExpForCausalLM.from_pretrained(d, dtype=torch.float32)
    return cfg, up, ours, d


def test_full_forward_logits(pair):
    cfg, up, ours, _ = pair
    eos = cfg.eos_token_id
    ids = prompt(6 * cfg.indexer_budget + 3, cfg.vocab_size, eos)[None]
    with torch.no_grad():
        a, b = up(ids).logits, ours(ids).logits
    assert rel_err(b, a) <= 1e-4
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_greedy_32_tokens(pair):
    cfg, up, ours, _ = pair
    ids = prompt(5 * cfg.indexer_budget, cfg.vocab_size, cfg.eos_token_id, seed=1)[None]
    kw = dict(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        gu, go = up.generate(ids, **kw), ours.generate(ids, **kw)
    assert go.shape[1] == ids.shape[1] + 32
    assert torch.equal(gu, go)


def test_cached_decode_logits_match_upstream(pair):
    cfg, up, ours, _ = pair
    ids = prompt(3 * cfg.indexer_budget, cfg.vocab_size, cfg.eos_token_id, seed=2)[None]
    nxt = prompt(6, cfg.vocab_size, cfg.eos_token_id, seed=3, eos_at=(2,))[None]
    with torch.no_grad():
        pu = up(ids, use_cache=True)
        po = ours(ids, use_cache=True)
        cu, co = pu.past_key_values, po.past_key_values
        for t in range(nxt.shape[1]):
            lu = up(nxt[:, t:t + 1], past_key_values=cu, use_cache=True).logits
            lo = ours(nxt[:, t:t + 1], past_key_values=co, use_cache=True).logits
            assert rel_err(lo, lu) <= 1e-4


def test_ragged_left_padded_batch(pair):
    """Ours on a left-padded batch == upstream on each row alone. (Upstream itself yields NaN logits for
    left-padded rows in fp32 eager: fully masked padding rows poison the GDN inputs.)"""
    cfg, up, ours, _ = pair
    eos, V, B = cfg.eos_token_id, cfg.vocab_size, cfg.indexer_budget
    rows = [prompt(n, V, eos, seed=10 + n) for n in (5 * B, 2 * B + 1, 7)]
    S = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, S - len(r):], mask[i, S - len(r):] = r, 1
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        lo = ours(ids, attention_mask=mask).logits
        go = ours.generate(ids, attention_mask=mask, **kw)
        for i, r in enumerate(rows):
            lu = up(r[None]).logits[0]
            assert rel_err(lo[i, S - len(r):], lu) <= 1e-4
            assert torch.all(lo[i, : S - len(r)] == 0)
            gu = up.generate(r[None], **kw)
            assert torch.equal(go[i, S:], gu[0, len(r):])


def test_chunked_prefill_equals_one_shot(pair):
    cfg, _, ours, _ = pair
    ids = prompt(5 * cfg.indexer_budget + 1, cfg.vocab_size, cfg.eos_token_id, seed=4)[None]
    with torch.no_grad():
        full = ours(ids).logits
        cache, parts, s = None, [], 0
        for n in (1, 5, 17, 3, ids.shape[1]):
            if s >= ids.shape[1]:
                break
            o = ours(ids[:, s: s + n], past_key_values=cache, use_cache=True)
            cache, s = o.past_key_values, s + n
            parts.append(o.logits)
    assert rel_err(torch.cat(parts, 1), full) <= 1e-5


def test_sampled_generate_is_seeded(pair):
    cfg, _, ours, _ = pair
    ids = prompt(20, cfg.vocab_size, cfg.eos_token_id, seed=5)[None]
    kw = dict(max_new_tokens=10, do_sample=True, top_k=20, temperature=1.0, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        torch.manual_seed(7)
        a = ours.generate(ids, **kw)
        torch.manual_seed(7)
        b = ours.generate(ids, **kw)
        torch.manual_seed(8)
        c = ours.generate(ids, **kw)
    assert torch.equal(a, b) and a.shape == (1, 30)
    assert not torch.equal(a, c)


def test_our_save_loads_in_upstream(pair, tmp_path):
    cfg, up, ours, _ = pair
    ours.save_pretrained(tmp_path)
    up2 = UM.Qwen4ExpForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = prompt(40, cfg.vocab_size, cfg.eos_token_id, seed=6)[None]
    with torch.no_grad():
        assert rel_err(up2(ids).logits, up(ids).logits) <= 1e-6


def test_conditional_generation_text_path(tmp_path):
    cfg = presets.tiny(indexer_n_heads=16)
    up = upstream_conditional(cfg, seed=3)
    up.save_pretrained(tmp_path)
    ours = Qwen4ExpForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.model.visual.pos_embed.weight.shape[0] == cfg.vision_config.num_position_embeddings
    tc = cfg.text_config
    ids = prompt(4 * tc.indexer_budget, tc.vocab_size, tc.eos_token_id, seed=9)[None]
    with torch.no_grad():
        a = up(input_ids=ids, mm_token_type_ids=torch.zeros_like(ids)).logits
        b = ours(input_ids=ids).logits
    assert rel_err(b, a) <= 1e-4
    # a composite checkpoint also loads as the text-only model, which refuses images (tests/test_vision_hf.py)
    text_only = Qwen4ExpForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert rel_err(text_only(ids).logits, a) <= 1e-4
    with pytest.raises(NotImplementedError, match="text-only"):
        text_only(input_ids=ids, pixel_values=torch.zeros(4, 96), image_grid_thw=torch.tensor([[1, 2, 2]]))


# ---------------------------------------------------------------------------------------------------- the oracle's import
def test_missing_upstream_module_fails_loudly():
    """With transformers installed, a qwen4_exp module that does not import is a test failure naming the module,
    the installed transformers and the pinned range, never a skip."""
    import transformers

    pin = upstream.pinned_transformers()
    assert pin.startswith("transformers") and "<" in pin
    with pytest.raises(pytest.fail.Exception) as e:
        upstream.require("no_such_module_qwen4_exp")
    msg = str(e.value)
    assert "transformers.models.qwen4_exp.no_such_module_qwen4_exp" in msg and pin in msg
    assert transformers.__version__ in msg and "inside the pinned range" in msg


def test_upstream_skips_only_without_transformers(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version

    def version(name):
        if name == "transformers":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(pytest.skip.Exception, match="transformers is not installed"):
        upstream.require("modeling_qwen4_exp")
