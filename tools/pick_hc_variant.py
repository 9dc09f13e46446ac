"""Print the QWEN4EXP_HC_DECODE value whose HC transition (write-back + mixer) is fastest at T tokens in a
bench_ops.py CSV (`--only hc_step`), for a device queue that A/Bs the winner end to end right after the kernel timings.

    python tools/pick_hc_variant.py bench_ops.csv [--tokens 4] [--not fused]
"""

import argparse
import csv
import math
import sys

# bench_ops.py's hc_step case (the default tiles) behind each QWEN4EXP_HC_DECODE value
CASES = {"fused": "inject_norm+mix", "fused-ticket": "inject_norm+mix,ticket", "cublas": "inject_norm+gemm-path"}


def pick(rows, tokens: int, exclude=()) -> tuple[str, dict]:
    times = {}
    for r in rows:
        if r["op"] != "hc_step":
            continue
        for value, case in CASES.items():
            if r["case"] == f"T={tokens},{case}":
                us = float(r["kernel_us"])
                if math.isfinite(us):
                    times[value] = us
    left = {v: t for v, t in times.items() if v not in exclude}
    if not left:
        raise SystemExit(f"no hc_step timing at T={tokens} for {', '.join(sorted(set(CASES) - set(exclude)))}")
    return min(left, key=left.get), times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--not", dest="exclude", action="append", default=[], help="leave this value out (repeatable)")
    a = ap.parse_args(argv)
    with open(a.csv, newline="") as f:
        best, times = pick(list(csv.DictReader(f)), a.tokens, a.exclude)
    print(", ".join(f"{v} {t:.2f} us" for v, t in sorted(times.items(), key=lambda kv: kv[1])), file=sys.stderr)
    print(best)


if __name__ == "__main__":
    main()
