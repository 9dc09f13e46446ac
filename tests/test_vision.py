"""Our vision tower (qwen4exp/layers/vision.py) against upstream transformers' ``Qwen4ExpVisionModel`` with the same
random weights, fp32: one image, two images of different sizes (ragged attention segments), a video (t > 1), and a
mix of all three in one call."""

import pytest
import torch

from qwen4exp import presets
from qwen4exp.layers.vision import VisionTower

from upstream import UC, UM


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def vision_config(**kw):
    d = presets.tiny().vision_config.to_dict()
    d.update(kw)
    for k in ("model_type", "transformers_version", "architectures"):
        d.pop(k, None)
    return d


@pytest.fixture(scope="module", params=["tiny", "wide"])
def towers(request):
    # "wide": 3 heads, a 5x5 position grid (not a power of two), merge 2, 3 blocks, another rope theta
    kw = {} if request.param == "tiny" else dict(depth=3, hidden_size=48, num_heads=3, num_position_embeddings=25,
                                                  intermediate_size=80, rope_parameters={"rope_theta": 500.0,
                                                                                        "rope_type": "axial"})
    vd = vision_config(**kw)
    ucfg = UC.Qwen4ExpVisionConfig(**vd)
    ucfg._attn_implementation = "eager"
    torch.manual_seed(0)
    up = UM.Qwen4ExpVisionModel(ucfg).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in up.named_parameters():  # LayerNorms and biases off their trivial init
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            elif n == "pos_embed.weight":
                p.normal_(0, 0.5, generator=g)
    from qwen4exp.configuration import Qwen4ExpVisionConfig

    ours = VisionTower(Qwen4ExpVisionConfig(**vd)).float().eval()
    missing, unexpected = ours.load_state_dict(up.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return up, ours


def pixels(grid, patch_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.as_tensor(grid).prod(-1).sum())
    return torch.randn(n, patch_dim, generator=g)


CASES = {
    "one_image": [[1, 6, 8]],
    "two_images_different_sizes": [[1, 4, 10], [1, 8, 6]],
    "video": [[3, 4, 6]],
    "image_video_image": [[1, 2, 2], [2, 6, 4], [1, 10, 2]],
}


@pytest.mark.parametrize("case", list(CASES))
def test_tower_matches_upstream(towers, case):
    up, ours = towers
    grid = torch.tensor(CASES[case])
    px = pixels(grid, ours.patch_dim, seed=len(case))
    with torch.no_grad():
        ref = up(px, grid_thw=grid).pooler_output
        got = ours(px, grid)
    assert got.shape == ref.shape == (int(grid.prod(-1).sum()) // 4, ours.merger.linear_fc2.out_features)
    err = rel_err(got, ref)
    print(f"{case}: rel err {err:.2e}")
    assert err <= 1e-5


def test_items_are_independent(towers):
    """Each image's output depends only on its own patches (attention stays inside its segments)."""
    _, ours = towers
    grid = torch.tensor([[1, 4, 10], [1, 8, 6]])
    px = pixels(grid, ours.patch_dim, seed=3)
    with torch.no_grad():
        both = ours(px, grid)
        a = ours(px[:40], grid[:1])
        b = ours(px[40:], grid[1:])
    assert rel_err(both, torch.cat([a, b])) <= 1e-6


def test_bad_inputs_name_the_problem(towers):
    _, ours = towers
    px = pixels([[1, 4, 4]], ours.patch_dim)
    with pytest.raises(ValueError, match="describes 32 patches but pixel_values has 16"):
        ours(px, torch.tensor([[2, 4, 4]]))
    with pytest.raises(ValueError, match="multiples of spatial_merge_size=2"):
        ours(px[:15], torch.tensor([[1, 3, 5]]))
    with pytest.raises(ValueError, match=r"pixel_values must be \[num_patches, 96\]"):
        ours(px[:, :10], torch.tensor([[1, 4, 4]]))
