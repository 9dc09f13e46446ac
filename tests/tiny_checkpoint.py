"""Build a tiny random Qwen4Exp checkpoint (official format, via our HF runtime) plus a local tokenizer.

No downloads: the tokenizer is a WordLevel vocabulary over a fixed list of words, with byte-ish fallbacks, saved as
tokenizer.json + tokenizer_config.json with a simple chat template; its EOS id matches the config's.
"""

from __future__ import annotations

import json
import os
import sys

import torch

# the word list (one definition: recipes/vision_tiny.py, whose tokenizer trains on it too)
_RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
if _RECIPES not in sys.path:
    sys.path.insert(0, _RECIPES)
from vision_tiny import WORDS  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_tokenizer(out_dir: str, vocab_size: int, eos_id: int, pad_id: int = 0) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    specials = {pad_id: "<pad>", eos_id: "<|im_end|>"}
    vocab: dict[str, int] = {}
    for i, s in specials.items():
        vocab[s] = i
    nxt = 0

    def take() -> int:
        nonlocal nxt
        while nxt in specials:
            nxt += 1
        i = nxt
        nxt += 1
        return i

    vocab["<unk>"] = take()
    vocab["<|im_start|>"] = take()
    for w in dict.fromkeys(WORDS):
        if nxt >= vocab_size:
            break
        vocab[w] = take()
    k = 0
    while nxt < vocab_size:  # fill the rest so every id decodes to something
        i = take()
        if i >= vocab_size:
            break
        vocab[f"w{k}"] = i
        k += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(s, special=True) for s in ("<pad>", "<|im_end|>", "<|im_start|>")])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<pad>",
                   "unk_token": "<unk>", "bos_token": None, "chat_template": CHAT_TEMPLATE,
                   "model_max_length": 4096, "clean_up_tokenization_spaces": False}, f)


def build_checkpoint(out_dir: str, seed: int = 0, tokenizer: bool = True, **overrides) -> str:
    """Save a random tiny ``Qwen4ExpForCausalLM`` (bf16 tensors, official names) into ``out_dir``."""
    from qwen4exp import Qwen4ExpForCausalLM, presets

    cfg = presets.tiny_text(**overrides)
    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norms / gates so every path matters
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "norm_key.weight", "norm_query.weight",
                              "norm_conv.weight")) and "linear_attn.norm" not in name:
                p.normal_(0.0, 0.1)
            if name.endswith("ple.conv1d.weight"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    if tokenizer:
        build_tokenizer(out_dir, cfg.vocab_size, int(cfg.eos_token_id), int(cfg.pad_token_id or 0))
    return out_dir


def split_experts(sd: dict) -> dict:
    """Rewrite a state dict's fused experts (``mlp.experts.gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I]; the
    target's and the MTP head's) into the per-expert format, ``mlp.experts.{e}.{gate,up,down}_proj.weight``."""
    for k in [k for k in sd if k.endswith("experts.gate_up_proj")]:
        base = k[: -len(".gate_up_proj")]
        gu, dn = sd.pop(k), sd.pop(base + ".down_proj")
        I = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            sd[f"{base}.{e}.gate_proj.weight"] = gu[e, :I].clone()
            sd[f"{base}.{e}.up_proj.weight"] = gu[e, I:].clone()
            sd[f"{base}.{e}.down_proj.weight"] = dn[e].clone()
    return sd


if __name__ == "__main__":
    import sys

    print(build_checkpoint(sys.argv[1]))
