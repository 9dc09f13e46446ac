"""Registers, spills and shared memory of every Triton kernel launch the Triton checks record, compiled for the
H200 (sm_90) on a machine without a GPU: Triton's front end to PTX, then ``ptxas -v`` (the ptxas Triton ships).

    TRITON_INTERPRET=1 PYTHONPATH=.cache/triton python tests/ops/interpreter.py run OUT   # records OUT/launches.json
    PYTHONPATH=.cache/triton python tools/kernel_resources.py OUT/launches.json [--csv resources.csv] [--all]

Prints one row per distinct launch (kernel, compile-time constants, warps / stages) that spills or uses 200+
registers (``--all``: every row), and writes them all to ``--csv``. A spilling kernel reads and writes its spilled
registers through local memory (L1 / L2 / HBM) on every use, which can make a memory-bound kernel several times
slower than its bytes need. Needs Triton importable (``make test`` installs the GPU image's 3.6.0 in
``.cache/triton``).
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resources(launches: list[dict]) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, os.path.join(ROOT, "tests", "ops"))
    sys.path.insert(0, ROOT)
    from interpreter import ptxas_resources

    target = GPUTarget("cuda", 90, 32)
    rows, seen = [], set()
    for d in launches:
        key = (d["module"], d["name"], json.dumps(d["constexprs"], sort_keys=True),
               json.dumps(d["options"], sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        fn = getattr(importlib.import_module(d["module"]), d["name"])
        k = triton.compile(ASTSource(fn, d["signature"], constexprs=d["constexprs"]), target=target,
                           options=d["options"])
        regs, spill = ptxas_resources(k.asm["ptx"], target.arch)
        rows.append(dict(kernel=d["name"], constexprs=json.dumps(d["constexprs"], sort_keys=True),
                         warps=d["options"].get("num_warps"), stages=d["options"].get("num_stages"),
                         registers=regs, spill_bytes=spill, shared_bytes=k.metadata.shared))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("launches", help="the launches.json written by `tests/ops/interpreter.py run`")
    ap.add_argument("--csv", help="write every row here")
    ap.add_argument("--all", action="store_true", help="print every launch, not only the heavy ones")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("kernel_resources: run without TRITON_INTERPRET (it compiles for sm_90)")
    with open(args.launches) as f:
        rows = resources(json.load(f))
    print(f"| {'kernel':<30} | {'warps':>5} | {'stages':>6} | {'regs':>4} | {'spill B':>7} | {'smem B':>7} | constants")
    print(f"|{'-' * 32}|{'-' * 7}|{'-' * 8}|{'-' * 6}|{'-' * 9}|{'-' * 9}|---")
    for r in sorted(rows, key=lambda r: (-r["spill_bytes"], -r["registers"])):
        if args.all or r["spill_bytes"] or r["registers"] >= 200:
            print(f"| {r['kernel']:<30} | {r['warps']!s:>5} | {r['stages']!s:>6} | {r['registers']:>4} | "
                  f"{r['spill_bytes']:>7} | {r['shared_bytes']:>7} | {r['constexprs']}")
    print(f"{len(rows)} distinct launches, {sum(1 for r in rows if r['spill_bytes'])} spill")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
