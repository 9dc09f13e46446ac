"""A tiny composite (image + text) Qwen4Exp checkpoint, to try images with: random weights, nothing downloaded.

    make tiny-vl                       # = .venv/bin/python recipes/vision_tiny.py (about 5 s on 2 cores)
    python recipes/vision_tiny.py [--out DIR] [--seed N] [--dtype bfloat16|float32] [--max-pixels N]

Writes ``DIR`` (default ``.cache/tiny-vl`` in this repository, git-ignored; ``make clean`` removes it), a
``Qwen4ExpForConditionalGeneration`` checkpoint in the official layout that the HF reference, ``qwen4exp-serve`` and
``vllm serve`` load as they load a real one:

* ``config.json`` + ``model.safetensors``: ``presets.tiny()`` (4 text layers, GDN + QSA, 4 hyper-connection streams,
  PLE, MoE; a 2-block vision tower with 4-pixel patches; ``max_position_embeddings`` 4096), made by upstream
  transformers' own ``qwen4_exp`` model with every norm, bias and gate moved off its trivial init (1.4 MB in bf16);
* a byte-level BPE tokenizer trained here on a short word list, with the vision tokens
  (``<|vision_start|>``, ``<|image_pad|>``, ...) at the config's ids and a chat template that renders image parts;
* ``preprocessor_config.json``: a Qwen2-VL image processor for the tiny tower (an image is resized to at most
  ``--max-pixels`` pixels, default 64 x 64: at most 64 image tokens), ``processor_class`` ``Qwen4ExpProcessor``;
* ``example.png``: a 64 x 48 test image (colour gradients) for the README's image example.

The weights are random, so the answers are babble: this checkpoint is for trying and testing the image path (HF
reference, server, OpenAI API), not for reading its text. The tests build theirs with the same functions
(``tests/vision_checkpoint.py`` imports this file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, ".cache", "tiny-vl")
EXAMPLE_IMAGE = "example.png"

# The word list the tiny tokenizers are trained on (also the tests' WordLevel tokenizer, tests/tiny_checkpoint.py).
WORDS = ("the a an of to in and is was for on that with as by at from it this be are or his her their which one "
         "all were when we there can an has more if no out so said what up its about into than them only other new "
         "some could time these two may then do first any my now such like our over man me even most made after also "
         "did many before must through back years where much your way well down should because each just those people "
         "how too little state good very make world still own see men work long get here between both life being under "
         "never day same another know while last might us great old year off come since against go came right used take "
         "three hello world user assistant system question answer yes no cat dog tree house water fire sky blue red "
         "green quick brown fox jumps lazy").split()

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

# config keys of ours that upstream's configs do not take
OURS_ONLY = ("model_type", "transformers_version", "architectures", "mtp_num_hidden_layers",
             "mtp_use_dedicated_embeddings", "mamba_ssm_dtype")


def _upstream():
    """Upstream transformers' ``qwen4_exp`` (configuration, modeling) modules."""
    try:
        from transformers.models.qwen4_exp import configuration_qwen4_exp, modeling_qwen4_exp
    except ImportError as e:
        raise SystemExit(f"vision_tiny: needs transformers' own qwen4_exp model (transformers >= 5.16.1, as "
                         f"pyproject.toml pins): {e}") from None
    return configuration_qwen4_exp, modeling_qwen4_exp


def randomize(model, head_scale: float = 8.0, seed: int = 0):
    """Make every mechanism matter: non-zero norm weights and PLE conv (upstream inits them to zero), and a larger
    output head so that argmaxes are not decided by rounding."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n or "hc_norm" in n or n.endswith(("norm_key.weight",
                                                                                              "norm_query.weight",
                                                                                              "norm_conv.weight")):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            elif "ple.conv1d" in n:
                p.normal_(0, 0.3, generator=g)
        head = model.lm_head.weight
        head.mul_(head_scale)
    return model


def upstream_conditional(cfg, seed: int = 0):
    """A random upstream ``Qwen4ExpForConditionalGeneration`` (fp32, eager attention) for our config ``cfg``."""
    UC, UM = _upstream()
    torch.manual_seed(seed)
    d = cfg.to_dict()
    for k in ("transformers_version", "architectures", "model_type"):
        d.pop(k, None)
    td = d.pop("text_config").to_dict() if hasattr(d.get("text_config"), "to_dict") else d.pop("text_config")
    vd = d.pop("vision_config").to_dict() if hasattr(d.get("vision_config"), "to_dict") else d.pop("vision_config")
    for k in OURS_ONLY:
        td.pop(k, None)
    for k in ("model_type", "transformers_version", "architectures"):
        vd.pop(k, None)
    ucfg = UC.Qwen4ExpConfig(text_config=td, vision_config=vd, **{k: v for k, v in d.items()
                                                                     if k.endswith("token_id")})
    ucfg._attn_implementation = "eager"
    ucfg.text_config._attn_implementation = "eager"
    return randomize(UM.Qwen4ExpForConditionalGeneration(ucfg).float().eval(), seed=seed)


def vision_token_ids(cfg) -> dict[str, int]:
    return dict(zip(VISION_TOKENS, (cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id,
                                    cfg.video_token_id)))


def build_vision_tokenizer(out_dir: str, cfg) -> None:
    """A byte-level BPE tokenizer trained here on ``WORDS`` (transformers loads ``qwen4_exp`` checkpoints'
    tokenizers as the Qwen3.5 BPE class, whatever tokenizer_config.json says), with <pad>, EOS (<|im_end|>) and
    <|im_start|> at the config's pad / eos ids and the four vision tokens at theirs."""
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


def build_vision_checkpoint(out_dir: str, seed: int = 0, dtype=torch.bfloat16, max_pixels: int = 64 * 64,
                            **text_overrides) -> str:
    """Save a random tiny composite model made by upstream transformers (``presets.tiny(**text_overrides)``), plus
    tokenizer and image processor config, into ``out_dir``."""
    from qwen4exp import presets

    cfg = presets.tiny(**text_overrides)
    up = upstream_conditional(cfg, seed=seed)
    randomize_tower(up, seed + 1)
    up.to(dtype).save_pretrained(out_dir)
    build_vision_tokenizer(out_dir, cfg)
    write_image_processor_config(out_dir, cfg, max_pixels=max_pixels)
    return out_dir


def example_image(w: int, h: int, seed: int = 0):
    """A PIL RGB image of smooth random colour gradients plus noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6 * x + rng.uniform(0, 6)), np.cos(5 * y + rng.uniform(0, 6)),
                     np.sin(4 * (x + y) + rng.uniform(0, 6))], -1)
    px = (base * 0.4 + 0.5 + rng.normal(0, 0.08, base.shape)).clip(0, 1)
    return Image.fromarray((px * 255).astype(np.uint8), "RGB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="the checkpoint directory to write (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--max-pixels", type=int, default=64 * 64,
                    help="the image processor's largest image, in pixels (default 4096: at most 64 image tokens)")
    args = ap.parse_args(argv)
    if os.path.isfile(args.out):
        print(f"vision_tiny: --out {args.out} is a file", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    build_vision_checkpoint(args.out, seed=args.seed, dtype=getattr(torch, args.dtype), max_pixels=args.max_pixels)
    example_image(64, 48, seed=1).save(os.path.join(args.out, EXAMPLE_IMAGE))
    print(f"tiny composite checkpoint (random weights): {args.out}  (example image: {EXAMPLE_IMAGE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
