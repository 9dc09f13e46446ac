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
