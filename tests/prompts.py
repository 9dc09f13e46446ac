"""Seeded random prompts shared by the parity and vLLM tests."""

import torch


def prompt(n, vocab, eos, seed=0, eos_at=(7, 8, 40)):
    """n token ids in [2, vocab) without accidental EOS, with EOS placed at the positions ``eos_at`` (< n)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n,), generator=g)
    ids[ids == eos] = eos + 1
    for p in eos_at:
        if p < n:
            ids[p] = eos
    return ids
