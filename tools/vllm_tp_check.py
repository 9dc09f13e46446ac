"""Tensor parallelism of the qwen4exp vLLM plugin: TP=N against TP=1, same checkpoint, prompts and engine settings.

    python tools/vllm_tp_check.py --out bench_out/tp2 [--models fn4] [--tp 2] [--graphs]

Checkpoints and prompts are ``tools/vllm_gpu_check.py``'s: ``fn4`` (random, FN widths, 4 layers: 3 GDN + 1 QSA,
64 experts, real vocab, QSA budget 2048, prompts up to 3,000 tokens so the indexer selects; its GDN heads are 128
wide, so on GPUs vLLM's GDN layer runs and its heads are sharded), ``tiny`` (the tests' checkpoint; a CPU smoke run,
where ``tools/vllm_offline.py`` binds one share of the cores per rank). Both engines: bf16, eager (``--graphs``:
vLLM's default CUDA graphs), chunked prefill with all prompts batched, greedy with ``ignore_eos``, the rank-1 token
at every prompt position (teacher-forced) and the top-20 logprobs of every generated token.

Printed per model: the TP=N ranks' partition sizes that differ from TP=1 (what is sharded), whether the greedy
tokens are identical (else the first mismatch and both runs' top-2 logprobs there: a near-tie or not), and the
teacher-forced top-1 agreement between the two runs. ``results.json`` in --out. Exit status 1 when greedy tokens
differ other than at a one-step bf16 tie (``near_tie``: both tokens within one bf16 logit step of each other in both
runs, the mark of another reduction order) or a layer that must be sharded is not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from vllm_gpu_check import GEN, _prompts, build  # noqa: E402  (also puts the repo root and tests/ on sys.path)


TOPK = 20  # logprobs kept per generated token (enough to find both runs' tokens at a greedy difference)


def run(d: str, prompts, eng: dict, tp: int, graphs: bool, work: str) -> dict:
    import torch

    from vllm_offline import run_offline

    engine = dict(dtype="bfloat16", enforce_eager=not (graphs and torch.cuda.is_available()),
                  skip_tokenizer_init=True, max_num_seqs=8, enable_prefix_caching=False, enable_chunked_prefill=True,
                  gpu_memory_utilization=0.5, seed=0, tensor_parallel_size=tp)
    engine.update(eng)
    spec = dict(model=d, engine=engine, prompts=prompts, prompt_top1=True, tp_layout=True,
                sampling=dict(temperature=0.0, max_tokens=GEN, ignore_eos=True, prompt_logprobs=1, logprobs=TOPK,
                              detokenize=False))
    return run_offline(spec, work, timeout=float(os.environ.get("QWEN4EXP_CHECK_TIMEOUT", 240)))


def near_tie(row_one: dict, row_many: dict, a: int, b: int) -> bool:
    """At a greedy difference (TP=1 picked a, TP=N picked b): are a and b within one quantum of each other in both
    runs? Logits are bf16, so logprobs in one binade move in steps of one bf16 spacing (the quantum: the smallest
    gap between distinct values of the row's top logprobs); another reduction order (TP's all-reduce) moves a logit
    at a rounding boundary by one step. A difference of more than one step in either run is not such a tie."""
    if not all(t in r for t in (a, b) for r in (row_one, row_many)):
        return False
    vals = sorted(set(row_one.values()), reverse=True)
    gaps = [x - y for x, y in zip(vals, vals[1:]) if x - y > 1e-6]
    if not gaps:
        return False
    q = min(gaps) * 1.001
    return abs(row_one[a] - row_one[b]) <= q and abs(row_many[a] - row_many[b]) <= q


def compare(one: dict, many: dict) -> dict:
    full = one["tp_layout"][0]["partitions"]
    split = sorted({k for r in many["tp_layout"] for k, v in r["partitions"].items() if v != full.get(k)})
    ranks = sorted((r["tp_rank"], r["tp_size"]) for r in many["tp_layout"])
    out = dict(ranks=ranks, sharded=[f"{k}: {full[k]} -> {[r['partitions'][k] for r in many['tp_layout']]}"
                                     for k in split])
    # must be sharded whatever the GDN implementation: vocab rows of embedding and head, routed-expert width
    need = [k for k in full if k in ("model.embed_tokens.num_embeddings_per_partition",
                                     "lm_head.num_embeddings_per_partition")
            or k.endswith(".routed_experts.intermediate_size_per_partition")]
    out["not_sharded"] = [k for k in need if k not in split]
    mism = []
    for i, (a, b) in enumerate(zip(one["tokens"], many["tokens"])):
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is not None:
            top = [sorted(r["logprobs"][i][j].items(), key=lambda t: -t[1])[:2] for r in (one, many)]
            tie = near_tie(one["logprobs"][i][j], many["logprobs"][i][j], a[j], b[j])
            mism.append(dict(prompt=i, position=j, tp1=a[j], tpn=b[j], top2_tp1=top[0], top2_tpn=top[1],
                             near_tie=tie))
    out["greedy_mismatches"] = mism
    agree = total = 0
    for a, b in zip(one["prompt_top1"], many["prompt_top1"]):
        agree += sum(x == y for x, y in zip(a, b))
        total += len(a)
    out["teacher_forced_top1_agree"] = f"{agree}/{total}"
    # greedy streams must agree up to their first difference, and that difference must be a one-step bf16 tie
    # (random-weight checkpoints have nearly flat logits: such ties are common there, rare on trained ones)
    out["ok"] = (all(m["near_tie"] for m in mism) and not out["not_sharded"]
                 and len(ranks) == many["tp_layout"][0]["tp_size"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out/vllm_tp_check")
    ap.add_argument("--models", default="fn4")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--graphs", action="store_true", help="vLLM's default CUDA graphs instead of eager (GPU)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results, ok = {}, True
    for name in args.models.split(","):
        t0 = time.perf_counter()
        d, spec, eng = build(name, args.out)
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        tc = cfg.get("text_config", cfg)
        eos = tc["eos_token_id"][0] if isinstance(tc["eos_token_id"], list) else tc["eos_token_id"]
        prompts = _prompts(tc["vocab_size"], eos, spec)
        res = {}
        for tp in (1, args.tp):
            res[tp] = run(d, prompts, eng, tp, args.graphs, os.path.join(args.out, f"{name}-tp{tp}"))
            print(f"[{name}] TP={tp}: engine start {res[tp]['startup_s']:.0f}s, generate {res[tp]['run_s']:.1f}s",
                  flush=True)
        r = compare(res[1], res[args.tp])
        r["seconds"] = round(time.perf_counter() - t0)
        results[name] = r
        ok = ok and r["ok"]
        print(f"[{name}] TP={args.tp} vs TP=1:", flush=True)
        for k, v in r.items():
            print(f"  {k}:", "\n    ".join([""] + [str(x) for x in v]) if isinstance(v, list) and v else v)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("PASS" if ok else "FAIL", {k: v["ok"] for k, v in results.items()})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
