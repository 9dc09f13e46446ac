"""Registers, spills and shared memory of every Triton kernel launch the Triton checks record, compiled for the
H200 (sm_90) on a machine without a GPU: Triton's front end to PTX, then ``ptxas -v`` (the ptxas Triton ships).

    TRITON_INTERPRET=1 PYTHONPATH=.cache/triton python tests/ops/interpreter.py run OUT   # records OUT/launches.json
    PYTHONPATH=.cache/triton python tools/kernel_resources.py OUT/launches.json [--csv resources.csv] [--all]
        [--kernel NAME] [--sass]

Prints one row per distinct launch (kernel, compile-time constants, warps / stages) that spills or uses 200+
registers (``--all``: every row), and writes them all to ``--csv``. ``--sass`` adds the instruction mix of each
launch's hottest loop (the innermost backward branch with the most instructions, from ``nvdisasm``), counted per
thread and per issue class: INT (integer ALU: IMAD, IADD3, LOP3, SHF, ...), FP32 (FFMA, FMUL, ...), CVT
(conversions), MEM (global / shared loads and stores, atomics), MMA (tensor cores), OTHER (branches, shuffles,
barriers, ...). A static count, no GPU: what a change of a kernel's arithmetic does to its issue, before a GPU times
it (an SM issues ~64 INT32 and ~128 FP32 operations a cycle on Hopper). A spilling kernel reads and writes its spilled
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


SASS_CLASSES = {
    "INT": ("IMAD", "IADD3", "IADD", "LOP3", "LOP", "SHF", "SHL", "SHR", "IMNMX", "ISETP", "LEA", "PRMT", "BFE", "BFI",
            "IABS", "SEL", "POPC", "FLO", "BREV", "IMUL", "ISCADD", "VIADD", "VIMNMX", "IDP"),
    "FP32": ("FFMA", "FMUL", "FADD", "FSEL", "FSETP", "FMNMX", "FCHK", "FSET", "FSWZADD"),
    "CVT": ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "FRND"),
    "MEM": ("LDG", "STG", "LDS", "STS", "LDSM", "LD", "ST", "ATOMG", "ATOM", "RED", "ATOMS", "LDGSTS", "UBLKCP",
            "UTMALDG", "LDC", "LDL", "STL"),
    "MMA": ("HMMA", "HGMMA", "IMMA", "QGMMA", "DMMA"),
}


def sass_mix(cubin: bytes) -> dict:
    """Instruction counts per class in the cubin's hottest loop (``SASS_CLASSES``; ``loop`` = all of them), from
    Triton's nvdisasm; {} where there is no loop."""
    import re
    import subprocess
    import tempfile

    import triton
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([nvdisasm, "-c", "-hex", path], capture_output=True, text=True, check=True).stdout
    ins = []  # (address, opcode, operands)
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]+)?\s*([^;]*);", text):
        addr, op, rest = int(m.group(1), 16), m.group(2), m.group(3)
        ins.append((addr, op, rest))
    labels = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"\.(L_x_\d+):\s*\n\s*/\*([0-9a-f]+)\*/", text)}
    loops = []
    for addr, op, rest in ins:
        if op != "BRA":
            continue
        m = re.search(r"\.(L_x_\d+)", rest)
        target = labels.get(m.group(1)) if m else None
        if target is not None and target < addr:
            loops.append((target, addr))
    if not loops:
        return {}
    # innermost first: no other loop inside; of those the largest
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    lo, hi = max(inner, key=lambda lp: lp[1] - lp[0])
    mix = dict.fromkeys([*SASS_CLASSES, "OTHER"], 0)
    for addr, op, _ in ins:
        if lo <= addr <= hi:
            mix[next((c for c, ops in SASS_CLASSES.items() if op in ops), "OTHER")] += 1
    mix["loop"] = sum(mix.values())
    return mix


def resources(launches: list[dict], sass: bool = False) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, os.path.join(ROOT, "tests", "ops"))
    sys.path.insert(0, ROOT)
    from interpreter import ptxas_resources, source

    target = GPUTarget("cuda", 90, 32)
    rows, seen = [], set()
    for d in launches:
        key = (d["module"], d["name"], json.dumps(d["constexprs"], sort_keys=True),
               json.dumps(d["options"], sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        fn = getattr(importlib.import_module(d["module"]), d["name"])
        k = triton.compile(source(fn, d), target=target,
                           options=d["options"])
        regs, spill = ptxas_resources(k.asm["ptx"], target.arch)
        row = dict(kernel=d["name"], constexprs=json.dumps(d["constexprs"], sort_keys=True),
                   warps=d["options"].get("num_warps"), stages=d["options"].get("num_stages"),
                   registers=regs, spill_bytes=spill, shared_bytes=k.metadata.shared)
        if sass:
            mix = sass_mix(k.asm["cubin"])
            row.update({f"loop_{c}": mix.get(c, 0) for c in (*SASS_CLASSES, "OTHER")}, loop_all=mix.get("loop", 0))
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("launches", help="the launches.json written by `tests/ops/interpreter.py run`")
    ap.add_argument("--csv", help="write every row here")
    ap.add_argument("--all", action="store_true", help="print every launch, not only the heavy ones")
    ap.add_argument("--kernel", action="append", help="only launches of this kernel (repeatable)")
    ap.add_argument("--sass", action="store_true", help="the instruction mix of each launch's hottest loop")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("kernel_resources: run without TRITON_INTERPRET (it compiles for sm_90)")
    with open(args.launches) as f:
        launches = [d for d in json.load(f) if not args.kernel or d["name"] in args.kernel]
    if not launches:
        raise SystemExit(f"kernel_resources: no launch of {args.kernel} in {args.launches}")
    rows = resources(launches, sass=args.sass)
    mix_cols = [c for c in rows[0] if c.startswith("loop_")]
    print(f"| {'kernel':<30} | {'warps':>5} | {'stages':>6} | {'regs':>4} | {'spill B':>7} | {'smem B':>7} | "
          + "".join(f"{c[5:]:>6} | " for c in mix_cols) + "constants")
    print(f"|{'-' * 32}|{'-' * 7}|{'-' * 8}|{'-' * 6}|{'-' * 9}|{'-' * 9}|" + "-------|" * len(mix_cols) + "---")
    for r in sorted(rows, key=lambda r: (-r["spill_bytes"], -r["registers"])):
        if args.all or args.sass or r["spill_bytes"] or r["registers"] >= 200:
            print(f"| {r['kernel']:<30} | {r['warps']!s:>5} | {r['stages']!s:>6} | {r['registers']:>4} | "
                  f"{r['spill_bytes']:>7} | {r['shared_bytes']:>7} | "
                  + "".join(f"{r[c]:>6} | " for c in mix_cols) + r["constexprs"])
    print(f"{len(rows)} distinct launches, {sum(1 for r in rows if r['spill_bytes'])} spill")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
