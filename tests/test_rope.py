"""``layers.rope.RotaryEmbedding``: the precomputed cos / sin rows (``use_table``, the vLLM runtime's) give the
values of the on-the-fly formula bit for bit, for text positions and for three-axis (t, h, w) positions."""

import pytest
import torch

from qwen4exp import presets
from qwen4exp.layers.rope import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_equal_the_formula(dtype):
    cfg = presets.tiny_text()
    plain, tabled = RotaryEmbedding(cfg), RotaryEmbedding(cfg)
    tabled.use_table(5000)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 5000, (37,), generator=g)  # unordered, repeats
    for want, got in zip(plain(pos, dtype), tabled(pos, dtype)):
        assert got.dtype == dtype and got.shape == (37, plain.rotary_dim)
        assert torch.equal(got, want)
    pos3 = torch.stack([pos, torch.randint(0, 5000, (37,), generator=g), torch.randint(0, 50, (37,), generator=g)])
    for want, got in zip(plain(pos3, dtype), tabled(pos3, dtype)):  # each column from its frequency's axis
        assert torch.equal(got, want)
    assert not torch.equal(plain(pos3, dtype)[0], plain(pos, dtype)[0])  # (the axes really differ here)


def test_positions_past_the_table_are_an_error_not_a_wrong_row():
    rot = RotaryEmbedding(presets.tiny_text())
    rot.use_table(100)
    with pytest.raises(IndexError):
        rot(torch.tensor([3, 100]), torch.float32)
