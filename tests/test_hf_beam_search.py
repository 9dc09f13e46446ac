"""Beam search in the HF reference (``generate(num_beams > 1)``) on the trained tiny checkpoint (fp32, CPU).

The hybrid cache (GDN conv + recurrent state, QSA K/V + block keys + open block, PLE n-gram / conv state) is reordered
along the beams after every step. An independent brute-force beam search, which runs the model WITHOUT a cache (a
full forward over every hypothesis at every step), must pick the same sequences with the same scores as
``generate`` does on a left-padded batch of two prompts of different lengths.
"""

import os

import pytest
import torch

import qwen4exp
from qwen4exp import Qwen4ExpForCausalLM

CKPT = os.path.join(os.path.dirname(qwen4exp.__file__), "assets", "tiny-coder")
NEW = 8  # new tokens per hypothesis
K = 4  # beams

PROMPTS = [
    'def read_lines(path):\n    """Return the stripped lines of a text file."""\n    with open(path) as f:\n'
    '        return [line.strip() for line in f]\n\n\ndef count_words(text):\n'
    '    """Count how often each word occurs in a text."""\n    counts = {}\n    for word in text.split():\n'
    '        counts[word] = counts.get(word, 0) + 1\n    return counts\n\n\ndef most_common(counts, n):\n',
    "import os\n\n\ndef list_files(root):\n",
]


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    m = Qwen4ExpForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(CKPT)
    rows = [tok(p)["input_ids"] for p in PROMPTS]
    assert len(rows[0]) > m.config.indexer_budget > len(rows[1])  # one prompt past the QSA budget, one below
    S = max(map(len, rows))
    pad = 0
    ids = torch.full((len(rows), S), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, S - len(r):] = torch.tensor(r)
        mask[b, S - len(r):] = 1
    return m, rows, ids, mask


def _gen_kwargs():
    # no EOS (every hypothesis runs to max_new_tokens) and no length penalty: a hypothesis scores the plain sum of
    # its tokens' log-probabilities, as the brute-force reference below does
    return dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                length_penalty=0.0, early_stopping=True)


@torch.no_grad()
def brute_force_beams(m, prompt: list[int], k: int, steps: int) -> list[tuple[list[int], float]]:
    """Keep the top-k (sum of log-softmax) continuations each step; every step re-runs the model from scratch on
    every hypothesis (no cache). -> [(new tokens, score)] best first."""
    hyps, scores = [[]], torch.zeros(1, dtype=torch.float64)
    for _ in range(steps):
        x = torch.tensor([prompt + h for h in hyps])
        logp = torch.log_softmax(m(x, use_cache=False).logits[:, -1].double(), -1)
        cand = (scores[:, None] + logp).flatten()
        top = cand.topk(k)
        V = logp.shape[-1]
        hyps = [hyps[i // V] + [i % V] for i in top.indices.tolist()]
        scores = top.values
    return list(zip(hyps, scores.tolist()))


def test_num_beams_1_equals_greedy(setup):
    m, rows, ids, mask = setup
    kw = _gen_kwargs()
    greedy = m.generate(ids, attention_mask=mask, **kw)
    beams1 = m.generate(ids, attention_mask=mask, num_beams=1, **kw)
    assert torch.equal(greedy, beams1)
    for b, r in enumerate(rows):  # a 1-beam brute-force search is greedy decoding too
        assert greedy[b, ids.shape[1]:].tolist() == brute_force_beams(m, r, 1, NEW)[0][0]


def test_beam_search_matches_brute_force_reference(setup):
    m, rows, ids, mask = setup
    out = m.generate(ids, attention_mask=mask, num_beams=K, num_return_sequences=K, output_scores=True,
                     return_dict_in_generate=True, **_gen_kwargs())
    S = ids.shape[1]
    assert out.sequences.shape == (len(rows) * K, S + NEW)
    seqs, scores = out.sequences.view(len(rows), K, -1), out.sequences_scores.view(len(rows), K)
    for b, r in enumerate(rows):
        ref = brute_force_beams(m, r, K, NEW)
        assert torch.equal(seqs[b, :, :S], ids[b].expand(K, -1))  # the left-padded prompt is kept as given
        assert [s[S:].tolist() for s in seqs[b]] == [h for h, _ in ref]
        torch.testing.assert_close(scores[b].double(), torch.tensor([s for _, s in ref], dtype=torch.float64),
                                   atol=1e-4, rtol=0)
        assert ref[0][1] > ref[1][1] + 1e-3  # the best hypothesis is not a near-tie (the comparison is meaningful)
    # the best sequence alone (num_return_sequences=1) is the same
    best = m.generate(ids, attention_mask=mask, num_beams=K, **_gen_kwargs())
    assert torch.equal(best, seqs[:, 0])
    # beams differ from greedy here (otherwise this test would not exercise the reordering much)
    assert not torch.equal(best, m.generate(ids, attention_mask=mask, **_gen_kwargs()))


@torch.no_grad()
def test_cache_row_selection_copies_states(setup):
    """select_rows duplicates rows into independent copies: after [1, 1, 0, 0], feeding each row its own tokens gives
    the logits of a fresh no-cache forward over the full sequence."""
    m, rows, _, _ = setup
    a, b = rows[0][:70], rows[1]
    cache = m.new_cache(2)
    L = max(len(a), len(b))
    x = torch.zeros(2, L, dtype=torch.long)
    msk = torch.zeros_like(x)
    for i, r in enumerate((a, b)):
        x[i, L - len(r):], msk[i, L - len(r):] = torch.tensor(r), 1
    m(x, attention_mask=msk, past_key_values=cache)
    cache.reorder_cache(torch.tensor([1, 1, 0, 0]))
    assert cache.batch_size == 4 and cache.lengths.tolist() == [len(b), len(b), len(a), len(a)]
    bases = [b, b, a, a]
    conts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19], [20, 21, 22, 23, 24]]
    msk4 = torch.cat([msk[[1, 1, 0, 0]], torch.ones(4, 5, dtype=torch.long)], 1)
    got = m(torch.tensor(conts), attention_mask=msk4, past_key_values=cache).logits
    for i in range(4):
        ref = m(torch.tensor([bases[i] + conts[i]]), use_cache=False).logits[0, -5:]
        torch.testing.assert_close(got[i], ref, atol=1e-4, rtol=1e-4)


def test_mtp_with_beams_is_refused(setup):
    m, rows, _, _ = setup
    assert m.mtp is not None
    x = torch.tensor([rows[1]])
    with pytest.raises(NotImplementedError, match="beam search"):
        m.generate(x, use_mtp=True, num_beams=2, max_new_tokens=4)
    with pytest.raises(NotImplementedError, match="num_return_sequences"):
        m.generate(x, use_mtp=True, num_return_sequences=2, max_new_tokens=4)
