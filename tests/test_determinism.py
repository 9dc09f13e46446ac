"""Greedy determinism of the vLLM plugin (offline engine, CPU, tiny-coder): across repeated runs and across batch
compositions, in fp32 and bf16. One engine per dtype runs every generate call below in sequence.

Per target prompt: 5 runs alone, 2 runs inside one batch of 8 (the target + 7 other requests of other lengths), and
one run inside a second, different batch of 8. Repeats of the same composition must give identical tokens in both
dtypes (nothing in the engine may depend on anything but the batch). fp32: every composition gives the alone tokens.
bf16: a different batch can change the GEMM blocking and so the rounding, so a greedy token may flip where the two
best logits are tied to within bf16 rounding; where a batch run first differs from the alone run, both runs' top-2
raw logits at that step (``logprobs_mode="raw_logits"``, the model's bf16 logits) must be within ``TIE_ULPS`` bf16
ulps of each other (ulp at the larger logit's magnitude) and be the same two tokens. The count of such flips is
printed.
"""

import os

import pytest

from near_tie import first_flip

pytestmark = pytest.mark.vllm

CKPT = os.path.join(os.path.dirname(__file__), "..", "qwen4exp", "assets", "tiny-coder")
GEN = 16
REPEATS = 5  # runs alone
BATCH_REPEATS = 2  # runs of composition A
TIE_ULPS = 2  # a flip needs the two best logits within this many bf16 ulps in both runs
TEXTS = [
    "def fibonacci(n):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        ",
    "def read_lines(path, encoding='utf-8'):\n    \"\"\"Return the lines of a text file.\"\"\"\n"
    "    with open(path, encoding=encoding) as f:\n        return [line.rstrip('\\n') for line in f]\n\n\n"
    "def write_lines(path, lines, encoding='utf-8'):\n    \"\"\"Write lines to a text file.\"\"\"\n"
    "    with open(path, 'w', encoding=encoding) as f:\n        for line in lines:\n            ",
]
N_TARGETS = len(TEXTS)
FILLER_LENS = (3, 17, 60, 130, 200, 9, 90, 150, 44, 180, 25, 110, 70, 5)  # 14 others: two sets of 7


def _layout():
    """prompts (token-id lists) and batches: alone x5, composition A x5, composition B x1 per target;
    ``index[t]`` = the prompt indices of target t per run kind."""
    from prompts import prompt
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(CKPT, "tokenizer.json"))
    targets = [tok.encode(t).ids for t in TEXTS]
    fill = [prompt(n, 2048, 2, seed=100 + i, eos_at=()).tolist() for i, n in enumerate(FILLER_LENS)]
    prompts, batches, index = [], [], []
    for t, p in enumerate(targets):
        idx = {"alone": [], "A": [], "B": []}
        for _ in range(REPEATS):
            prompts.append(p)
            idx["alone"].append(len(prompts) - 1)
            batches.append([len(prompts) - 1])
        for kind, reps, others in (("A", BATCH_REPEATS, fill[:7]), ("B", 1, fill[7:])):
            for _ in range(reps):
                b = []
                for j, o in enumerate(others):  # the target at a position that moves with t
                    if j == t % 8:
                        prompts.append(p)
                        idx[kind].append(len(prompts) - 1)
                        b.append(len(prompts) - 1)
                    prompts.append(o)
                    b.append(len(prompts) - 1)
                if t % 8 == 7:
                    prompts.append(p)
                    idx[kind].append(len(prompts) - 1)
                    b.append(len(prompts) - 1)
                batches.append(b)
        index.append(idx)
    return prompts, batches, index


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from vllm_offline import run_offline

    prompts, batches, index = _layout()
    assert all(len(b) == 8 for b in batches if len(b) > 1)
    out = {}
    for dtype in ("float32", "bfloat16"):
        spec = dict(model=CKPT, prompts=prompts, batches=batches,
                    engine=dict(dtype=dtype, enforce_eager=True, skip_tokenizer_init=True, max_model_len=512,
                                max_num_seqs=8, enable_prefix_caching=False, logprobs_mode="raw_logits"),
                    sampling=dict(temperature=0.0, max_tokens=GEN, ignore_eos=True, detokenize=False, logprobs=2))
        out[dtype] = run_offline(spec, str(tmp_path_factory.mktemp(dtype)), timeout=420)
    return dict(index=index, **out)


def _check(run, index, exact: bool):
    toks, lps = run["tokens"], run["logprobs"]
    flips, compared = [], 0
    for t, idx in enumerate(index):
        alone = idx["alone"][0]
        assert all(len(toks[i]) == GEN for i in sum(idx.values(), [])), t
        for kind in ("alone", "A"):  # the same composition again: identical, in every dtype
            assert all(toks[i] == toks[idx[kind][0]] for i in idx[kind]), (t, kind)
        for kind in ("A", "B"):
            compared += 1
            f = first_flip(toks[alone], lps[alone], toks[idx[kind][0]], lps[idx[kind][0]])
            if f is not None:
                flips.append((t, kind, *f))
    if exact:
        assert not flips, f"greedy tokens depend on the batch in fp32: {flips}"
    return flips, compared


def test_fp32_identical_across_repeats_and_batches(runs):
    flips, compared = _check(runs["float32"], runs["index"], exact=True)
    print(f"fp32 engine start-up {runs['float32']['startup_s']:.0f} s, runs {runs['float32']['run_s']:.0f} s")
    print(f"fp32: {compared} batch runs of {N_TARGETS} targets equal their alone run; repeats identical")


def test_bf16_repeats_identical_and_batch_flips_are_near_ties(runs):
    flips, compared = _check(runs["bfloat16"], runs["index"], exact=False)
    print(f"bf16: {len(flips)} of {compared} batch runs differ from the alone run")
    for t, kind, step, gap_a, gap_o, ulp, same in flips:
        print(f"  target {t} batch {kind}: first differs at step {step}; top-2 gap alone {gap_a:.4g}, "
              f"in the batch {gap_o:.4g}, bf16 ulp {ulp:.4g}")
        assert same, f"target {t} batch {kind} step {step}: the runs' top-2 tokens differ"
        assert gap_a <= TIE_ULPS * ulp and gap_o <= TIE_ULPS * ulp, (
            f"target {t} batch {kind} step {step}: a flip without a near-tie (gaps {gap_a}, {gap_o}, ulp {ulp})")
