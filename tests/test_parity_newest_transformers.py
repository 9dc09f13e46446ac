"""The parity job beside the locked one: ``tests/test_parity_upstream.py`` (our HF reference against upstream's own
``qwen4_exp``: full-forward logits, greedy tokens, cached decode, ragged batches, save/load both ways, on the fixed
and the seeded random tiny configs) run again with the newest transformers release, whose in-tree ``qwen4_exp`` is
then the oracle and whose ``PreTrainedModel`` runs our reference too.

The venv stays on its lock (transformers 5.19.0): ``requirements-transformers-newest.lock`` (transformers 5.25.0 and
the ``kernels`` package its ``from_pretrained`` needs for this model) is installed with ``--no-deps`` into
``.cache/transformers-newest`` (``make test`` does it; this test does it when that is missing or was built from
another lock), which goes first on ``PYTHONPATH`` in a subprocess. A side environment that cannot be built is a
failure naming the pip command and its error, never a skip."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements-transformers-newest.lock"
SIDE = ROOT / ".cache" / "transformers-newest"

pytestmark = pytest.mark.slow  # (builds the side environment from the package index on its first run)


def pins() -> dict[str, str]:
    """{name: version} of the lock's ``name==version`` lines."""
    out = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[name.strip()] = version.strip()
    return out


def side_env() -> Path:
    """``.cache/transformers-newest``, (re)built from the lock unless its stamp is a copy of the lock."""
    stamp = SIDE / ".stamp"
    if stamp.is_file() and stamp.read_text() == LOCK.read_text():
        return SIDE
    tmp = SIDE.with_name(SIDE.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), "-r", str(LOCK)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    if r.returncode:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.fail(f"cannot build the newest-transformers side environment {SIDE.relative_to(ROOT)} ("
                    f"{', '.join(f'{k}=={v}' for k, v in pins().items())}, from {LOCK.name}): `{' '.join(cmd)}` "
                    f"exited with status {r.returncode}: {(r.stderr or r.stdout).strip()[-2000:]}", pytrace=False)
    (tmp / ".stamp").write_text(LOCK.read_text())
    shutil.rmtree(SIDE, ignore_errors=True)
    os.replace(tmp, SIDE)
    return SIDE


def run_with_side_env(side: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python *args`` with ``side`` first on PYTHONPATH, on one CPU thread: the models are tiny, and on a shared
    2-core machine under load torch's two OpenMP threads made the parity file ~10x slower (84 s against 9 s for one
    config)."""
    path = os.pathsep.join([str(side), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1"))


def test_side_env_holds_the_newest_transformers_and_kernels():
    """The subprocess imports transformers and kernels from the side folder, at the lock's versions, and upstream's
    qwen4_exp from that transformers; the venv's own transformers is the locked one."""
    import transformers

    side, want = side_env(), pins()
    probe = ("import json, importlib.metadata as md, transformers, kernels\n"
             "from transformers.models.qwen4_exp import modeling_qwen4_exp as m\n"
             "print(json.dumps(dict(transformers=md.version('transformers'), kernels=md.version('kernels'), "
             "files=[transformers.__file__, kernels.__file__, m.__file__])))")
    r = run_with_side_env(side, "-c", probe)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert {k: got[k] for k in want} == want, got
    assert all(Path(f).resolve().is_relative_to(side.resolve()) for f in got["files"]), got["files"]
    assert transformers.__version__ != want["transformers"]  # (the main venv stays on its lock)


def test_parity_against_the_newest_transformers():
    """tests/test_parity_upstream.py, all of it, in the subprocess: the logits, greedy tokens and loading parity
    tests pass against the newest transformers' qwen4_exp (``from_pretrained`` of upstream's class included)."""
    r = run_with_side_env(side_env(), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                          "ignore::FutureWarning", "tests/test_parity_upstream.py")
    tail = (r.stdout + r.stderr)[-6000:]
    print(tail[-600:])
    assert r.returncode == 0, f"parity against transformers {pins()['transformers']} failed:\n{tail}"
    assert " passed" in tail and "skipped" not in tail and "failed" not in tail, tail


def test_a_side_env_that_cannot_be_built_is_a_failure(tmp_path, monkeypatch):
    """pip failing (here: a lock naming a wheel file that is not there, no index asked) fails the job, naming the
    folder, the pins and pip's error; nothing half-built is left."""
    lock = tmp_path / "newest.lock"
    lock.write_text(f"# a broken lock\n{tmp_path / 'no_such_pkg-1.0-py3-none-any.whl'}\n")
    monkeypatch.setattr(sys.modules[__name__], "LOCK", lock)
    monkeypatch.setattr(sys.modules[__name__], "SIDE", tmp_path / "side")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(pytest.fail.Exception) as e:
        side_env()
    msg = str(e.value)
    assert msg.startswith("cannot build the newest-transformers side environment side (") and "--no-deps" in msg
    assert "exited with status" in msg and "no_such_pkg-1.0-py3-none-any.whl" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newest.lock"]
