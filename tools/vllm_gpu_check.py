"""Teacher-forced correctness of vLLM on a GPU: the qwen4exp plugin and upstream's in-tree qwen4_exp, each against
our HF reference's fp32 logits, beside the HF reference's own bf16 run (the bar), in one run.

    python tools/vllm_gpu_check.py --out bench_out/vllm_gpu_check [--models tiny,coder,fn4] [--impls ours,upstream]

Models: ``tiny`` (random tiny checkpoint of the tests, QSA budget 16), ``coder`` (the trained tiny-coder asset;
``coder-k512``: with a 512-block QSA budget, the smallest upstream's top-k kernel takes),
``fn4`` (random, Qwen3.8-Flash-Next widths, 4 layers: 3 GDN + 1 QSA, 64 experts, real vocab and QSA budget 2048;
prompts up to 3,000 tokens so the indexer selects); ``NAME-nvfp4``: model NAME as ``qwen4exp.quant.export`` (the
recipe's writer) quantizes it (NVFP4 W4A4 experts, block-FP8 MTP experts where the widths allow, FP8 PLE table), the
HF reference dequantizing it; ``fn4-anchor``: fn4's shape with the upstream anchor's NVFP4 quantization_config and
dummy weights (loads? which MoE backend? generates?). Checkpoints built and HF references computed into ``--out``
are reused by a later run into the same directory (the reference only while the checkpoint's files are unchanged).
Rows also name the MoE backend vLLM logged, and the first
implementation's greedy tokens are compared with the others' (``greedy_match_len_vs_upstream``): where they part,
both engines ran the same context, and the fp32 reference's top-2 gap at that step says whether it was a near tie
(``greedy_parted_decisive_vs_upstream`` False: bf16 cannot decide it, a coin flip on random weights) or a real
disagreement (True).
Prompts: seeded random ids, EOS inside some. vLLM runs bf16 with vLLM's default CUDA graphs
(``QWEN4EXP_CHECK_EAGER=1``: eager; always eager on CPU), chunked prefill (mixed prefill + decode batches) and returns the rank-1 token of every prompt position
(``prompt_logprobs=1``); top-1 agreement with the fp32 argmax is counted over all positions. Also reported: greedy
tokens of vLLM vs the HF bf16 reference's greedy continuation (first mismatch). Table on stdout, ``results.csv``.

Decisive positions: on random weights the top two logits are often closer than bf16 can resolve, so which run is
"right" there is a coin flip. The HF bf16 run's own error of the fp32 top-1 vs top-2 gap (|gap_bf16 - gap_fp32|)
sets the noise level delta (its 99th percentile over all positions); a position is decisive when its fp32 gap
exceeds 2 * delta. A wrong top-1 there means an error twice the size of the bf16 reference's own, so
``decisive_vllm_wrong`` is held against ``decisive_hf_bf16_wrong`` (``no_worse_decisive``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

GEN = 16


def _dev() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a local smoke run of this script


def _prompts(V: int, eos: int, spec) -> list[list[int]]:
    from prompts import prompt

    return [prompt(n, V, eos, seed, eos_at).tolist() for n, seed, eos_at in spec]


def build(name: str, out: str):
    """-> (checkpoint dir, prompts, engine overrides)."""
    import torch

    from qwen4exp import Qwen4ExpForCausalLM, presets

    if name == "tiny":
        from tiny_checkpoint import build_checkpoint

        d = os.path.join(out, "tiny")
        if not os.path.exists(os.path.join(d, "model.safetensors")):
            build_checkpoint(d, seed=0)
        spec = [(300, 1, (50, 51, 120)), (37, 2, ()), (230, 3, (100,)), (5, 4, ()), (180, 5, (0, 90)),
                (64, 6, (63,)), (1, 7, ()), (260, 8, (200,))]
        return d, spec, dict(max_model_len=512, max_num_batched_tokens=64)
    if name == "coder":
        d = os.path.join(ROOT, "qwen4exp", "assets", "tiny-coder")
        spec = [(400, 11, (100,)), (120, 12, ()), (700, 13, (300, 301)), (33, 14, ())]
        return d, spec, dict(max_model_len=1024, max_num_batched_tokens=256)
    if name == "fn4":
        d = os.path.join(out, "fn4")
        if not os.path.exists(os.path.join(d, "model.safetensors")):
            cfg = presets.fn12l()
            kw = {k: v for k, v in cfg.to_dict().items() if k not in ("model_type", "transformers_version")}
            kw.update(num_hidden_layers=4, num_experts=64, ngram_vocab_size_base=20_000,
                      layer_types=["linear_attention"] * 3 + ["full_attention"])
            cfg = type(cfg)(**kw)
            torch.manual_seed(0)
            with torch.device(_dev()):
                m = Qwen4ExpForCausalLM(cfg)
            m.to(torch.bfloat16).cpu().save_pretrained(d)
            del m
            torch.cuda.empty_cache()
        spec = [(3000, 21, (1000, 1001)), (2600, 22, ()), (700, 23, (10,)), (100, 24, ())]
        return d, spec, dict(max_model_len=3200, max_num_batched_tokens=1024)
    if name == "coder-k512":  # tiny-coder with a QSA budget of 512 blocks (2,048 tokens: dense at these prompt
        # lengths), the smallest top-k upstream's persistent_topk kernel takes (512, 1024 or 2048; tiny-coder's 16 it
        # refuses), so that upstream can run the trained model
        import shutil

        src, spec, eng = build("coder", out)
        d = os.path.join(out, name)
        if not os.path.exists(os.path.join(d, "config.json")):
            shutil.copytree(src, d)
            with open(os.path.join(d, "config.json")) as f:
                cfg = json.load(f)
            cfg["indexer_budget"] = 512 * cfg.get("indexer_compress_ratio", 4)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f, indent=2)
        return d, spec, eng
    if name.endswith("-nvfp4"):  # the base model as our writer (the recipe's) quantizes it: NVFP4 W4A4 experts etc.
        from qwen4exp.quant.export import quantize_checkpoint

        d0, spec, eng = build(name[: -len("-nvfp4")], out)
        d = os.path.join(out, name)
        if not os.path.exists(os.path.join(d, "model.safetensors")):
            quantize_checkpoint(d0, d)
        return d, spec, eng
    if name == "fn4-anchor":  # fn4's shape with the upstream anchor's NVFP4 quantization_config, dummy weights
        from qwen4exp import presets

        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        cfg = presets.fn12l().to_dict()
        cfg.update(num_hidden_layers=4, num_experts=64, ngram_vocab_size_base=20_000,
                   layer_types=["linear_attention"] * 3 + ["full_attention"],
                   quantization_config=presets.anchor_nvfp4_quantization_config(),
                   architectures=["Qwen4ExpForCausalLM"], dtype="bfloat16")
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        return d, [(700, 23, (10,)), (100, 24, ())], dict(max_model_len=3200, max_num_batched_tokens=1024,
                                                          load_format="dummy")
    raise SystemExit(f"unknown model {name!r}")


def moe_backend(log: str) -> str:
    """The MoE backend vLLM logged (NVFP4: "Using 'HUMMING' NvFp4 MoE backend ..."), or our CPU dequantization."""
    m = re.findall(r"Using '(\w+)' NvFp4 MoE backend", log)
    if m:
        return "NVFP4:" + m[-1]
    if "routed-experts module(s) dequantized to" in log:
        return "dequantized"
    m = re.findall(r"Using (\S+) (?:\w+ )?MoE backend", log)
    return m[-1] if m else ""


def hf_reference(d: str, prompts):
    """fp32 argmax, bf16 argmax per position (positions 1..L-1 predicted from the prefix), bf16 greedy tokens; the
    fp32 gap between the top two logits (``gap``) and the bf16 run's error of that gap (``gap_err``)."""
    import torch

    from qwen4exp import Qwen4ExpForCausalLM

    res = {"gap": [], "gap_err": []}
    top2 = []
    for dt in (torch.float32, torch.bfloat16):
        m = Qwen4ExpForCausalLM.from_pretrained(d, dtype=dt, device=_dev()).eval()
        am, greedy = [], []
        with torch.no_grad():
            for i, p in enumerate(prompts):
                x = torch.tensor([p], device=_dev())
                lg = m(x).logits[0, :-1].float()
                am.append(lg.argmax(-1).cpu())
                if dt == torch.float32:
                    v, ix = lg.topk(2, dim=-1)
                    top2.append(ix)
                    res["gap"].append((v[:, 0] - v[:, 1]).cpu())
                else:
                    g16 = lg.gather(1, top2[i])
                    res["gap_err"].append(((g16[:, 0] - g16[:, 1]).cpu() - res["gap"][i]).abs())
                if dt == torch.bfloat16:
                    g = m.generate(x, max_new_tokens=GEN, do_sample=False) if hasattr(m, "generate") else None
                    greedy.append(g[0, len(p):].tolist() if g is not None else None)
        res[str(dt).split(".")[-1]] = am
        if dt == torch.bfloat16:
            res["greedy_bf16"] = greedy
        del m
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return res


def greedy_step_gaps(d: str, prompts, tokens) -> list:
    """Per prompt, the fp32 reference's top-2 logit gap at each step of the greedy continuation ``tokens`` (the
    logits predicting token i from the prompt and tokens[:i], teacher-forced)."""
    import torch

    from qwen4exp import Qwen4ExpForCausalLM

    m = Qwen4ExpForCausalLM.from_pretrained(d, dtype=torch.float32, device=_dev()).eval()
    out = []
    with torch.no_grad():
        for p, t in zip(prompts, tokens):
            x = torch.tensor([p + list(t)], device=_dev())
            v = m(x).logits[0, len(p) - 1: len(p) - 1 + len(t)].float().topk(2, dim=-1).values
            out.append((v[:, 0] - v[:, 1]).cpu())
    del m
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run_vllm(impl: str, d: str, prompts, eng: dict, work: str):
    from vllm_offline import run_offline

    import torch

    eager = os.environ.get("QWEN4EXP_CHECK_EAGER", "0") == "1" or not torch.cuda.is_available()
    engine = dict(dtype="bfloat16", enforce_eager=eager, skip_tokenizer_init=True, max_num_seqs=8,
                  enable_prefix_caching=False, enable_chunked_prefill=True, gpu_memory_utilization=0.5, seed=0)
    engine.update(eng)
    spec = dict(model=d, engine=engine, prompts=prompts, prompt_top1=True,
                env={"QWEN4EXP_VLLM": "0" if impl == "upstream" else "1"},
                sampling=dict(temperature=0.0, max_tokens=GEN, ignore_eos=True, prompt_logprobs=1, detokenize=False))
    return run_offline(spec, work, timeout=float(os.environ.get("QWEN4EXP_CHECK_TIMEOUT", 300)))


def _error(e: Exception) -> str:
    """What an implementation that refused the checkpoint said (its last error lines)."""
    msg = [ln.split("] ", 1)[-1].strip() for ln in str(e).strip().splitlines()]
    err = [ln for ln in msg if re.search(r"\w(Error|Exception)\b", ln) and "pydantic.dev" not in ln]
    return " / ".join(dict.fromkeys(err[-3:]))[:400] if err else (msg[-1] if msg else repr(e))


def _stamp(d: str) -> list:
    """What identifies a checkpoint's files: (name, size, mtime) of each."""
    return sorted((f, os.path.getsize(os.path.join(d, f)), os.path.getmtime(os.path.join(d, f)))
                  for f in os.listdir(d) if os.path.isfile(os.path.join(d, f)))


def decisive_mask(gap: list, gap_err: list) -> tuple[list, float]:
    """Per prompt, the positions whose fp32 top-2 gap exceeds twice the bf16 reference's 99th-percentile gap error
    (see the module doc), and that threshold."""
    import torch

    delta = float(torch.quantile(torch.cat(gap_err).float(), 0.99)) if gap_err else 0.0
    return [g > 2 * delta for g in gap], 2 * delta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out/vllm_gpu_check")
    ap.add_argument("--models", default="tiny,coder,fn4")
    ap.add_argument("--impls", default="ours,upstream")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import torch

    rows = []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        d, spec, eng = build(name, args.out)
        cfg = json.load(open(os.path.join(d, "config.json")))
        tc = cfg.get("text_config", cfg)
        eos = tc["eos_token_id"][0] if isinstance(tc["eos_token_id"], list) else tc["eos_token_id"]
        prompts = _prompts(tc["vocab_size"], eos, spec)
        if eng.get("load_format") == "dummy":  # no weights, no reference: does it load, which backend, generate
            for impl in args.impls.split(","):
                row = dict(model=name, impl=impl)
                try:
                    out = run_vllm(impl, d, prompts, eng, os.path.join(args.out, f"{name}-{impl}"))
                    row.update(startup_s=round(out["startup_s"], 1), moe_backend=moe_backend(out["log"]),
                               generated=sum(len(t) for t in out["tokens"]))
                except Exception as e:
                    row["error"] = _error(e)
                rows.append(row)
                print(json.dumps(row), flush=True)
            continue
        ref_path = os.path.join(args.out, f"{name}-hf-reference.pt")
        stamp = _stamp(d)
        old = torch.load(ref_path, weights_only=False) if os.path.exists(ref_path) else {}
        if old.get("prompts") == prompts and old.get("checkpoint") == stamp:  # same files, same prompts: reused
            ref = old
        else:
            ref = hf_reference(d, prompts)
            # kept: a vLLM run killed later can still be scored, and a later run into the same --out reuses it
            torch.save(dict(ref, prompts=prompts, checkpoint=stamp), ref_path)
        f32, b16 = ref["float32"], ref["bfloat16"]
        total = sum(len(a) for a in f32)
        agree_b = sum(int((a == b).sum()) for a, b in zip(f32, b16))
        dec, thr = decisive_mask(ref["gap"], ref["gap_err"])
        n_dec = sum(int(m.sum()) for m in dec)
        b_dec_wrong = sum(int(((a != b) & m).sum()) for a, b, m in zip(f32, b16, dec))
        print(f"[{name}] HF reference done in {time.perf_counter() - t0:.0f}s: bf16 top-1 {agree_b}/{total}",
              flush=True)
        for impl in args.impls.split(","):
            row = dict(model=name, impl=impl, positions=total, hf_bf16_agree=agree_b, decisive=n_dec,
                       decisive_gap=round(thr, 4), decisive_hf_bf16_wrong=b_dec_wrong)
            try:
                out = run_vllm(impl, d, prompts, eng, os.path.join(args.out, f"{name}-{impl}"))
                agree_v = v_only = b_only = v_dec_wrong = 0
                for a, b, t, m in zip(f32, b16, out["prompt_top1"], dec):
                    t = torch.tensor(t)
                    ok_v, ok_b = t == a, b == a
                    agree_v += int(ok_v.sum())
                    v_only += int((~ok_v & ok_b).sum())
                    b_only += int((ok_v & ~ok_b).sum())
                    v_dec_wrong += int((~ok_v & m).sum())
                gm = [next((i for i, (x, y) in enumerate(zip(g, h)) if x != y), len(g)) if h else None
                      for g, h in zip(out["tokens"], ref["greedy_bf16"])]
                row.update(vllm_agree=agree_v, only_vllm_wrong=v_only, only_hf_bf16_wrong=b_only,
                           no_worse=agree_v >= agree_b, decisive_vllm_wrong=v_dec_wrong,
                           no_worse_decisive=v_dec_wrong <= b_dec_wrong, startup_s=round(out["startup_s"], 1),
                           greedy_match_len_vs_hf_bf16=gm, moe_backend=moe_backend(out["log"]), tokens=out["tokens"])
            except Exception as e:  # an implementation that refuses the checkpoint: say what it said
                row["error"] = _error(e)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
        # the implementations' greedy tokens against each other (per prompt: how many agree before the first
        # difference), on the first implementation's row
        done = [r for r in rows if r["model"] == name and "tokens" in r]
        if len(done) > 1:
            # where two engines' greedy tokens part, both ran the same context: is that step a near tie of the fp32
            # reference (gap <= the decisive threshold), or a real disagreement?
            gaps = greedy_step_gaps(d, prompts, done[0]["tokens"])
        for r in done[1:]:
            match = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                     for a, b in zip(done[0]["tokens"], r["tokens"])]
            done[0]["greedy_match_len_vs_" + r["impl"]] = match
            done[0]["greedy_parted_decisive_vs_" + r["impl"]] = [
                m < len(g) and float(g[m]) > thr for m, g in zip(match, gaps)]
            done[0]["greedy_parted_gap_vs_" + r["impl"]] = [
                round(float(g[m]), 4) if m < len(g) else None for m, g in zip(match, gaps)]
            print(f"[{name}] greedy tokens, {done[0]['impl']} vs {r['impl']}: equal for {match} of {GEN}; fp32 gap "
                  f"where they part {done[0]['greedy_parted_gap_vs_' + r['impl']]} (decisive above {thr:.4f})",
                  flush=True)
    fields = ["model", "impl", "positions", "vllm_agree", "hf_bf16_agree", "only_vllm_wrong", "only_hf_bf16_wrong",
              "no_worse", "decisive", "decisive_gap", "decisive_vllm_wrong", "decisive_hf_bf16_wrong",
              "no_worse_decisive", "startup_s", "greedy_match_len_vs_hf_bf16", "greedy_match_len_vs_upstream",
              "greedy_parted_decisive_vs_upstream", "greedy_parted_gap_vs_upstream",
              "moe_backend", "generated", "error"]
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print("\n| " + " | ".join(fields) + " |\n|" + "---|" * len(fields))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "-")) for k in fields) + " |")


if __name__ == "__main__":
    main()
