"""Seeded random prompts shared by the parity and vLLM tests, and the offline vLLM engines' common settings
(tests/test_vllm_offline.py, tests/test_vllm_tp.py)."""

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


def prompt_ids(n, vocab, eos, seed, eos_at=()):
    """``prompt`` as a list of ints (what vLLM takes as ``prompt_token_ids``), no EOS unless placed."""
    return prompt(n, vocab, eos, seed, eos_at).tolist()


OFFLINE_MAX_LEN = 512  # the offline engines' max_model_len
OFFLINE_GEN = 12  # greedy tokens each offline check generates


def offline_engine(**kw):
    """vllm.LLM arguments of the offline checks: bf16, eager, no tokenizer, all prompt logprobs, no prefix cache;
    ``kw`` on top."""
    e = dict(dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=OFFLINE_MAX_LEN,
             max_num_seqs=8, max_logprobs=-1, enable_prefix_caching=False)
    e.update(kw)
    return e
