"""Prefill tokens/s and decode ms/token of our HF reference (``qwen4exp.Qwen4ExpForCausalLM``) against upstream
transformers' ``Qwen4ExpForCausalLM`` on the same random checkpoint, on the CPU.

    python benchmarks/bench_hf_reference.py [--lengths 512,1024,2048,4096,8192] [--repeats 3] [--decode-steps 16]
                                            [--dtype float32|bfloat16] [--threads 2] [--skip-upstream-above N]
                                            [--out bench_hf_reference.csv]

Model (``qwen4exp.presets.tiny_text`` with these overrides; every mechanism active): 4 layers (GDN, QSA, GDN, QSA),
hidden 256, vocab 8192, 4 HC streams (low rank 32); QSA: 4 query heads / 2 KV heads x 64 (partial RoPE 0.5),
indexer 4 heads x 64, budget 256 tokens in blocks of 4; GDN: 2 key / 4 value heads x 64, conv kernel 4; MoE: 8
experts top-2, expert width 256, shared expert 256; PLE on the first layer (n-grams 2-3, 2 hashed heads each, 64 dims).
Upstream builds the random weights (its own init, norm weights nudged off zero so they matter) and saves them in the
official layout; our model loads that checkpoint with ``from_pretrained``.

Per prompt length L, for each implementation in turn (interleaved, so background load hits both alike):
  prefill: one forward over a random L-token prompt with use_cache=True -> L / seconds;
  decode:  then ``--decode-steps`` greedy single-token steps through the returned cache -> ms per step.
A warm-up run (a short prompt plus two decode steps) precedes the timings of each implementation; prefill is the
median of ``--repeats`` runs, decode the median over all timed steps of those runs (medians, so that a stall of the
machine during a few steps does not decide the result). The last column is the largest |logit| difference between
the two implementations on the prompt's last token (a sanity check that both compute the same model).
Upstream's QSA indexer loops in Python over every query, so its long prefills are slow: ``--skip-upstream-above``
leaves upstream out for longer prompts.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time

import torch

import qwen4exp
from qwen4exp import presets


def build_config(vocab_size: int):
    return presets.tiny_text(
        num_hidden_layers=4, hidden_size=256, vocab_size=vocab_size, indexer_budget=256, indexer_compress_ratio=4,
        full_attention_every=2, head_dim=64, linear_head_dim=64, indexer_head_dim=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256, hc_lowrank=32,
        ple_embed_dim=64, max_position_embeddings=16384, split_ngram_parts=1, eos_token_id=1)


def build_upstream(cfg, seed: int = 0):
    from transformers.models.qwen4_exp import configuration_qwen4_exp as UC
    from transformers.models.qwen4_exp import modeling_qwen4_exp as UM

    d = cfg.to_dict()
    for k in ("model_type", "transformers_version", "architectures", "mtp_num_hidden_layers",
              "mtp_use_dedicated_embeddings", "mamba_ssm_dtype"):
        d.pop(k, None)
    ucfg = UC.Qwen4ExpTextConfig(**d)
    torch.manual_seed(seed)
    model = UM.Qwen4ExpForCausalLM(ucfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            elif "ple.conv1d" in name:
                p.normal_(0, 0.3, generator=g)
    return model


@torch.no_grad()
def run_once(model, ids: torch.Tensor, decode_steps: int) -> tuple[float, list[float], torch.Tensor]:
    """-> (prefill seconds, seconds of each decode step, last-token logits of the prompt)."""
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    prefill = time.perf_counter() - t0
    last = out.logits[0, -1].float().clone()
    cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    steps = []
    for _ in range(decode_steps):
        t0 = time.perf_counter()
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        steps.append(time.perf_counter() - t0)
    return prefill, steps, last


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192", help="comma-separated prompt lengths")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per length and implementation (median)")
    ap.add_argument("--decode-steps", type=int, default=16, help="decode steps after each prefill")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--skip-upstream-above", type=int, default=None, metavar="N",
                    help="do not run upstream for prompts longer than N tokens")
    ap.add_argument("--no-upstream", action="store_true", help="time our implementation only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the table as CSV here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    cfg = build_config(args.vocab_size)

    upstream = build_upstream(cfg, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        upstream.save_pretrained(tmp)
        ours = qwen4exp.Qwen4ExpForCausalLM.from_pretrained(tmp, dtype=dtype)
    upstream = upstream.to(dtype)
    if args.no_upstream:
        upstream = None

    models = {"ours": ours, "upstream": upstream}
    gen = torch.Generator().manual_seed(args.seed)
    warm = torch.randint(2, cfg.vocab_size, (1, 64), generator=gen)
    for m in models.values():
        if m is not None:
            run_once(m, warm, 2)

    print(f"# {cfg.num_hidden_layers} layers {cfg.layer_types}, hidden {cfg.hidden_size}, QSA budget "
          f"{cfg.indexer_budget}/{cfg.indexer_compress_ratio}, {args.dtype}, {args.threads} threads, "
          f"median of {args.repeats}, {args.decode_steps} decode steps, {os.cpu_count()} CPUs, load average "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()), flush=True)
    header = ["prompt", "prefill_tok_s_ours", "prefill_tok_s_upstream", "prefill_speedup",
              "decode_ms_ours", "decode_ms_upstream", "decode_speedup", "max_abs_logit_diff"]
    fmt = "{:>7} {:>12} {:>12} {:>8} {:>11} {:>11} {:>8} {:>10}"
    print(fmt.format("prompt", "prefill tok/s", "", "", "decode ms/tok", "", "", "max"))
    print(fmt.format("tokens", "ours", "upstream", "ratio", "ours", "upstream", "ratio", "|dlogit|"))
    rows = []
    for L in lengths:
        ids = torch.randint(2, cfg.vocab_size, (1, L), generator=gen)
        run_up = upstream is not None and (args.skip_upstream_above is None or L <= args.skip_upstream_above)
        times = {"ours": [], "upstream": []}
        logits = {}
        for _ in range(args.repeats):
            for name in ("ours", "upstream"):
                if name == "upstream" and not run_up:
                    continue
                tp, steps, last = run_once(models[name], ids, args.decode_steps)
                times[name].append((tp, steps))
                logits[name] = last
        med = {k: (statistics.median(t for t, _ in v), statistics.median(d for _, ds in v for d in ds)) if v else None
               for k, v in times.items()}
        o, u = med["ours"], med["upstream"]
        row = {"prompt": L, "prefill_tok_s_ours": L / o[0], "decode_ms_ours": o[1] * 1e3,
               "prefill_tok_s_upstream": L / u[0] if u else None, "decode_ms_upstream": u[1] * 1e3 if u else None,
               "prefill_speedup": u[0] / o[0] if u else None, "decode_speedup": u[1] / o[1] if u else None,
               "max_abs_logit_diff": float((logits["ours"] - logits["upstream"]).abs().max()) if u else None}
        rows.append(row)

        def f(x, spec):
            return "-" if x is None else format(x, spec)

        print(fmt.format(L, f(row["prefill_tok_s_ours"], ".0f"), f(row["prefill_tok_s_upstream"], ".0f"),
                         f(row["prefill_speedup"], ".2f") + ("x" if u else ""), f(row["decode_ms_ours"], ".1f"),
                         f(row["decode_ms_upstream"], ".1f"), f(row["decode_speedup"], ".2f") + ("x" if u else ""),
                         f(row["max_abs_logit_diff"], ".1e")), flush=True)
    print("# ratio = upstream time / our time (> 1: ours is faster); load average (1/5/15 min) at the end: "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    if args.out:
        with open(args.out, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=header)
            w.writeheader()
            for r in rows:
                w.writerow({k: ("" if r[k] is None else (float(f"{r[k]:.5g}") if isinstance(r[k], float) else r[k]))
                            for k in header})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
