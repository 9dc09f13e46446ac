"""A sampling profiler of the host (Python) side of a vLLM process, for the question "where does a decode step's
host time go" (the batch-1 TPOT on the H200 is host-bound for both engines, see notes/vllm-gpu.md).

vLLM's torch profiler with Python stacks hooks every call and slows the host several-fold, so its tables rank
functions but do not give the unprofiled split. This samples instead: a daemon thread wakes every ``interval``
seconds, reads every other thread's current Python stack (``sys._current_frames``) and counts it. It is enabled by
``QWEN4EXP_HOST_SAMPLE=<folder>`` in every process that loads vLLM's plugins (``qwen4exp.vllm.register`` starts it,
so also the engine-core process of ``--mp`` / ``vllm serve``, and also with ``QWEN4EXP_VLLM=0``: upstream gets the
same profile), and it only counts while the file ``<folder>/on`` exists, so a driver can frame the steps of interest
(``benchmarks/bench_vllm_gpu.py --host-sample``); the file's text labels the samples (one table per label, e.g.
"bs1" and "bs32"). Each process rewrites ``<folder>/host-<pid>.txt`` every
``QWEN4EXP_HOST_SAMPLE_WRITE`` seconds (a killed engine core still leaves its table).

The GIL biases Python-level samplers: the sampler runs only when the busy thread lets go of the GIL (a blocking call,
or the interpreter's switch interval). The switch interval is lowered to the sampling interval in a sampled process
(its own cost is part of what is measured: compare processes sampled alike, e.g. ours against upstream).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

ENV = "QWEN4EXP_HOST_SAMPLE"
_started: "HostSampler | None" = None
_fork_hook = False


def _frame_name(code) -> str:
    return f"{os.path.basename(code.co_filename)}:{getattr(code, 'co_qualname', code.co_name)}"


class HostSampler:
    """Counts the Python stacks of this process's other threads while ``<folder>/on`` exists."""

    def __init__(self, folder: str, interval: float = 0.0005, write_every: float = 2.0, max_depth: int = 64):
        self.folder, self.interval, self.write_every, self.max_depth = folder, interval, write_every, max_depth
        self.stacks: collections.Counter = collections.Counter()  # (label, thread, frames outermost first) -> n
        self.samples: collections.Counter = collections.Counter()  # label -> samples
        self.label = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qwen4exp-host-sampler", daemon=True)
        self.pid = os.getpid()
        self.path = os.path.join(folder, f"host-{self.pid}.txt")

    def start(self) -> "HostSampler":
        os.makedirs(self.folder, exist_ok=True)
        if sys.getswitchinterval() > self.interval:
            sys.setswitchinterval(self.interval)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.write()

    def _sample(self, me: int, names: dict) -> None:
        label = self.label
        for tid, frame in sys._current_frames().items():
            if tid == me:
                continue
            frames = []
            while frame is not None and len(frames) < self.max_depth:
                frames.append(_frame_name(frame.f_code))
                frame = frame.f_back
            self.stacks[(label, names.get(tid, str(tid)), tuple(reversed(frames)))] += 1
        self.samples[label] += 1

    def _run(self) -> None:
        me = threading.get_ident()
        on = os.path.join(self.folder, "on")
        last_write = time.monotonic()
        was_on = False
        while not self._stop.is_set():
            now = time.monotonic()
            if os.path.exists(on):
                t0 = time.perf_counter()
                if not was_on:  # a new window: its label
                    try:
                        with open(on) as f:
                            self.label = f.read().strip()
                    except OSError:
                        self.label = ""
                self._sample(me, {t.ident: t.name for t in threading.enumerate()})
                was_on = True
                time.sleep(max(0.0, self.interval - (time.perf_counter() - t0)))
            else:
                if was_on or now - last_write > self.write_every:
                    if self.samples:
                        self.write()
                    last_write, was_on = now, False
                time.sleep(0.01)
                continue
            if now - last_write > self.write_every:
                self.write()
                last_write = now

    def table(self, top: int = 60) -> str:
        """Per label and thread: samples, then functions by inclusive and by self share, then the hottest stacks."""
        head = (f"pid {os.getpid()} ({os.path.basename(sys.argv[0]) if sys.argv else ''}): samples every "
                f"{self.interval * 1e3:.2f} ms: " + ", ".join(f"{k or '-'} {n}" for k, n in self.samples.items()))
        return stack_table(self.stacks, head, top)

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write(self.table())
        os.replace(tmp, self.path)


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
            for f in set(frames):
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
# execute_model is metadata, not forward (run 15: this split of ours and upstream's batch-1 steps).
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
    processes' memory from outside, so unlike ``HostSampler`` its samples do not depend on when a thread releases
    the GIL (run 14: this sampler's FA-builder share was such an artefact). Frames are named like ours
    (``file.py:Func``, lines dropped), threads ``pid PID NAME`` (the innermost process)."""
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


def _start_in_child() -> None:
    """After a fork: the parent's sampler thread did not come along (threads never do), and neither does a fresh
    ``register`` call (the child inherits the plugin's registered state): vLLM's engine core forked from the
    front-end process would go unsampled (the H200 run 13 lesson), so the child starts its own."""
    global _started
    if _started is not None and _started.pid != os.getpid():
        _started = None
        maybe_start()


def maybe_start() -> "HostSampler | None":
    """Start this process's sampler once if ``QWEN4EXP_HOST_SAMPLE`` names a folder, and in every process forked
    from it later (never raises: diagnostics must not stop vLLM from starting)."""
    global _started, _fork_hook
    folder = os.environ.get(ENV, "").strip()
    if not folder or (_started is not None and _started.pid == os.getpid()):
        return _started
    try:
        _started = HostSampler(folder, float(os.environ.get(f"{ENV}_INTERVAL", "0.0005")),
                               float(os.environ.get(f"{ENV}_WRITE", "2"))).start()
        if not _fork_hook:
            os.register_at_fork(after_in_child=_start_in_child)
            _fork_hook = True
    except Exception as e:  # noqa: BLE001
        print(f"qwen4exp: host sampler not started ({type(e).__name__}: {e})", file=sys.stderr)
    return _started
