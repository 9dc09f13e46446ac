"""The README's commands run as written (issue 54 items 2 and 9).

Every fenced ``bash`` / ``python`` block of README.md is one of the constants below, word for word
(``test_readme_holds_exactly_the_tested_blocks``: a block added or edited in the README without its test fails), and
each is run here at CPU scale from the repository root:

* ``MAKE_BLOCK``: ``make demo`` runs as written; ``make test`` (the whole suite, this file included) is checked with
  ``make -n`` to run pytest over ``tests/``;
* ``SERVE_BLOCK`` + ``CLIENT_BLOCK``: the ``qwen4exp-serve`` line, then the OpenAI client against it; the block's
  ``vllm serve`` line is ``tests/test_newcomer.py::test_vllm_serve_as_the_readme_writes_it``'s command;
* ``GPU_BLOCK`` (GPU only): parsed by vLLM's own ``vllm serve`` argument parser (every flag known, every value
  valid), not run;
* ``ROUTER_BLOCK`` (scaling out): ``make router`` is checked with ``make -n`` to install the router's lock, the
  ``qwen4exp.replicas`` line is parsed by the launcher's own parser into the replica and router commands it runs (not
  run here: ``tests/test_router.py`` runs the same launcher, ``qwen4exp.replicas.Fleet``, with these settings);
* ``IMAGE_BLOCK`` + ``IMAGE_CLIENT_BLOCK`` (the image quick start): ``make tiny-vl``, the ``qwen4exp-serve`` line, the
  OpenAI client with the example image, text back; then docs/images.md's HF snippet on the same checkpoint;
* the HF snippet (the README's first python block): ``tests/test_readme.py``.

"As written" but for one thing: a server line gets ``--port N`` appended (a free port, as 8000 may be taken) and the
clients' ``http://127.0.0.1:8000`` becomes that port. The landing page's bounds: at most 15,000 characters, lines at
most 120 (``test_readme_is_a_landing_page``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from served import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START_TIMEOUT = 240

MAKE_BLOCK = """\
make demo   # set up .venv (CPU stack) if missing, serve the embedded tiny checkpoint with vLLM, chat once
make test   # set up .venv if missing, run the whole test suite (what CI runs: .ci/run)
"""

SERVE_BLOCK = """\
.venv/bin/qwen4exp-serve qwen4exp/assets/tiny-coder --served-model-name tiny-coder --max-model-len 2048
.venv/bin/vllm serve qwen4exp/assets/tiny-coder --served-model-name tiny-coder --max-model-len 2048  # or vLLM's own
"""

CLIENT_BLOCK = """\
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
r = client.chat.completions.create(model="tiny-coder", max_tokens=48, temperature=0,
                                   messages=[{"role": "user", "content": "Write a Python function `is_prime(n)`."}])
print(r.choices[0].message.content)
"""

GPU_BLOCK = """\
vllm serve CHECKPOINT --max-model-len 65536 --max-num-seqs 32 --max-num-batched-tokens 16384 \\
    --gpu-memory-utilization 0.7
"""

ROUTER_BLOCK = """\
make router   # vllm-router 0.1.17 into the venv (the extra "router")
.venv/bin/python -m qwen4exp.replicas --replicas 2 --port 8000 \\
    -- --max-model-len 2048 --enforce-eager --num-gpu-blocks-override 40 --max-num-seqs 4
"""

IMAGE_BLOCK = """\
make tiny-vl   # .cache/tiny-vl: the checkpoint (recipes/vision_tiny.py) and an example.png, about 5 s
.venv/bin/qwen4exp-serve .cache/tiny-vl --served-model-name tiny-vl --max-model-len 4096 \\
    --limit-mm-per-prompt '{"image": 4}'
"""

IMAGE_CLIENT_BLOCK = """\
import base64

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
image = base64.b64encode(open(".cache/tiny-vl/example.png", "rb").read()).decode()
content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
           {"type": "text", "text": "Describe this image."}]
r = client.chat.completions.create(model="tiny-vl", max_tokens=32, temperature=0,
                                   messages=[{"role": "user", "content": content}])
print(r.choices[0].message.content)
"""

TESTED = {"bash": [MAKE_BLOCK, SERVE_BLOCK, GPU_BLOCK, ROUTER_BLOCK, IMAGE_BLOCK],
          "python": [CLIENT_BLOCK, IMAGE_CLIENT_BLOCK]}  # + the HF snippet, tests/test_readme.py


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of a Markdown text."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def command_lines(block: str) -> list[str]:
    """The shell commands of a bash block (a line ending in a backslash goes on: bash reads it so)."""
    return [c for c in re.split(r"(?<!\\)\n", block) if c.strip()]


def shell_argv(command: str) -> list[str]:
    """The words of a command as bash reads them (quotes, continuations and comments), program first."""
    script = "args() { printf '%s\\0' \"$@\"; }\nargs " + command
    out = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout.decode()
    return out.split("\0")[:-1]


def test_readme_holds_exactly_the_tested_blocks():
    blocks = fenced_blocks(README.read_text())
    langs = {lang for lang, _ in blocks}
    assert langs <= {"bash", "python", ""}, f"README.md blocks in a language this test does not run: {langs}"
    python = [b for lang, b in blocks if lang == "python"]
    assert python and "from transformers import AutoTokenizer" in python[0]  # the HF snippet: tests/test_readme.py
    assert python[1:] == TESTED["python"], "README.md's python blocks (after the HF snippet) differ from this file's"
    assert [b for lang, b in blocks if lang == "bash"] == TESTED["bash"], \
        "README.md's bash blocks differ from this file's constants: update both, and what runs them"


def test_readme_is_a_landing_page():
    text = README.read_text()
    assert len(text) <= 15_000, len(text)
    long = [(i + 1, len(line)) for i, line in enumerate(text.splitlines()) if len(line) > 120]
    assert not long, f"README.md lines over 120 characters (line, length): {long}"


def test_make_test_runs_the_suite():
    """``make test`` cannot run inside the suite it runs: ``make -n`` shows that it runs pytest over tests/."""
    p = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert re.search(r"^.*-m pytest .*\btests$", p.stdout, flags=re.M), p.stdout


def _need_built_venv(*exes: str) -> None:
    """The README's commands use the venv ``make venv`` builds; a ``make`` target there must not rebuild it."""
    for exe in exes:
        if not (ROOT / exe).exists():
            pytest.skip(f"{exe} is missing: the README's commands run in the venv `make venv` builds")
    if subprocess.run(["make", "-q", "venv"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("the venv is older than pyproject.toml / the lock: `make` would rebuild it (run `make venv`)")


def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    env.update(QWEN4EXP_CACHE_DIR=str(tmp / "cache"), TMPDIR=str(tmp))
    return env


class _Server:
    """A README server line run by bash from the repository root, with ``--port`` appended."""

    def __init__(self, line: str, tmp: Path):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "server.log"
        self.cmd = f"exec {line} --port {self.port}"
        self.tmp = tmp

    def __enter__(self):
        self.t0 = time.time()
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(["bash", "-c", self.cmd], cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=_env(self.tmp), start_new_session=True)
        try:
            wait_healthy(self.proc, self.base, self.log, self.t0, START_TIMEOUT, self.cmd)
        except BaseException:
            self.__exit__()
            raise
        self.startup = time.time() - self.t0
        return self

    def __exit__(self, *exc):
        from qwen4exp.demo import stop_server

        stop_server(self.proc)
        self._log.close()


def run_client(block: str, base: str, tmp: Path) -> str:
    """A README python client block against ``base`` (its ``http://127.0.0.1:8000`` replaced), from the repository
    root; its stdout."""
    assert block.count("http://127.0.0.1:8000/v1") == 1
    script = tmp / "client.py"
    script.write_text(block.replace("http://127.0.0.1:8000", base))
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=_env(tmp))
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@pytest.mark.vllm
def test_make_demo(tmp_path):
    """``make demo`` as written: the server comes up, one streamed answer, the server stops."""
    _need_built_venv(".venv/bin/python")
    line = MAKE_BLOCK.splitlines()[0]
    assert line.startswith("make demo ")
    t0 = time.time()
    p = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env(tmp_path))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "server ready in" in p.stdout and "assistant> " in p.stdout and "server stopped" in p.stdout, p.stdout
    assert re.search(r"TTFT \d+ ms, [1-9]\d* tokens", p.stdout), p.stdout
    print(f"make demo: {time.time() - t0:.1f} s")


@pytest.mark.vllm
def test_serve_and_openai_client(tmp_path):
    """The ``qwen4exp-serve`` line, then the OpenAI client block: text back for ``tiny-coder``."""
    _need_built_venv(".venv/bin/qwen4exp-serve")
    line = SERVE_BLOCK.splitlines()[0]
    assert line.startswith(".venv/bin/qwen4exp-serve ")
    from served import README_VLLM_SERVE  # the block's other line: run by tests/test_newcomer.py

    assert SERVE_BLOCK.splitlines()[1].startswith(README_VLLM_SERVE + "  #")
    with _Server(line, tmp_path) as s:
        out = run_client(CLIENT_BLOCK, s.base, tmp_path)
    assert re.search(r"[A-Za-z]{2,}", out), out
    print(f"qwen4exp-serve tiny-coder start-up {s.startup:.1f} s; answer {out[:60]!r}")


@pytest.mark.vllm
def test_gpu_line_parses():
    """GPU only: vLLM's ``vllm serve`` parser takes the line (no unknown flag, every value valid)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    words = shell_argv(GPU_BLOCK)
    assert words[:3] == ["vllm", "serve", "CHECKPOINT"], words
    argv = words[2:]
    args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    assert (args.model_tag, args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens,
            args.gpu_memory_utilization) == ("CHECKPOINT", 65536, 32, 16384, 0.7)
    text = README.read_text()
    i = text.index(GPU_BLOCK)
    assert "GPU only" in text[text.rindex("\n\n", 0, i):i], "the README marks the GPU line GPU only"


def test_router_block():
    """``make router`` installs requirements-router.lock into the venv; the ``qwen4exp.replicas`` line, read by the
    launcher's own parser, starts 2 AgentScheduler replicas with the block's serve arguments on ports 8001-8002
    behind the router on 8000 with the default (session-affine) policy."""
    from qwen4exp.replicas import DEFAULT_POLICY, from_args, scheduler_cls

    make_line, replicas_line = command_lines(ROUTER_BLOCK)
    assert shell_argv(make_line) == ["make", "router"]
    # -B: the recipe even where `make test` already installed it (the clean-clone CI: the stamp is up to date)
    dry = subprocess.run(["make", "-n", "-B", "router"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "install -q --no-deps -r requirements-router.lock" in dry, dry
    words = shell_argv(replicas_line)
    assert words[:3] == [".venv/bin/python", "-m", "qwen4exp.replicas"], words
    fleet, args = from_args(words[3:])
    assert (args.replicas, fleet.port, fleet.policy, fleet.replica_ports) == (2, 8000, DEFAULT_POLICY, [8001, 8002])
    cmd = fleet.replica_cmd(8001)
    i = cmd.index("--scheduler-cls")
    assert cmd[i + 1] == scheduler_cls() and "--enable-prompt-tokens-details" in cmd, cmd
    assert cmd[-7:] == ["--max-model-len", "2048", "--enforce-eager", "--num-gpu-blocks-override", "40",
                        "--max-num-seqs", "4"], cmd


def _hf_image_snippet() -> str:
    blocks = [b for lang, b in fenced_blocks((ROOT / "docs" / "images.md").read_text()) if lang == "python"]
    assert len(blocks) == 1 and 'path = ".cache/tiny-vl"' in blocks[0]
    return blocks[0]


@pytest.mark.vllm
def test_image_quick_start(tmp_path):
    """The README's image commands as written: ``make tiny-vl`` builds the checkpoint, the ``qwen4exp-serve`` line
    serves it, the OpenAI client sends the example image and gets text back; docs/images.md's HF snippet runs on the
    same checkpoint."""
    _need_built_venv(".venv/bin/qwen4exp-serve")
    make_line, serve_line = command_lines(IMAGE_BLOCK)
    assert make_line.startswith("make tiny-vl ") and serve_line.startswith(".venv/bin/qwen4exp-serve .cache/tiny-vl ")
    t0 = time.time()
    p = subprocess.run(["bash", "-c", make_line], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=_env(tmp_path))
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    built = time.time() - t0
    ckpt = ROOT / ".cache" / "tiny-vl"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json", "example.png"):
        assert (ckpt / f).is_file(), f
    with _Server(serve_line, tmp_path) as s:
        out = run_client(IMAGE_CLIENT_BLOCK, s.base, tmp_path)
        log = s.log.read_text()
    assert out.strip(), out
    assert "is served by the qwen4exp plugin" in log
    script = tmp_path / "hf_image.py"
    script.write_text(_hf_image_snippet())
    t1 = time.time()
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=_env(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip(), p.stdout
    print(f"make tiny-vl {built:.1f} s, server start-up {s.startup:.1f} s, HF snippet {time.time() - t1:.1f} s")


def test_image_serve_line_over_the_checkpoint_is_one_line(tmp_path, monkeypatch):
    """The README's image serve line used to say ``--max-model-len 8192``: over the tiny checkpoint's
    ``max_position_embeddings`` (4096), where vLLM stops with a 56-line pydantic traceback. ``qwen4exp-serve`` says
    so in one line, before vLLM is imported (fast); the README's value fits."""
    from vision_checkpoint import build_vision_checkpoint

    from qwen4exp.configuration import load_config

    d = build_vision_checkpoint(str(tmp_path / "vl"))
    limit = load_config(d).text_config.max_position_embeddings
    assert f"--max-model-len {limit} " in IMAGE_BLOCK
    exe = shutil.which("qwen4exp-serve", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "qwen4exp.serve"]
    for value in ("8192", "8k", "5K"):
        t0 = time.time()
        p = subprocess.run(cmd + [d, "--max-model-len", value], capture_output=True, text=True, timeout=120,
                           env=_env(tmp_path))
        dt = time.time() - t0
        assert p.returncode == 1 and p.stdout == "", p
        lines = p.stderr.strip().splitlines()
        want = (f"--max-model-len {value} is longer than the checkpoint's max_position_embeddings {limit}",
                f"pass --max-model-len {limit} or less")
        assert len(lines) == 1 and all(w in lines[0] for w in want), lines
        assert dt < 30, dt
    from qwen4exp.serve import max_model_len_error

    cfg = load_config(d)
    for ok in (["--max-model-len", str(limit)], ["--max-model-len", "auto"], ["--max-model-len=-1"], []):
        assert max_model_len_error(ok, cfg, d) is None, ok
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert max_model_len_error(["--max-model-len", "8192"], cfg, d) is None  # vLLM's override
