"""Tables of where the host (Python) time of vLLM processes goes, from py-spy's raw stacks: per process and thread,
functions by inclusive and self share, the hottest stacks, and the V1 engine step split into phases (scheduling,
input preparation, attention metadata, forward launch, sampling, outputs, GPU waits).

``benchmarks/bench_vllm_gpu.py --py-spy PATH`` records the bench and its engine core with py-spy
(``record --subprocesses --threads --nonblocking -f raw``) during its decode windows and writes these tables with
``collapsed_table``; by hand::

    py-spy record --pid PID --subprocesses --threads --nonblocking --idle -f raw -o stacks.raw
    python tools/host_sampler.py stacks.raw [--label bs1] > stacks.txt
"""

from __future__ import annotations

import collections
import os


def stack_table(stacks: collections.Counter, head: str, top: int = 60) -> str:
    """``stacks``: (label, thread, frames outermost first) -> samples. Per label and thread: samples, then
    functions by inclusive and by self share, then the hottest stacks."""
    by_thread: dict = collections.defaultdict(collections.Counter)
    for (label, thread, frames), n in stacks.items():
        by_thread[(label, thread)][frames] += n
    out = [head]
    for (label, thread), st in sorted(by_thread.items(), key=lambda kv: (kv[0][0], -sum(kv[1].values()))):
        total = sum(st.values())
        incl, self_ = collections.Counter(), collections.Counter()
        for frames, n in st.items():
            for f in dict.fromkeys(frames):  # (stack order: ties list the same way in every process)
                incl[f] += n
            if frames:
                self_[frames[-1]] += n
        out.append(f"\n== {label or '-'}: thread {thread}: {total} samples")
        out.append("  inclusive  self    function")
        for f, n in incl.most_common(top):
            out.append(f"  {n / total:8.1%}  {self_[f] / total:6.1%}  {f}")
        out.append("  -- hottest stacks (innermost 8 frames)")
        for frames, n in st.most_common(12):
            out.append(f"  {n / total:6.1%}  {' > '.join(frames[-8:])}")
        phases = step_phases(st)
        if phases:
            out.append("  -- vLLM step phases (a sample goes to the first phase, in this order, with a function on "
                       "its stack)")
            for name, n in phases:
                out.append(f"  {n / total:6.1%}  {name}")
    return "\n".join(out) + "\n"


# Where a vLLM engine step's host time goes (V1 engine core, GPU model runner), coarsely: each phase is named by
# the functions that mark it (qualified names; a frame matches a key equal to its function or ending in "." + key).
# Order matters: a GPU wait inside the output future is a wait, not a step; metadata building inside
# execute_model is metadata, not forward.
STEP_PHASES = (
    ("waiting for the GPU (synchronize)", ("synchronize",)),  # Event.synchronize, Stream.synchronize, ...
    ("sampling (sample_tokens)", ("sample_tokens",)),
    ("attention metadata (builders, prepare_attn)", ("build_attn_metadata", "prepare_attn")),
    ("input preparation (prepare_inputs)", ("prepare_inputs",)),
    ("forward launch + request state (rest of execute_model)", ("execute_model",)),
    ("scheduling (Scheduler.schedule)", ("Scheduler.schedule",)),
    ("outputs (update_from_output)", ("update_from_output",)),
)
OTHER_PHASE = "other (idle, loop, serialisation)"


def step_phases(stacks: collections.Counter) -> list[tuple[str, int]]:
    """``stacks``: frames (``file.py:Func``, outermost first) -> samples of one thread. Samples per ``STEP_PHASES``
    phase (first match in that order), then ``OTHER_PHASE`` for the rest; [] when no sample is in any phase (a
    thread that runs no vLLM step)."""
    counts: collections.Counter = collections.Counter()
    for frames, n in stacks.items():
        names = {f.rpartition(":")[2] for f in frames}
        counts[next((phase for phase, keys in STEP_PHASES
                     if any(name == k or name.endswith("." + k) for name in names for k in keys)), OTHER_PHASE)] += n
    if not counts.keys() - {OTHER_PHASE}:
        return []
    return [(phase, counts[phase]) for phase in [*(p for p, _ in STEP_PHASES), OTHER_PHASE] if counts[phase]]


def collapsed_table(raw: str, label: str = "", top: int = 60) -> str:
    """The same tables from py-spy's raw (collapsed) output (``py-spy record -f raw --threads --subprocesses``):
    lines ``process PID:"cmd";[process ...;]thread (TID): NAME;Func (file.py:line);... COUNT``. py-spy reads the
    processes' memory from outside, so unlike an in-process (``sys._current_frames``) sampler its samples do not
    depend on when a thread releases the GIL. Frames are named ``file.py:Func`` (lines dropped), threads
    ``pid PID NAME`` (the innermost process)."""
    stacks: collections.Counter = collections.Counter()
    procs: dict = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        pid, thread, frames = "?", "?", []
        for part in stack.split(";"):
            if part.startswith("process ") and ":" in part:
                pid = part[len("process "):].split(":", 1)[0]
                cmd = part.split(":", 1)[1].strip('"')  # (paths shortened to their last part: no machine paths)
                procs.setdefault(pid, " ".join(os.path.basename(w) if "/" in w else w for w in cmd.split())[:80])
            elif part.startswith("thread (") and "): " in part:
                thread = part.split("): ", 1)[1]
            else:
                func, _, where = part.rpartition(" (")
                if func and where.endswith(")"):
                    part = f"{os.path.basename(where[:-1].rsplit(':', 1)[0])}:{func}"
                frames.append(part)
        stacks[(label, f"pid {pid} {thread}", tuple(frames))] += int(count)
    head = (f"py-spy (sampled from outside the processes): {sum(stacks.values())} samples; processes: "
            + "; ".join(f"{p} {c}" for p, c in procs.items()))
    return stack_table(stacks, head, top)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", help="py-spy's raw (collapsed) output")
    ap.add_argument("--label", default="", help="the window's name in the table headings")
    ap.add_argument("--top", type=int, default=60, help="functions listed per thread")
    a = ap.parse_args()
    with open(a.raw) as f:
        print(collapsed_table(f.read(), a.label, a.top), end="")


if __name__ == "__main__":
    main()
