"""The tiny checkpoint's corpus and tokenizer: the Python standard library's own source, nothing downloaded.

Corpus: every ``.py`` file of the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``),
except the test suites, ``site-packages``, the GUI packages (tkinter, idlelib: long runs of near-identical
wrapper code) and a few generated or data-only modules, in sorted relative-path order.
A file is held out (validation) when the CRC-32 of its relative path falls in the lowest ``HELDOUT_PERMILLE``/1000
of the range, so the split is deterministic and does not depend on the file count.

Tokenizer: byte-level BPE (``tokenizers``), trained on the training files only, with three special tokens for a
ChatML-style chat format. Saved as ``tokenizer.json`` + ``tokenizer_config.json`` (with a Jinja ``chat_template``)
so ``transformers.AutoTokenizer`` and vLLM both load it.

    python recipes/tokenizer_tiny.py OUT_DIR [--vocab-size 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import zlib

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
HELDOUT_PERMILLE = 40

# The chat template is the committed tiny-coder's (one definition): ChatML turns as Qwen models use them (an
# optional system turn, then turns; the generation prompt opens an assistant turn), with tools, tool calls and tool
# responses rendered as Qwen3.5's template renders them (vLLM's ``qwen3_coder`` tool parser reads its calls).
_ASSET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "qwen4exp", "assets", "tiny-coder")
with open(os.path.join(_ASSET, "tokenizer_config.json")) as _f:
    CHAT_TEMPLATE = json.load(_f)["chat_template"]

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "__pycache__", "idlelib",
              "turtledemo", "ensurepip", "pydoc_data", "encodings", "config-3", "tkinter"}
_SKIP_FILES = {"_pydecimal.py", "pydoc_topics.py", "_aix_support.py"}
_SKIP_PREFIXES = ("test_", "_sysconfigdata")


_STDLIB: str | None = None


def set_stdlib_dir(path: str | None) -> None:
    """Read the corpus from a copy of a standard library (its ``.py`` tree) instead of the running one's."""
    global _STDLIB
    _STDLIB = path


def stdlib_dir() -> str:
    return _STDLIB or sysconfig.get_paths()["stdlib"]


def corpus_files(split: str = "train") -> list[str]:
    """Relative paths (sorted) of the stdlib files of one split: ``train`` or ``heldout``."""
    root = stdlib_dir()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith(("config-", "test")))
        for f in files:
            if not f.endswith(".py") or f in _SKIP_FILES or f.startswith(_SKIP_PREFIXES):
                continue
            rel = os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
            held = zlib.crc32(rel.encode()) % 1000 < HELDOUT_PERMILLE
            if held == (split == "heldout"):
                out.append(rel)
    return sorted(out)


def read_file(rel: str) -> str | None:
    """The file's text (None when it is not UTF-8)."""
    try:
        with open(os.path.join(stdlib_dir(), rel), encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def train_tokenizer(vocab_size: int = 2048, files: list[str] | None = None):
    """Byte-level BPE over the training files (deterministic for a given stdlib)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = corpus_files("train") if files is None else files
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [t for t in (read_file(r) for r in files) if t]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok, out_dir: str, model_max_length: int = 4096) -> dict:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json; -> the special token ids."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for s, i in ids.items()}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "errors": "replace",
        "split_special_tokens": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": IM_END, "pad_token": ENDOFTEXT}, f, indent=2)
        f.write("\n")
    gen = {"bos_token_id": None, "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], "pad_token_id": ids[ENDOFTEXT],
           "do_sample": False}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    return ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--vocab-size", type=int, default=2048)
    a = ap.parse_args(argv)
    tok = train_tokenizer(a.vocab_size)
    ids = save_tokenizer(tok, a.out_dir)
    print(f"tokenizer: {tok.get_vocab_size()} tokens, specials {ids} -> {a.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
