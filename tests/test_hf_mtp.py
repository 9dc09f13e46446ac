"""MTP speculative decoding in the HF reference: greedy output identical to plain greedy, fewer target passes
when drafts are right, exact cache rollback when they are partly wrong."""

import pytest
import torch

from qwen4exp import Qwen4ExpForCausalLM, presets

P = 70


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = presets.tiny_text(mtp_num_hidden_layers=1, indexer_n_heads=16)
    m = Qwen4ExpForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8)
    ids = torch.randint(2, cfg.vocab_size, (1, P), generator=torch.Generator().manual_seed(3))
    ids[0, 20] = cfg.eos_token_id
    with torch.no_grad():
        ref = m.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    return m, ids, ref


def _with_drafter(m, fn):
    orig = m._draft

    def draft(cache, H, nxt, pos, k):
        real = orig(cache, H, nxt, pos, k)  # keeps the MTP cache path exercised
        done = int(cache.lengths[0]) - P + 1
        return fn(real, done, k)

    m._draft = draft
    return orig


def test_mtp_head_greedy_equals_plain(model):
    m, ids, ref = model
    out = m.generate(ids, max_new_tokens=40, use_mtp=True)
    assert torch.equal(out, ref)
    st = m.last_mtp_stats
    assert st["new_tokens"] == 40 and st["target_forward_passes"] == 1 + st["verify_steps"]


@pytest.mark.parametrize("correct", [3, 2, 1, 0])
def test_partial_acceptance_rolls_back_exactly(model, correct):
    """Drafts whose first `correct` tokens are right: output must still equal plain greedy (cache rollback of GDN,
    PLE and QSA states is exact) and acceptance must be exactly `correct` per step."""
    m, ids, ref = model
    truth = ref[0, P:].tolist() + [5] * 8

    def fn(real, done, k):
        d = truth[done: done + k]
        return [t if i < correct else (t + 1) % 500 for i, t in enumerate(d)]

    orig = _with_drafter(m, fn)
    try:
        out = m.generate(ids, max_new_tokens=40, use_mtp=True)
    finally:
        m._draft = orig
    assert torch.equal(out, ref)
    st = m.last_mtp_stats
    if correct == 3:
        assert st["target_forward_passes"] < 40 / 3
    assert st["mean_acceptance_length"] == pytest.approx(1 + correct, abs=0.35)


def test_mtp_requires_head_and_greedy(model):
    m, ids, _ = model
    with pytest.raises(NotImplementedError, match="greedy"):
        m.generate(ids, max_new_tokens=4, use_mtp=True, do_sample=True)
    no_head = Qwen4ExpForCausalLM(presets.tiny_text()).eval()
    with pytest.raises(ValueError, match="MTP head"):
        no_head.generate(ids, max_new_tokens=4, use_mtp=True)
