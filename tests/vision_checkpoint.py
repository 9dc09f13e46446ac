"""A tiny random composite (``Qwen4ExpForConditionalGeneration``) checkpoint with what a multimodal processor
needs: a tokenizer whose vocabulary holds the vision tokens at the config's ids, a chat template that renders image
/ video content parts, and a Qwen2-VL image processor config (``preprocessor_config.json``) for the tiny tower.

The weights are made by upstream transformers (``tests/upstream.py``) and saved in the official format; no downloads.
"""

from __future__ import annotations

import json
import os

import torch

from tiny_checkpoint import WORDS

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} "
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|> "
    "{% elif c['type'] == 'text' %}{{ c['text'] }} {% endif %}"
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def vision_token_ids(cfg) -> dict[str, int]:
    return dict(zip(VISION_TOKENS, (cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id,
                                    cfg.video_token_id)))


def build_vision_tokenizer(out_dir: str, cfg) -> None:
    """A byte-level BPE tokenizer trained here on ``tiny_checkpoint.WORDS`` (transformers loads ``qwen4_exp``
    checkpoints' tokenizers as the Qwen3.5 BPE class, whatever tokenizer_config.json says), with <pad>, EOS
    (<|im_end|>) and <|im_start|> at the config's pad / eos ids and the four vision tokens at theirs."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tc = cfg.text_config
    pad, eos = int(tc.pad_token_id or 0), int(tc.eos_token_id)
    assert (pad, eos) == (0, 1), "the tokenizer builder puts <pad> at 0 and EOS at 1"
    ids = vision_token_ids(cfg)
    first = min(ids.values())
    assert sorted(ids.values()) == list(range(first, first + 4)) and first + 4 <= tc.vocab_size
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=first, special_tokens=["<pad>", "<|im_end|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(0, len(WORDS), 7)]
    tok.train_from_iterator(corpus, trainer)
    k = 0
    while tok.get_vocab_size() < first:  # a short corpus may run out of merges: fill up to the vision ids
        tok.add_tokens([AddedToken(f"<|fill_{k}|>", special=True)])
        k += 1
    tok.add_special_tokens([AddedToken(s, special=True) for s, _ in sorted(ids.items(), key=lambda x: x[1])])
    assert all(tok.token_to_id(s) == i for s, i in ids.items())
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "Qwen3_5Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<pad>",
                   "unk_token": None, "bos_token": None, "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
                   "clean_up_tokenization_spaces": False}, f)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:  # the processor's copy
        f.write(CHAT_TEMPLATE)


def write_image_processor_config(out_dir: str, cfg, max_pixels: int = 64 * 64) -> None:
    vc = cfg.vision_config
    factor = vc.patch_size * vc.spatial_merge_size
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen4ExpProcessor",
                   "patch_size": vc.patch_size, "temporal_patch_size": vc.temporal_patch_size,
                   "merge_size": vc.spatial_merge_size,
                   "size": {"shortest_edge": factor * factor, "longest_edge": max_pixels},
                   "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
                   "do_normalize": True, "do_convert_rgb": True}, f)


def randomize_tower(model, seed: int = 2) -> None:
    """The tower's LayerNorms, biases and position grid off their trivial init (every part of it matters)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.model.visual.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            elif n == "pos_embed.weight":
                p.normal_(0, 0.5, generator=g)


def build_vision_checkpoint(out_dir: str, seed: int = 0, dtype=torch.bfloat16, **text_overrides) -> str:
    """Save a random tiny composite model made by upstream transformers, plus tokenizer and processor config."""
    from qwen4exp import presets
    from upstream import upstream_conditional

    cfg = presets.tiny(**text_overrides)
    up = upstream_conditional(cfg, seed=seed)
    randomize_tower(up, seed + 1)
    up.to(dtype).save_pretrained(out_dir)
    build_vision_tokenizer(out_dir, cfg)
    write_image_processor_config(out_dir, cfg)
    return out_dir


def test_image(w: int, h: int, seed: int = 0):
    """A PIL RGB image of smooth random colour gradients plus noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6 * x + rng.uniform(0, 6)), np.cos(5 * y + rng.uniform(0, 6)),
                     np.sin(4 * (x + y) + rng.uniform(0, 6))], -1)
    px = (base * 0.4 + 0.5 + rng.normal(0, 0.08, base.shape)).clip(0, 1)
    return Image.fromarray((px * 255).astype(np.uint8), "RGB")
