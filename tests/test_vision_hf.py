"""Images and video through our HF runtime against upstream transformers' ``Qwen4ExpForConditionalGeneration``
(fp32, a tiny random composite checkpoint saved by upstream): logits and greedy tokens for one image, two images of
different sizes, one video, an image inside a multi-turn chat, and a batch mixing image and text-only rows."""

import pytest
import torch

from qwen4exp import Qwen4ExpForConditionalGeneration, presets
from qwen4exp.layers.rope import mrope_positions

from prompts import prompt
from upstream import upstream_conditional


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cfg = presets.tiny(indexer_n_heads=16)
    up = upstream_conditional(cfg, seed=5)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # the tower's LayerNorms, biases and position grid off their trivial init
        for n, p in up.model.visual.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            elif n == "pos_embed.weight":
                p.normal_(0, 0.5, generator=g)
    d = tmp_path_factory.mktemp("composite")
    up.save_pretrained(d)
    ours = Qwen4ExpForConditionalGeneration.from_pretrained(d, dtype=torch.float32)
    return cfg, up, ours


class Seq:
    """Builds one row: text runs and image / video placeholder runs (vision_start, tokens, vision_end)."""

    def __init__(self, cfg, seed=0):
        self.cfg, self.seed = cfg, seed
        self.ids, self.types = [], []
        self.images, self.videos = [], []  # (grid, pixels)
        self.patch_dim = 3 * 2 * cfg.vision_config.patch_size ** 2

    def text(self, n):
        tc = self.cfg.text_config
        self.seed += 1
        t = prompt(n, tc.vocab_size - 8, tc.eos_token_id, seed=self.seed, eos_at=(n // 2,)).tolist()
        self.ids += t
        self.types += [0] * n
        return self

    def _pixels(self, grid):
        g = torch.Generator().manual_seed(100 + self.seed + len(self.images) + 7 * len(self.videos))
        return torch.rand(int(torch.tensor(grid).prod()), self.patch_dim, generator=g) * 2 - 1

    def image(self, h, w):
        c = self.cfg
        n = h * w // 4
        self.ids += [c.vision_start_token_id] + [c.image_token_id] * n + [c.vision_end_token_id]
        self.types += [0] + [1] * n + [0]
        self.images.append(([1, h, w], self._pixels([1, h, w])))
        return self

    def video(self, t, h, w):
        c = self.cfg
        n = h * w // 4
        for f in range(t):  # every frame: a timestamp (text), then its own placeholder run
            self.text(3)
            self.ids += [c.vision_start_token_id] + [c.video_token_id] * n + [c.vision_end_token_id]
            self.types += [0] + [2] * n + [0]
        self.videos.append(([t, h, w], self._pixels([t, h, w])))
        return self


def batch(rows):
    """Left-padded batch of Seq rows -> model kwargs (upstream's names)."""
    S = max(len(r.ids) for r in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        n = len(r.ids)
        ids[i, S - n:], types[i, S - n:], mask[i, S - n:] = torch.tensor(r.ids), torch.tensor(r.types), 1
    kw = dict(input_ids=ids, mm_token_type_ids=types, attention_mask=mask)
    imgs = [x for r in rows for x in r.images]
    vids = [x for r in rows for x in r.videos]
    if imgs:
        kw["image_grid_thw"] = torch.tensor([g for g, _ in imgs])
        kw["pixel_values"] = torch.cat([p for _, p in imgs])
    if vids:
        kw["video_grid_thw"] = torch.tensor([g for g, _ in vids])
        kw["pixel_values_videos"] = torch.cat([p for _, p in vids])
    return kw


def rows_for(cfg, case):
    if case == "one_image":
        return [Seq(cfg).text(20).image(8, 8).text(30)]
    if case == "two_images_different_sizes":
        return [Seq(cfg, 1).text(9).image(4, 12).text(11).image(10, 6).text(25)]
    if case == "video":
        return [Seq(cfg, 2).text(12).video(2, 6, 4).text(30)]
    if case == "multi_turn_chat":  # system / user / assistant / user-with-image / assistant turns
        return [Seq(cfg, 3).text(14).text(10).text(22).text(6).image(6, 8).text(12).text(3)]
    raise KeyError(case)


GEN = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("case", ["one_image", "two_images_different_sizes", "video", "multi_turn_chat"])
def test_logits_and_greedy_match_upstream(pair, case):
    cfg, up, ours = pair
    kw = batch(rows_for(cfg, case))
    kw.pop("attention_mask")  # one row: no padding
    with torch.no_grad():
        a, b = up(**kw).logits, ours(**kw).logits
        err = rel_err(b, a)
        print(f"{case}: logits rel err {err:.2e}")
        assert err <= 1e-4
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        gu, go = up.generate(**kw, **GEN), ours.generate(**kw, **GEN)
        assert go.shape[1] == kw["input_ids"].shape[1] + 12
        assert torch.equal(gu, go)
        # cached decode after the multimodal prefill: later tokens at index + delta on all three axes
        cu, co = up(**kw, use_cache=True).past_key_values, ours(**kw, use_cache=True).past_key_values
        nxt = prompt(5, cfg.text_config.vocab_size - 8, cfg.text_config.eos_token_id, seed=9, eos_at=())[None]
        for t in range(nxt.shape[1]):
            lu = up(input_ids=nxt[:, t:t + 1], past_key_values=cu, use_cache=True).logits
            lo = ours(input_ids=nxt[:, t:t + 1], past_key_values=co, use_cache=True).logits
            assert rel_err(lo, lu) <= 1e-4


def test_vision_changes_the_output(pair):
    """The image content reaches the logits (a different image gives different logits)."""
    cfg, _, ours = pair
    kw = batch(rows_for(cfg, "one_image"))
    with torch.no_grad():
        a = ours(**kw).logits
        kw["pixel_values"] = kw["pixel_values"].flip(0)
        b = ours(**kw).logits
    assert rel_err(b, a) > 1e-2


def test_batch_mixing_image_and_text_rows(pair):
    """A left-padded batch (image row, text-only row, two-image row) == upstream on each row alone (upstream
    itself gives NaN logits for left-padded rows in fp32 eager)."""
    cfg, up, ours = pair
    rows = [Seq(cfg, 4).text(10).image(8, 4).text(20), Seq(cfg, 5).text(45),
            Seq(cfg, 6).text(5).image(4, 4).text(7).image(6, 6).text(9)]
    kw = batch(rows)
    S = kw["input_ids"].shape[1]
    with torch.no_grad():
        lo = ours(**kw).logits
        go = ours.generate(**kw, **GEN)
        for i, r in enumerate(rows):
            one = batch([r])
            one.pop("attention_mask")
            n = len(r.ids)
            lu = up(**one).logits[0]
            assert rel_err(lo[i, S - n:], lu) <= 1e-4
            assert torch.all(lo[i, : S - n] == 0)
            gu = up.generate(**one, **GEN)
            assert torch.equal(go[i, S:], gu[0, n:])


def test_types_default_to_placeholder_ids(pair):
    """Without mm_token_type_ids the placeholder ids give the same positions (and logits)."""
    cfg, _, ours = pair
    kw = batch(rows_for(cfg, "two_images_different_sizes"))
    with torch.no_grad():
        a = ours(**kw).logits
        kw.pop("mm_token_type_ids")
        b = ours(**kw).logits
    assert torch.equal(a, b)


def test_mrope_positions_layout():
    """Hand-checked layout: text 0..2, a 2x3 merged image at 3 (rows 3..4, cols 3..5), text resumes at 6."""
    pos, delta = mrope_positions([0, 0, 0] + [1] * 6 + [0, 0], [[1, 4, 6]], spatial_merge_size=2)
    assert pos.tolist() == [[0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
                            [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
                            [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]]
    assert delta == 8 - 11
    # a video of 2 frames: each frame its own run, temporal axis constant inside a frame
    pos, _ = mrope_positions([1] * 2 + [0] + [2] * 2 + [0] + [2] * 2, [[1, 2, 4]], [[2, 2, 4]], 2)
    assert pos[:, 3:5].tolist() == [[3, 3], [3, 3], [3, 4]] and pos[:, 6:].tolist() == [[6, 6], [6, 6], [6, 7]]


def test_bad_multimodal_inputs_name_the_problem(pair):
    cfg, _, ours = pair
    kw = batch(rows_for(cfg, "one_image"))
    with torch.no_grad():
        bad = dict(kw, image_grid_thw=torch.tensor([[1, 4, 8]]), pixel_values=kw["pixel_values"][:32])
        with pytest.raises(ValueError, match="more image placeholder tokens than the image_grid_thw entries"):
            ours(**bad)
        bad = dict(kw, image_grid_thw=torch.tensor([[1, 8, 10]]), pixel_values=torch.zeros(80, 96))
        with pytest.raises(ValueError, match="a run of 16 image placeholder tokens does not match"):
            ours(**bad)
        bad = dict(kw, image_grid_thw=torch.tensor([[1, 8, 8], [1, 2, 2]]), pixel_values=torch.zeros(68, 96))
        with pytest.raises(ValueError, match="hold more entries than input_ids has placeholder runs for"):
            ours(**bad)
        bad = dict(kw, pixel_values=kw["pixel_values"][:10])
        with pytest.raises(ValueError, match="image_grid_thw describes 64 patches but pixel_values has 10"):
            ours(**bad)
        bad = dict(kw)
        bad.pop("image_grid_thw")
        with pytest.raises(ValueError, match="pixel_values given without image_grid_thw"):
            ours(**bad)


def test_auto_processor_and_generate(tmp_path):
    """AutoProcessor (our Qwen4ExpProcessor: Pillow image processor, no torchvision needed) + our model answer a
    multi-turn chat holding two PIL images of different sizes exactly as upstream's model does."""
    from transformers import AutoProcessor

    from qwen4exp.hf.processing import Qwen4ExpProcessor, has_torchvision
    from upstream import UM
    from vision_checkpoint import build_vision_checkpoint, test_image

    build_vision_checkpoint(str(tmp_path), seed=7, dtype=torch.float32, indexer_n_heads=16)
    proc = AutoProcessor.from_pretrained(tmp_path)
    assert isinstance(proc, Qwen4ExpProcessor)
    assert (proc.video_processor is None) == (not has_torchvision())
    msgs = [{"role": "system", "content": "you are a good assistant"},
            {"role": "user", "content": [{"type": "image", "image": test_image(40, 24, seed=1)},
                                         {"type": "text", "text": "what is in the image"}]},
            {"role": "assistant", "content": "a red house and a tree"},
            {"role": "user", "content": [{"type": "text", "text": "and this one"},
                                         {"type": "image", "image": test_image(30, 50, seed=2)}]}]
    inp = proc.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True,
                                   return_tensors="pt")
    assert inp["image_grid_thw"].tolist() == [[1, 6, 10], [1, 12, 8]]  # 24x40 and 50x30 px, 4-px patches
    ours = Qwen4ExpForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    up = UM.Qwen4ExpForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        go, gu = ours.generate(**inp, **GEN), up.generate(**inp, **GEN)
    assert torch.equal(go, gu)
    text = proc.batch_decode(go[:, inp["input_ids"].shape[1]:])[0]
    assert len(text) > 0
    if not has_torchvision():
        with pytest.raises(ValueError, match="video inputs need .* torchvision"):
            proc(text="<|vision_start|><|video_pad|><|vision_end|>", videos=[torch.zeros(4, 3, 16, 16)])
