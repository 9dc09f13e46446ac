"""The main job: build (once) a tiny Qwen4Exp checkpoint and generate from it.

``python -m qwen4exp.demo`` builds ``.cache/demo-tiny`` (a random tiny checkpoint in the official format, every
mechanism active: GDN + QSA layers, 4 HC streams, PLE, MoE with shared expert, MTP head) and greedily generates from it
with the HF reference, printing tokens/s.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def build_tiny_checkpoint(path: str, seed: int = 0) -> str:
    from . import presets
    from .hf import Qwen4ExpForCausalLM

    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    torch.manual_seed(seed)
    cfg = presets.tiny_text(mtp_num_hidden_layers=1, vocab_size=512)
    Qwen4ExpForCausalLM(cfg).save_pretrained(path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", default=os.path.join(".cache", "demo-tiny"))
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    from .hf import Qwen4ExpForCausalLM

    ck = build_tiny_checkpoint(args.checkpoint)
    model = Qwen4ExpForCausalLM.from_pretrained(ck, dtype=torch.float32)
    cfg = model.config
    print(f"qwen4exp demo: {cfg.num_hidden_layers} layers {cfg.layer_types}, hidden {cfg.hidden_size}, "
          f"{cfg.hc_count} streams, PLE layers {cfg.ple_layer_ids}, QSA budget {cfg.indexer_budget}")
    ids = torch.randint(2, cfg.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        dt = time.perf_counter() - t0
    new = out[0, ids.shape[1]:].tolist()
    print(f"generated {len(new)} tokens in {dt:.2f} s ({len(new) / dt:.1f} tok/s, HF reference, CPU): {new}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
