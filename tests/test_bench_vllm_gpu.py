"""``benchmarks/bench_vllm_gpu.py`` on CPU (the script itself runs on the GPU machine): its step timing with a scripted
engine (only steps in which the whole batch decodes count: long prompts are prefilled one after another, so the
first requests decode, and may finish, while later ones still prefill; timing those steps would measure a smaller
batch than the name says), the py-spy window and its tables, and the A/B runs (``--variant``, ``--ours-at``)."""

import types

import pytest

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
    stacks with threads) and stops it with SIGINT at the window's end, timing none of its steps; its raw output
    becomes ``host_sampler``'s
    stack tables: per process and thread, functions named file:function (lines dropped) with inclusive / self
    shares."""
    import os
    import sys

    exe = tmp_path / "py-spy"
    exe.write_text(_FAKE_PYSPY.format(python=sys.executable, pid=os.getpid()))
    exe.chmod(0o755)
    monkeypatch.setenv("QWEN4EXP_PYSPY", str(exe))
    monkeypatch.setenv("QWEN4EXP_PYSPY_OUT", str(tmp_path / "pyspy-ours"))
    class SlowEngine(ScriptedEngine):  # (a window of ~1 s: the stand-in starts up and installs its handler)
        def step(self):
            __import__("time").sleep(0.04)
            return super().step()

    steps = bench._drive(SlowEngine(prefill_steps=1), [[1]], 30, sample=("bs1", 4, 1 << 30))[2]
    assert "proc" not in bench._PYSPY  # stopped at the end of the window
    assert len(steps) == 4  # the sampled steps stay out of the timings (py-spy slows a host-bound step)
    table = (tmp_path / "pyspy-ours-bs1.txt").read_text()
    assert "112 samples" in table and "77 EngineCore" in table
    engine = table.split("== bs1: thread pid 77 MainThread: 100 samples")[1].split("-- hottest")[0]
    rows = {line.split()[-1]: line.split()[:2] for line in engine.splitlines() if line.strip().endswith(
        ("core.py:step", "sampler.py:sample", "flash_attn.py:build"))}
    assert rows == {"core.py:step": ["100.0%", "0.0%"], "sampler.py:sample": ["70.0%", "70.0%"],
                    "flash_attn.py:build": ["30.0%", "30.0%"]}, engine
    assert "== bs1: thread pid %d MainThread: 12 samples" % os.getpid() in table


def test_variants_are_ours_with_extra_environment():
    """``--variant prefetch=QWEN4EXP_PLE_PREFETCH=1``: an A/B of a plugin switch in the same run as ours and
    upstream; values may hold '=' and ','; a bad or clashing name is refused with the spec."""
    import pytest

    got = bench.parse_variants(["prefetch=QWEN4EXP_PLE_PREFETCH=1",
                                "both=VLLM_EXTRA=a=b,c;QWEN4EXP_PLE_TABLE=gpu"])
    assert got == {"prefetch": {"QWEN4EXP_PLE_PREFETCH": "1"},
                   "both": {"VLLM_EXTRA": "a=b,c", "QWEN4EXP_PLE_TABLE": "gpu"}}
    for bad in ("ours=X=1", "lean", "lean=", "lean=NOVALUE"):
        with pytest.raises(SystemExit, match="--variant"):
            bench.parse_variants([bad])


def _checkout(path, marker: str):
    """A stand-in checkout: a ``qwen4exp`` package that says which one it is."""
    (path / "qwen4exp").mkdir(parents=True)
    (path / "qwen4exp" / "__init__.py").write_text(f"WHICH = {marker!r}\n")
    return path


def test_ours_at_runs_ours_from_another_checkout_first_on_the_path(tmp_path, monkeypatch):
    """``--ours-at prev=PATH``: the worker named prev gets PATH first on its PYTHONPATH (before what was there and
    before the installed package), the other workers keep theirs; its Python then imports PATH's qwen4exp, which
    the driver checks against what the worker reports (``qwen4exp_from``)."""
    import os
    import subprocess
    import sys

    import pytest

    prev = _checkout(tmp_path / "prev", "prev")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    args = bench.build_parser().parse_args(["--out", str(tmp_path / "out"), "--impls", "upstream,ours,prev,pf",
                                            "--ours-at", f"prev={prev}", "--ours-at", "pf=" + str(prev),
                                            "--variant", "pf=QWEN4EXP_PLE_PREFETCH=1", "--gpus", "0,1", "--mp",
                                            "--profile"])
    variants, ours_at = bench.parse_variants(args.variant), bench.parse_ours_at(args.ours_at)
    assert ours_at == {"prev": str(prev), "pf": str(prev)}
    runs = {r[0]: r for r in bench.worker_runs(args, args.impls.split(","), "MODEL", variants, ours_at)}
    env = {k: r[4] for k, r in runs.items()}
    assert env["prev"]["PYTHONPATH"].split(os.pathsep) == [str(prev), "/elsewhere"]
    assert env["pf"]["PYTHONPATH"].split(os.pathsep)[0] == str(prev) and env["pf"]["QWEN4EXP_PLE_PREFETCH"] == "1"
    assert env["ours"]["PYTHONPATH"] == env["upstream"]["PYTHONPATH"] == "/elsewhere"
    assert [env[k]["QWEN4EXP_VLLM"] for k in ("upstream", "ours", "prev", "pf")] == ["0", "1", "1", "1"]
    assert [env[k]["CUDA_VISIBLE_DEVICES"] for k in ("upstream", "ours", "prev", "pf")] == ["0", "1", "0", "1"]
    cmd = runs["prev"][3]
    assert cmd[cmd.index("--impl") + 1] == "prev" and cmd[cmd.index("--model") + 1] == "MODEL"
    assert "--mp" in cmd and "--profile" in cmd and cmd[cmd.index("--eager") + 1] == "0"

    # the worker's Python (a script run from this checkout's root) imports the other checkout's package, not this
    # one's (installed in editable mode)
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nimport qwen4exp\nsys.path.insert(0, sys.argv[1])\nimport bench_vllm_gpu as b\n"
                     "print(qwen4exp.WHICH, b.package_root())\n")
    p = subprocess.run([sys.executable, str(probe), bench.HERE], env=env["prev"], capture_output=True, text=True,
                       timeout=60, cwd=os.path.dirname(bench.HERE))
    assert p.returncode == 0, p.stderr
    which, root = p.stdout.split()
    assert which == "prev" and os.path.realpath(root) == os.path.realpath(prev)
    assert bench.package_error("prev", {"qwen4exp_from": root}, ours_at) is None
    assert "not " + str(prev) in bench.package_error("prev", {"qwen4exp_from": bench.HERE}, ours_at)
    assert "plugin not loaded" in bench.package_error("prev", {"qwen4exp_from": ""}, ours_at)
    assert bench.package_error("ours", {"qwen4exp_from": bench.HERE}, ours_at) is None
    assert bench.package_error("prev", {}, ours_at) is None  # no result at all: the run's own error says why
    # the results table names a checkout by its commit only when it is a git work tree of its own (not a folder
    # inside another one, as this test's may be)
    assert bench.package_label(str(prev)) == "prev" and bench.package_label("") == ""

    for bad in ("prev", "ours=" + str(prev), "x=" + str(tmp_path / "missing"), "x="):
        with pytest.raises(SystemExit, match="--ours-at"):
            bench.parse_ours_at([bad])
    with pytest.raises(SystemExit, match="--ours-at"):
        bench.parse_ours_at([f"a={prev}", f"a={prev}"])


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


def test_host_sampler_script_prints_the_tables_of_a_raw_file(tmp_path):
    """``python tools/host_sampler.py stacks.raw --label L``: the same tables as ``collapsed_table`` (py-spy run by
    hand, outside the bench)."""
    import os
    import subprocess
    import sys

    from host_sampler import collapsed_table

    raw = 'process 7:"VLLM::EngineCore";thread (7): MainThread;step (core.py:1);sample_tokens (runner.py:2) 9\n'
    (tmp_path / "stacks.raw").write_text(raw)
    p = subprocess.run([sys.executable, os.path.join(os.path.dirname(bench.HERE), "tools", "host_sampler.py"),
                        str(tmp_path / "stacks.raw"), "--label", "bs1"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout == collapsed_table(raw, "bs1") and "sampling (sample_tokens)" in p.stdout


def test_timed_out_worker_takes_its_engine_core_along(tmp_path):
    """A worker past its timeout dies with its whole process group: an engine-core-like grandchild must not live on
    (holding the GPU) when the next implementation starts."""
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "child.pid"
    script = ("import subprocess, sys, time\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
              f"open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
              "time.sleep(300)\n")
    lf = open(tmp_path / "w.log", "w")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.05)
    child = int(pidfile.read_text())
    err = bench._finish((p, lf), timeout=0.5)
    assert err is not None and err.startswith("timeout")
    assert bench._group_alive(p.pid) == []
    try:
        state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = "gone"
    assert state in ("gone", "Z"), f"the grandchild {child} still runs (state {state})"


def test_cleanly_exited_worker_leaves_no_group(tmp_path):
    import subprocess
    import sys

    lf = open(tmp_path / "w.log", "w")
    p = subprocess.Popen([sys.executable, "-c", "print('ok')"], stdout=lf, stderr=subprocess.STDOUT,
                         start_new_session=True)
    assert bench._finish((p, lf), timeout=30) is None
    assert bench._group_alive(p.pid) == []


def test_fn_nvfp4_preset_is_the_full_depth_anchor(tmp_path):
    """FN-48L-NVFP4 (issue 25): 48 layers, a QSA layer every fourth, the anchor's quantization_config; both engines
    at the anchor's memory utilisation with batch 8 on; its batch-1 roofline counts the routed experts at 4.5 bits."""
    from qwen4exp import presets

    c = bench.write_config(str(tmp_path / "q"), 48, "fn-nvfp4")
    assert c["num_hidden_layers"] == 48 and len(c["layer_types"]) == 48
    assert [i for i, t in enumerate(c["layer_types"]) if t != "linear_attention"] == list(range(3, 48, 4))
    assert c["quantization_config"] == presets.anchor_nvfp4_quantization_config()
    plain = bench.write_config(str(tmp_path / "b"), 48, "fn")
    assert "quantization_config" not in plain
    q, b = bench.roofline_bytes(c, 50_000), bench.roofline_bytes(plain, 50_000)
    # only the routed experts change: their bytes fall from 2 to 0.5625 a weight
    k, d, i = c["num_experts_per_tok"], c["hidden_size"], c["moe_intermediate_size"]
    assert abs((b["weights"] - q["weights"]) - 48 * k * 3 * d * i * (2 - 0.5625)) < 1e3
    assert q["gdn_state"] == b["gdn_state"] and q["qsa_kv"] == b["qsa_kv"]
    assert 9e9 < q["total"] < 11e9  # the anchor's arithmetic: ~9.9 GB a step
    args = bench.build_parser().parse_args(["--preset", "fn-nvfp4"])
    bench.apply_preset(args)
    assert (args.layers, args.gpu_util, args.gpu_util_ours, args.bs8_ctx) == (48, 0.92, 0.92, 50_000)
    args = bench.build_parser().parse_args(["--preset", "fn-nvfp4", "--gpu-util-ours", "0.9", "--layers", "24"])
    bench.apply_preset(args)
    assert (args.layers, args.gpu_util_ours) == (24, 0.9)
    args = bench.build_parser().parse_args([])
    bench.apply_preset(args)
    assert (args.layers, args.gpu_util, args.gpu_util_ours, args.bs8_ctx) == (12, 0.85, 0.7, 0)


def test_moe_backend_is_read_from_the_worker_log(tmp_path):
    log = tmp_path / "w.log"
    log.write_text("INFO x Using 'MARLIN' NvFp4 MoE backend out of [...]\nINFO y Using 'HUMMING' NvFp4 MoE backend\n")
    assert bench.moe_backend(str(log)) == "NVFP4:HUMMING"
    log.write_text("INFO Using TRITON Unquantized MoE backend out of potential backends: [...]\n")
    assert bench.moe_backend(str(log)) == "TRITON"
    assert bench.moe_backend(str(tmp_path / "missing.log")) == ""


def test_jit_during_inference_is_read_from_the_worker_log(tmp_path):
    log = tmp_path / "w.log"
    log.write_text("WARNING [jit_monitor.py:140] Triton kernel JIT compilation during inference: _qsa_attn_loop_kernel"
                   " (signature ...). This causes a latency spike; consider extending warmup to cover this shape.\n"
                   "WARNING x CuTeDSL JIT compilation during inference: fused_mix. This causes a latency spike\n"
                   "WARNING y Triton kernel JIT compilation during inference: _qsa_attn_loop_kernel (other)\n")
    assert bench.jit_during_inference(str(log)) == "_qsa_attn_loop_kernel;fused_mix"
    log.write_text("INFO Kernel JIT monitor activated; monitored JIT compilations during inference will use mode=warn.\n")
    assert bench.jit_during_inference(str(log)) == ""
    assert bench.jit_during_inference(str(tmp_path / "missing.log")) == ""


class DraftingEngine(ScriptedEngine):
    """ScriptedEngine whose decode steps give every request ``per_step`` tokens (1 + accepted MTP drafts)."""

    def __init__(self, prefill_steps: int, per_step):
        super().__init__(prefill_steps)
        self.per_step = per_step  # callable: step index -> tokens
        self.n = 0

    def step(self):
        outs = super().step()
        self.n += 1
        extra = self.per_step(self.n) - 1
        for o in outs:
            r = next(r for r in self.reqs if r[0] == o.request_id)
            if r[3] == 0 and len(o.outputs[0].token_ids) > 1:  # decoding (not the prefill's first token)
                r[2] = min(r[1], r[2] + extra)
                o.outputs[0].token_ids = [0] * r[2]
        return outs


def test_timed_steps_count_the_tokens_each_gained():
    """With MTP a decode step gives 1 + accepted drafts a request: ``counts`` gets what the whole batch gained in
    each timed step, so tokens a step a request = sum / steps / batch is the acceptance length reached."""
    eng = DraftingEngine(prefill_steps=2, per_step=lambda n: 1 + n % 3)  # 1, 2, 3, 1, 2, 3, ... tokens
    counts = []
    _, _, steps, _ = bench._drive(eng, [[1, 2]] * 4, 120, counts=counts)
    assert len(counts) == len(steps) > 10
    assert all(c % 4 == 0 and 4 <= c <= 12 for c in counts), counts  # every request of the 4 gains alike
    assert 1.5 < sum(counts) / len(counts) / 4 < 2.5  # mean of 1, 2, 3
    plain = []
    bench._drive(ScriptedEngine(prefill_steps=2), [[1, 2]] * 4, 60, counts=plain)
    assert plain and set(plain) == {4}


def test_mtp_config_is_vllms_synthetic_acceptance():
    c = bench.mtp_config(3, 3.23)
    assert c == {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
                 "synthetic_acceptance_length": 3.23}
    import pytest

    for bad in (0.5, 4.5):
        with pytest.raises(SystemExit, match="acceptance-length"):
            bench.mtp_config(3, bad)


class CappedEngine(ScriptedEngine):
    """ScriptedEngine whose KV room holds ``cap`` requests: the rest wait until one finishes. Its scheduler (where the
    bench reads preemptions, as in vLLM's in-process engine core) lists the unfinished requests; those whose arrival
    index is in ``preempt`` show one preemption each, and leave the scheduler when they finish."""

    def __init__(self, prefill_steps: int, cap: int, preempt=()):
        super().__init__(prefill_steps)
        self.cap, self.preempt, self.waiting = cap, set(preempt), []
        self.sched = types.SimpleNamespace(requests={})
        self.engine_core = types.SimpleNamespace(engine_core=types.SimpleNamespace(scheduler=self.sched))

    def _resident(self):
        return sum(r[2] < r[1] for r in self.reqs)

    def add_request(self, rid, prompt, sp):
        i = len(self.sched.requests) + sum(r[2] >= r[1] for r in self.reqs)
        self.sched.requests[rid] = types.SimpleNamespace(request_id=rid, num_preemptions=int(i in self.preempt))
        (self.reqs if self._resident() < self.cap else self.waiting).append([rid, sp.max_tokens, 0, self.prefill_steps])

    def has_unfinished_requests(self):
        return bool(self.waiting) or super().has_unfinished_requests()

    def step(self):
        outs = super().step()
        for r in self.reqs:
            if r[2] >= r[1]:
                self.sched.requests.pop(r[0], None)
        while self.waiting and self._resident() < self.cap:
            self.reqs.append(self.waiting.pop(0))
        return outs


def test_drive_records_the_most_decoding_at_once_and_the_preemptions():
    """A KV room of 3 for a batch of 4: no step has all 4 decoding, at most 3 decode together; the preemptions of
    requests that have since finished still count. Without an in-process scheduler (--mp) they are not counted."""
    eng, facts = CappedEngine(prefill_steps=1, cap=3, preempt=(0, 2)), {}
    _, _, steps, ntok = bench._drive(eng, [[1]] * 4, 12, facts=facts)
    assert steps == [] and ntok == 4 * 12 and eng.sched.requests == {}
    assert facts == {"max_decoding": 3, "preemptions": 2}
    facts = {}
    _, _, steps, _ = bench._drive(ScriptedEngine(prefill_steps=1), [[1]] * 4, 20, facts=facts)
    assert steps and facts == {"max_decoding": 4, "preemptions": None}


def test_missing_reason_says_why_a_batch_figure_is_missing():
    """The reason names the KV room in requests (floor of 1,544,960 / 50,320 = 30.7), the most requests that decoded
    together and the preemptions; nothing when the figure was measured."""
    assert bench.missing_reason(32, 50_320, 41, 32, 0, 1_544_960) is None
    assert bench.missing_reason(32, 50_320, 0, 29, 12, 1_544_960) == (
        "KV 30/32", "KV room 1,544,960 tokens holds 30 of 32 requests of 50,320 tokens; "
        "no step had all 32 decoding: at most 29 decoded at once, 12 preemptions")
    # room enough and nothing preempted: the output was too short to outlast the batch's prefill
    assert bench.missing_reason(8, 50_096, 0, 5, 0, 4_000_000) == (
        "max 5/8 decoding", "no step had all 8 decoding: at most 5 decoded at once, 0 preemptions (the first "
        "finished before the last began decoding: raise --bs8-tokens)")
    assert bench.missing_reason(32, 1000, 0, 31, None, None)[1] == (
        "no step had all 32 decoding: at most 31 decoded at once, preemptions not counted (engine core in another "
        "process)")
    assert bench.missing_reason(32, 50_320, None, None, None, 1_544_960, "timeout 560s (see ours.log)") == (
        "KV 30/32", "KV room 1,544,960 tokens holds 30 of 32 requests of 50,320 tokens; "
        "batch 32 not reached (timeout 560s (see ours.log))")
    assert bench.kv_warning(32, 50_320, 1_544_960) == (
        "batch 32: KV room 1,544,960 tokens holds 30 of 32 requests of 50,320 tokens: no step may have all 32 "
        "decoding (trying anyway)")
    assert bench.kv_warning(32, 50_320, 32 * 50_320) is None and bench.kv_warning(32, 50_320, None) is None


def test_kv_room_comes_from_the_engine_or_the_log(tmp_path):
    cc = types.SimpleNamespace(num_gpu_blocks=100, block_size=16, kv_cache_size_tokens=1_544_960)
    eng = types.SimpleNamespace(vllm_config=types.SimpleNamespace(cache_config=cc))
    assert bench.kv_room(eng) == {"kv_tokens": 1_544_960, "kv_blocks": 100, "kv_block_size": 16}
    cc.kv_cache_size_tokens = None  # (a vLLM without it: blocks x block size)
    assert bench.kv_room(eng)["kv_tokens"] == 1600
    log = tmp_path / "w.log"
    log.write_text("INFO [kv_cache_utils.py:2327] GPU KV cache size: 1,544,960 tokens, Maximum concurrency for "
                   "50,320 tokens per request: 30.70x\n")
    assert bench.kv_tokens_from_log(str(log)) == 1_544_960
    assert bench.kv_tokens_from_log(str(tmp_path / "missing.log")) is None


def test_table_csv_and_ratios_say_why_instead_of_nan(tmp_path):
    """ours could not time a batch-32 step (its KV room holds 30.7 requests of 50,320 tokens): the table's cells
    read the short reason and a footnote the full one, the CSV leaves the figures empty beside ``bs32_why``, the
    ratio says n/a and why; upstream's figures stay as they were. No "nan" anywhere."""
    import csv
    import re

    nan = float("nan")
    ours = dict(impl="ours", bs1_tpot_ms=10.0, kv_tokens=1_544_960, bs32_ctx=50_000, bs32_steps=0, bs32_step_ms=nan,
                bs32_tokens_per_step=nan, bs32_tok_s_user=nan, bs32_decode_tok_s=nan, bs32_max_decoding=29,
                bs32_preemptions=12, roofline_ms=nan)
    up = dict(impl="upstream", bs1_tpot_ms=20.0, kv_tokens=3_000_000, bs32_ctx=50_000, bs32_steps=40,
              bs32_step_ms=80.0, bs32_tokens_per_step=1.0, bs32_tok_s_user=12.5, bs32_decode_tok_s=400.0,
              bs32_max_decoding=32, bs32_preemptions=0, roofline_ms=nan)
    for r in (ours, up):
        bench.fill_reasons(r, {32: 50_320}, 50_320)
    assert ours["kv_requests"] == 30.7 and up["kv_requests"] == 59.62 and up["bs32_why"] == ""
    why = ("KV room 1,544,960 tokens holds 30 of 32 requests of 50,320 tokens; no step had all 32 decoding: at most "
           "29 decoded at once, 12 preemptions")
    assert ours["bs32_why"] == why

    table = bench.results_table([ours, up])
    assert not re.search(r"\bnan\b", table, re.I), table
    head, *body = table.split("\n")
    cols = [c.strip() for c in head.strip("|").split("|")]
    cells = {line.split("|")[1].strip(): dict(zip(cols, (c.strip() for c in line.strip("|").split("|"))))
             for line in body[1:3]}
    assert cells["ours"]["bs32_step_ms"] == "KV 30/32 [1]" and cells["ours"]["bs32_decode_tok_s"] == "n/a [1]"
    assert cells["ours"]["bs32_max_decoding"] == "29" and cells["ours"]["bs32_preemptions"] == "12"
    assert cells["ours"]["kv_tokens"] == "1544960" and cells["ours"]["kv_requests"] == "30.7"
    assert cells["upstream"]["bs32_step_ms"] == "80" and "bs32_why" not in cols
    assert cells["ours"]["roofline_ms"] == "n/a"
    assert body[-1] == "[1] ours, batch 32: " + why and body[-2] == ""

    path = tmp_path / "results.csv"
    bench.write_csv([ours, up], str(path))
    assert "nan" not in path.read_text().lower()
    got = {r["impl"]: r for r in csv.DictReader(open(path))}
    assert got["ours"]["bs32_why"] == why and got["ours"]["bs32_step_ms"] == ""
    assert got["ours"]["kv_tokens"] == "1544960" and got["ours"]["kv_requests"] == "30.7"
    assert got["upstream"]["bs32_step_ms"] == "80.0" and got["upstream"]["bs32_why"] == ""

    lines = bench.ratio_lines({"ours": ours, "upstream": up}, [("ours", "upstream")])
    assert "bs1_tpot_ms: ours/upstream = 0.50" in lines
    assert "bs32_step_ms: ours/upstream n/a (ours: KV 30/32)" in lines
    assert "bs32_decode_tok_s: ours/upstream n/a (ours: KV 30/32)" in lines
    assert not any("nan" in line for line in lines), lines


def test_profile_of_an_engine_in_its_own_process_waits_for_its_trace_or_says_why(tmp_path):
    """--mp --profile: vLLM's engine core writes the trace after stop_profile returns (run 28 found no table and no
    word why): the trace named after the profile is awaited until its size holds; none at all is said in the table
    file instead."""
    import threading

    d = tmp_path
    trace = d / "ours_profile.pt.trace.json.gz"

    def write_late():  # the engine core's write, a moment after stop_profile
        import time
        time.sleep(0.5)
        trace.write_bytes(b"x" * 100)

    t = threading.Thread(target=write_late)
    t.start()
    got = bench._await_trace(str(d), "ours_profile", wait_s=20)
    t.join()
    assert got == str(trace)

    class LLM:
        def start_profile(self, prefix):
            pass

        def stop_profile(self):
            pass

    engine = types.SimpleNamespace(has_unfinished_requests=lambda: False, step=lambda: None)
    bench.TRACE_WAIT_S, old = 0.1, bench.TRACE_WAIT_S
    try:
        bench._profile_steps(engine, 8, str(d / "other_profile.txt"), 40, llm=LLM())
    finally:
        bench.TRACE_WAIT_S = old
    text = (d / "other_profile.txt").read_text()
    assert text.startswith("no profile: vLLM's profiler wrote no trace named other_profile*"), text


def test_requests_that_end_before_the_profiled_steps_say_so(tmp_path):
    """Run 29: the MTP requests of the decode profile ended before their 32nd step and left no table and no word."""
    path = tmp_path / "ours.profile.txt"
    eng = ScriptedEngine(prefill_steps=1)
    bench._drive(eng, [[1]], 20, profile_to=str(path))
    assert path.read_text().startswith("no profile: the requests ended after")


@pytest.mark.parametrize("mtp,accept", [(0, 3.23), (3, 3.23), (3, 4.0), (1, 1.0)])
def test_profile_requests_outlast_the_profiled_steps(mtp, accept):
    """Enough tokens for steps PROFILE_AT_STEP..+PROFILE_STEPS at the mean tokens a step (1 without MTP)."""
    per_step = accept if mtp else 1.0
    assert bench.profile_tokens(mtp, accept) / per_step > bench.PROFILE_AT_STEP + bench.PROFILE_STEPS


def test_batch_tokens_scale_with_the_mtp_acceptance_unless_given():
    args = bench.build_parser().parse_args(["--mtp", "3", "--acceptance-length", "3.0"])
    bench.apply_preset(args)
    assert (args.bs8_tokens, args.bs32_tokens) == (288, 576)
    args = bench.build_parser().parse_args(["--mtp", "3", "--bs32-tokens", "100"])
    bench.apply_preset(args)
    assert args.bs32_tokens == 100
    args = bench.build_parser().parse_args([])
    bench.apply_preset(args)
    assert (args.bs8_tokens, args.bs32_tokens) == (96, 192)


def test_census_layers_and_figures():
    """The census cuts a profiled step at the target's layers plus the MTP draft's runs, or the target's alone."""
    assert bench.step_layers(24, 3) == (27, 24) and bench.step_layers(24, 3, prefill=True) == (25, 24)
    assert bench.step_layers(24, 0) == (24,)
    c = dict(kernels_per_step=812.4, gdn=dict(kernels=31, wall_us=80.123), qsa=dict(kernels=40, wall_us=95.0))
    assert bench.census_figures(c) == dict(kernels_per_step=812, gdn_layer_kernels=31, gdn_layer_us=80.12,
                                           qsa_layer_kernels=40, qsa_layer_us=95.0)
