"""``benchmarks/bench_vllm_gpu.py``'s step timing (CPU, with a scripted engine; the script itself runs on the GPU
machine): only steps in which the whole batch decodes count. Long prompts are prefilled one after another, so the
first requests decode (and may finish) while later ones still prefill; timing those steps measured a smaller batch
than the name says (run 9: the "batch-32" steps had 8-16 requests)."""

import types

from script_loader import load_script

bench = load_script("bench_vllm_gpu")


class ScriptedEngine:
    """Prefills one request per ``prefill_steps`` steps (in arrival order); every prefilled, unfinished request
    gets one token per step. Records how many requests decoded in each step."""

    def __init__(self, prefill_steps: int):
        self.prefill_steps = prefill_steps
        self.reqs = []  # [id, max_tokens, tokens, prefill steps left]
        self.decoding = []

    def add_request(self, rid, prompt, sp):
        self.reqs.append([rid, sp.max_tokens, 0, self.prefill_steps])

    def has_unfinished_requests(self):
        return any(r[2] < r[1] for r in self.reqs)

    def step(self):
        outs, n_dec = [], 0
        pending = next((r for r in self.reqs if r[3] > 0), None)
        for r in self.reqs:
            if r[3] == 0 and r[2] < r[1]:
                r[2] += 1
                n_dec += 1
                outs.append(types.SimpleNamespace(request_id=r[0], outputs=[types.SimpleNamespace(
                    token_ids=[0] * r[2])]))
        if pending is not None:
            pending[3] -= 1
            if pending[3] == 0:  # the prefill's last chunk samples the first token
                pending[2] = 1
                outs.append(types.SimpleNamespace(request_id=pending[0], outputs=[types.SimpleNamespace(
                    token_ids=[0])]))
        self.decoding.append(n_dec)
        return outs


def test_only_steps_with_the_whole_batch_decoding_are_timed():
    eng = ScriptedEngine(prefill_steps=3)
    t_first, t_end, steps, ntok = bench._drive(eng, [[1, 2, 3]] * 8, 40)
    assert ntok == 8 * 40 and t_first is not None and t_end >= t_first
    full = sum(1 for n in eng.decoding if n == 8)
    # the last request starts decoding after 8 x 3 steps; the first finishes 40 tokens after its own prefill
    assert len(steps) == full - 1 and len(steps) > 0  # (the step that finishes the first request is left out)


def test_too_few_tokens_to_outlast_the_prefill_times_nothing():
    eng = ScriptedEngine(prefill_steps=3)
    _, _, steps, _ = bench._drive(eng, [[1, 2, 3]] * 8, 10)  # the first is done before the last starts
    assert steps == [] and max(eng.decoding) < 8


def test_steps_after_a_profile_of_an_engine_in_its_own_process_are_not_timed(monkeypatch):
    """--mp: the engine core keeps stepping while the profiler writes its trace; the outputs queue up and step()
    returns at once afterwards, so only the steps before the profile count there (in-process: all of them)."""
    calls = []
    monkeypatch.setattr(bench, "_profile_steps", lambda engine, n, *a, **k: calls.append(n) or [
        engine.step() for _ in range(n)])
    for llm, want_at_most in ((None, None), (object(), 32)):
        eng = ScriptedEngine(prefill_steps=1)
        _, _, steps, _ = bench._drive(eng, [[1]] * 4, 120, profile_to="unused.txt", llm=llm)
        full = sum(1 for n in eng.decoding if n == 4)
        if want_at_most is None:
            assert len(steps) == full - 1 - 8  # all but the 8 profiled steps (and the finishing one)
        else:
            assert len(steps) == want_at_most
    assert calls == [8, 8]


def _spin_in_python(seconds: float) -> int:
    n, end = 0, __import__("time").perf_counter() + seconds
    while __import__("time").perf_counter() < end:
        n += 1
    return n


def test_host_sampler_counts_the_busy_function_only_inside_a_labelled_window(tmp_path, monkeypatch):
    """``--host-sample``: the sampler thread (started in every vLLM process by the plugin's ``register``) counts
    the other threads' Python stacks while ``<folder>/on`` exists, one table per window label; ``_drive`` opens
    the window at the first-th timed decode step and closes it at the last-th (or at the end)."""
    import sys

    from host_sampler import HostSampler

    switch = sys.getswitchinterval()
    sampler = HostSampler(str(tmp_path), interval=0.001, write_every=0.1).start()
    try:
        _spin_in_python(0.2)  # no window: nothing counted
        assert sum(sampler.samples.values()) == 0
        monkeypatch.setenv("QWEN4EXP_HOST_SAMPLE", str(tmp_path))

        class SpinningEngine(ScriptedEngine):
            def step(self):
                _spin_in_python(0.01)
                return super().step()

        eng = SpinningEngine(prefill_steps=1)
        bench._drive(eng, [[1]], 60, sample=("decode", 4, 40))
        assert not (tmp_path / "on").exists()  # closed again
        _spin_in_python(0.2)
    finally:
        sampler.stop()
        sys.setswitchinterval(switch)
    assert set(sampler.samples) == {"decode"} and sampler.samples["decode"] >= 20, sampler.samples
    table = (tmp_path / f"host-{__import__('os').getpid()}.txt").read_text()
    assert "== decode: thread MainThread" in table
    main = [line for line in table.splitlines() if line.strip().endswith(":_spin_in_python")]
    assert main and float(main[0].split("%")[0]) > 50, table[:2000]  # the step's busy function dominates


_FAKE_PYSPY = """#!{python}
# stands in for py-spy: checks the arguments, waits for SIGINT, then writes raw stacks (py-spy's format) to -o
import signal, sys, time
args = sys.argv[1:]
assert args[0] == "record" and "--subprocesses" in args and "--nonblocking" in args and "--threads" in args, args
assert args[args.index("-f") + 1] == "raw" and args[args.index("--pid") + 1] == "{pid}", args
out = args[args.index("-o") + 1]
stop = []
signal.signal(signal.SIGINT, lambda *a: stop.append(1))
while not stop:
    time.sleep(0.01)
with open(out, "w") as f:
    f.write('process {pid}:"python bench";process 77:"EngineCore";thread (77): MainThread;'
            'run_busy_loop (core.py:10);step (core.py:20);build (flash_attn.py:30) 30\\n')
    f.write('process {pid}:"python bench";process 77:"EngineCore";thread (77): MainThread;'
            'run_busy_loop (core.py:10);step (core.py:21);sample (sampler.py:5) 70\\n')
    f.write('process {pid}:"python bench";thread ({pid}): MainThread;main (bench.py:1) 12\\n')
"""


def test_py_spy_window_records_the_process_tree_and_writes_tables(tmp_path, monkeypatch):
    """``--py-spy``: ``_drive``'s sample window starts py-spy on this process and its children (nonblocking, raw
    stacks with threads) and stops it with SIGINT at the window's end; its raw output becomes the host-sampler
    tables: per process and thread, functions named file:function (lines dropped) with inclusive / self shares."""
    import os
    import sys

    exe = tmp_path / "py-spy"
    exe.write_text(_FAKE_PYSPY.format(python=sys.executable, pid=os.getpid()))
    exe.chmod(0o755)
    monkeypatch.setenv("QWEN4EXP_PYSPY", str(exe))
    monkeypatch.setenv("QWEN4EXP_PYSPY_OUT", str(tmp_path / "pyspy-ours"))
    monkeypatch.delenv("QWEN4EXP_HOST_SAMPLE", raising=False)
    class SlowEngine(ScriptedEngine):  # (a window of ~1 s: the stand-in starts up and installs its handler)
        def step(self):
            __import__("time").sleep(0.04)
            return super().step()

    bench._drive(SlowEngine(prefill_steps=1), [[1]], 30, sample=("bs1", 4, 1 << 30))
    assert "proc" not in bench._PYSPY  # stopped at the end of the window
    table = (tmp_path / "pyspy-ours-bs1.txt").read_text()
    assert "112 samples" in table and "77 EngineCore" in table
    engine = table.split("== bs1: thread pid 77 MainThread: 100 samples")[1].split("-- hottest")[0]
    rows = {line.split()[-1]: line.split()[:2] for line in engine.splitlines() if line.strip().endswith(
        ("core.py:step", "sampler.py:sample", "flash_attn.py:build"))}
    assert rows == {"core.py:step": ["100.0%", "0.0%"], "sampler.py:sample": ["70.0%", "70.0%"],
                    "flash_attn.py:build": ["30.0%", "30.0%"]}, engine
    assert "== bs1: thread pid %d MainThread: 12 samples" % os.getpid() in table


def test_host_sampler_restarts_in_a_forked_child(tmp_path, monkeypatch):
    """vLLM's engine core can be forked from the front end after the plugin registered there: threads do not
    survive a fork and ``register`` does not run again, so the child must start its own sampler (run 13 lost the
    engine core's table to this)."""
    import os
    import sys

    import host_sampler as hs

    monkeypatch.setenv("QWEN4EXP_HOST_SAMPLE", str(tmp_path))
    monkeypatch.setenv("QWEN4EXP_HOST_SAMPLE_WRITE", "0.1")
    monkeypatch.setattr(hs, "_started", None)
    switch = sys.getswitchinterval()
    parent = hs.maybe_start()
    try:
        assert parent is not None and parent.pid == os.getpid()
        (tmp_path / "on").write_text("child")
        pid = os.fork()
        if pid == 0:  # the child: its own sampler, its own table
            code = 1
            try:
                mine = hs._started
                if mine is not None and mine is not parent and mine.pid == os.getpid():
                    _spin_in_python(0.4)
                    mine.stop()
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0, "the forked child had no sampler of its own"
    finally:
        (tmp_path / "on").unlink(missing_ok=True)
        parent.stop()
        monkeypatch.setattr(hs, "_started", None)
        sys.setswitchinterval(switch)
    table = (tmp_path / f"host-{pid}.txt").read_text()
    assert "== child: thread MainThread" in table and ":_spin_in_python" in table, table[:1500]


def test_variants_are_ours_with_extra_environment():
    """``--variant lean=QWEN4EXP_QSA_METADATA=lean``: an A/B of a plugin switch in the same run as ours and
    upstream; values may hold '=' and ',' (a knobs list); a bad or clashing name is refused with the spec."""
    import pytest

    got = bench.parse_variants(["lean=QWEN4EXP_QSA_METADATA=lean",
                                "tri=QWEN4EXP_KNOBS=qsa.TOPK=triton,hc.FUSED=1;QWEN4EXP_PLE_TABLE=gpu"])
    assert got == {"lean": {"QWEN4EXP_QSA_METADATA": "lean"},
                   "tri": {"QWEN4EXP_KNOBS": "qsa.TOPK=triton,hc.FUSED=1", "QWEN4EXP_PLE_TABLE": "gpu"}}
    for bad in ("ours=X=1", "lean", "lean=", "lean=NOVALUE"):
        with pytest.raises(SystemExit, match="--variant"):
            bench.parse_variants([bad])


def test_collapsed_table_splits_an_engine_step_into_phases():
    """py-spy's raw stacks of an engine core's main thread: each sample goes to the first step phase (in
    ``STEP_PHASES`` order) with a function on its stack, so a GPU wait inside execute_model counts as a wait and
    metadata building inside execute_model as metadata; threads that run no step get no phase table."""
    from host_sampler import collapsed_table

    bench_proc = 'process 5:"/opt/env/bin/python /home/u/bench.py";'
    core = bench_proc + 'process 7:"VLLM::EngineCore";thread (7): MainThread;step (core.py:1);'
    raw = "\n".join([
        core + "GPUModelRunner.execute_model (model_runner.py:2);build_attn_metadata (attn_utils.py:3) 40",
        core + "GPUModelRunner.execute_model (model_runner.py:2);GPUModelRunner.prepare_inputs (model_runner.py:4) 25",
        core + "GPUModelRunner.execute_model (model_runner.py:2);Event.synchronize (streams.py:5) 5",
        core + "GPUModelRunner.execute_model (model_runner.py:2);CUDAGraph.replay (graphs.py:6) 10",
        core + "GPUModelRunner.sample_tokens (model_runner.py:7);Sampler.__call__ (sampler.py:8) 15",
        core + "Poller.poll (poll.py:9) 5",
        bench_proc + "thread (5): MainThread;main (bench.py:1) 50",
    ])
    table = collapsed_table(raw, "bs1")
    assert "5 python bench.py" in table and "/home" not in table  # commands without machine paths
    engine = table.split("thread pid 7 MainThread: 100 samples")[1]
    phases = engine.split("-- vLLM step phases")[1].split("\n\n")[0].splitlines()[1:]
    got = {line.split("%", 1)[1].strip(): float(line.split("%")[0]) for line in phases}
    assert got == {"attention metadata (builders, prepare_attn)": 40.0, "input preparation (prepare_inputs)": 25.0,
                   "sampling (sample_tokens)": 15.0, "forward launch + request state (rest of execute_model)": 10.0,
                   "waiting for the GPU (synchronize)": 5.0, "other (idle, loop, serialisation)": 5.0}, phases
    bench_thread = table.split("thread pid 5 MainThread: 50 samples")[1]
    assert "step phases" not in bench_thread
