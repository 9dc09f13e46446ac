"""Pick QSA decode launch settings from ``bench_ops.py --decode-breakdown``'s stage table, for the engine runs that
follow in the same lease (the device is released 30 s after a call, too soon to read the table by hand).

    python recipes/pick_knobs.py OUT/ops_stages.csv [--vllm-topk-ok] > knobs.txt   # QWEN4EXP_KNOBS value

Rules (each a clear win on this run's own timings, else the defaults stay):
* the attention + merge at batch 32 and at batch 1: the fastest variant checked equal to the default's output,
  if it is at least ``--margin`` faster than the variant with the current defaults;
* ``TOPK=vllm`` (vLLM's CUDA select) if its kernel test passed (``--vllm-topk-ok``) and the whole op with it is
  at least ``--margin`` faster than with the Triton select at batch 32 and no slower at batch 1, else
  ``TOPK=triton`` (a knob only where that is not the default already).
The choice and the figures behind it go to stderr.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

_ATTN = re.compile(r"attention\+merge SB=(\d+) warps=(\d+) stages=(\d+) prefetch=(True|False) programs=(\d+)"
                   r"(?: kt=(True|False))?$")  # (tables before run 13: no kt, K loaded untransposed)


def read(path: str) -> dict:
    """{(case, stage): us} of the qsa_decode_paged rows."""
    with open(path, newline="") as f:
        return {(r["case"], r["stage"]): float(r["us"]) for r in csv.DictReader(f) if r["op"] == "qsa_decode_paged"}


def pick(times: dict, defaults: dict, vllm_topk_ok: bool, margin: float = 0.03) -> tuple[dict, list[str]]:
    """(knobs {name: value}, reasons). ``defaults``: the qsa module's current settings (ATTN_* and TOPK)."""
    knobs, why = {}, []
    for case, suffix, prog in (("B=32", "_MANY", True), ("B=1", "", False)):
        variants = {}
        for (c, stage), us in times.items():
            m = _ATTN.match(stage)
            if c == case and m:  # (a variant whose output differed from the default's is named "... WRONG")
                variants[tuple(int(x) if x.isdigit() else x == "True" for x in m.groups(default="False"))] = us
        cur = (defaults[f"ATTN_SLOT_BLOCK{suffix}"], defaults[f"ATTN_WARPS{suffix}"], defaults[f"ATTN_STAGES{suffix}"],
               defaults[f"ATTN_PREFETCH{suffix}"], defaults["ATTN_PROGRAMS"], defaults.get(f"ATTN_K_T{suffix}", False))
        if cur not in variants:
            why.append(f"{case} attention: the defaults {cur} were not timed; kept")
            continue
        best = min(variants, key=variants.get)
        if variants[best] <= (1 - margin) * variants[cur]:
            sb, w, st, pf, progs, kt = best
            knobs.update({f"ATTN_SLOT_BLOCK{suffix}": sb, f"ATTN_WARPS{suffix}": w, f"ATTN_STAGES{suffix}": st,
                          f"ATTN_PREFETCH{suffix}": int(pf), f"ATTN_K_T{suffix}": int(kt)})
            if prog:  # (the program count only matters at batch 32: batch 1 runs one chunk a program either way)
                knobs["ATTN_PROGRAMS"] = progs
            why.append(f"{case} attention {best}: {variants[best]:.1f} us vs defaults {cur}: {variants[cur]:.1f} us")
        else:
            why.append(f"{case} attention: defaults {cur} {variants[cur]:.1f} us; best {best} {variants[best]:.1f}")
    # vLLM's select against ours (the Triton select: "whole op (TOPK=triton)"; tables before run 13 name the
    # default, then the Triton select, "whole op (defaults)")
    tri = "whole op (TOPK=triton)" if ("B=32", "whole op (TOPK=triton)") in times else "whole op (defaults)"
    v32, d32 = times.get(("B=32", "whole op (TOPK=vllm)")), times.get(("B=32", tri))
    v1, d1 = times.get(("B=1", "whole op (TOPK=vllm)")), times.get(("B=1", tri))
    if not vllm_topk_ok:
        take = False
        why.append("TOPK=vllm: not taken (its kernel test did not pass)")
    elif None in (v32, d32, v1, d1):  # (timed without vLLM's kernels: nothing to compare, the default stays)
        take = defaults.get("TOPK") == "vllm"
        why.append(f"TOPK: {defaults.get('TOPK')} kept (vLLM's select not timed; its kernel test passed)")
    elif v32 <= (1 - margin) * d32 and v1 <= d1 * (1 + margin):
        take = True
        why.append(f"TOPK=vllm: whole op B=32 {v32:.1f} vs {d32:.1f} us, B=1 {v1:.1f} vs {d1:.1f} us")
    else:
        take = False
        why.append(f"TOPK=vllm: not faster (B=32 {v32:.1f} vs {d32:.1f} us, B=1 {v1:.1f} vs {d1:.1f} us)")
    want = "vllm" if take else "triton"
    if want != defaults.get("TOPK"):
        knobs["TOPK"] = want
    return knobs, why


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stages_csv")
    ap.add_argument("--vllm-topk-ok", action="store_true")
    ap.add_argument("--margin", type=float, default=0.03)
    a = ap.parse_args()
    from qwen4exp.ops.qsa import triton_kernel as tk

    defaults = {k: getattr(tk, k) for k in dir(tk) if k.startswith("ATTN_") or k == "TOPK"}
    knobs, why = pick(read(a.stages_csv), defaults, a.vllm_topk_ok, a.margin)
    for line in why:
        print(line, file=sys.stderr)
    print(",".join(f"qsa.{k}={v}" for k, v in knobs.items()))


if __name__ == "__main__":
    main()
