"""``tools/vllm_gpu_check.py``'s decisive-position rule (CPU; the script itself runs on the GPU machine)."""

import torch

from script_loader import load_script

check = load_script("vllm_gpu_check")


def test_decisive_threshold_is_twice_the_bf16_noise_quantile():
    g = torch.Generator().manual_seed(0)
    gap = [torch.rand(500, generator=g) * 2, torch.rand(300, generator=g) * 2]
    err = [torch.rand(500, generator=g) * 0.1, torch.rand(300, generator=g) * 0.1]
    mask, thr = check.decisive_mask(gap, err)
    q99 = float(torch.quantile(torch.cat(err), 0.99))
    assert abs(thr - 2 * q99) < 1e-6 and 0.18 < thr < 0.2
    for gp, m in zip(gap, mask):
        assert m.shape == gp.shape and torch.equal(m, gp > thr)
    assert 0 < sum(int(m.sum()) for m in mask) < 800


def test_near_ties_are_not_decisive():
    """Positions whose fp32 gap is within the bf16 run's own error are left out; a large gap stays in."""
    gap = [torch.tensor([0.0, 0.001, 0.5, 3.0])]
    err = [torch.full((4,), 0.01)]
    mask, thr = check.decisive_mask(gap, err)
    assert abs(thr - 0.02) < 1e-6
    assert mask[0].tolist() == [False, False, True, True]


def test_greedy_step_gaps_equal_a_step_by_step_decode(tiny_ckpt):
    """The teacher-forced gaps over a continuation (one forward) equal those of decoding it one step at a time, each
    step a fresh forward over the prefix; the continuation here is the fp32 greedy one, so each step's argmax is its
    token and the gap is >= 0."""
    from qwen4exp import Qwen4ExpForCausalLM

    m = Qwen4ExpForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    prompts = [[5, 9, 2, 7, 1, 3], [11, 4]]
    tokens, want = [], []
    with torch.no_grad():
        for p in prompts:
            seq, gaps = list(p), []
            for _ in range(5):
                v, ix = m(torch.tensor([seq])).logits[0, -1].float().topk(2)
                gaps.append(float(v[0] - v[1]))
                seq.append(int(ix[0]))
            tokens.append(seq[len(p):])
            want.append(gaps)
    got = check.greedy_step_gaps(tiny_ckpt, prompts, tokens)
    for g, w in zip(got, want):
        assert g.shape == (5,) and torch.allclose(g, torch.tensor(w), atol=1e-4), (g, w)
