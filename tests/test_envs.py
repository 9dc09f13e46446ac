"""``qwen4exp.envs``: every switch parses its default and its choices, a bad value is refused by name, ``reset``
re-reads the environment, and no code under ``qwen4exp/`` reads a ``QWEN4EXP_*`` variable around it (so a new
switch has to be declared there); the README names only declared switches."""

import ast
import os
import re

import pytest

from qwen4exp import envs

ROOT = os.path.join(os.path.dirname(__file__), "..")
PACKAGE = os.path.join(ROOT, "qwen4exp")
_CHOICES = {"bool": [("1", True), ("0", False), ("true", True), ("False", False), ("on", True), ("no", False)],
            "path": [("/some/folder", "/some/folder"), ("  rel/dir ", "rel/dir")],
            "float": [("0", 0.0), ("2.5", 2.5), (" 30 ", 30.0)], "int": [("0", 0), (" 17 ", 17)]}
_BAD = {"bool": "2", "choice": "no-such-choice", "float": "-1", "int": "1.5"}


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for name in envs.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    envs.reset()
    yield
    envs.reset()


def test_switches_declared():
    assert set(envs.SWITCHES) == {"QWEN4EXP_VLLM", "QWEN4EXP_OPS", "QWEN4EXP_VLLM_GDN", "QWEN4EXP_PLE_TABLE",
                                  "QWEN4EXP_PLE_PREFETCH", "QWEN4EXP_CACHE_DIR", "QWEN4EXP_SESSION_TTL",
                                  "QWEN4EXP_FAULT_INJECT", "QWEN4EXP_IDLE_TRIM", "QWEN4EXP_QSA_WARMUP",
                                  "QWEN4EXP_HC_DECODE", "QWEN4EXP_CONTINUATION_CHUNK", "QWEN4EXP_PAUSE_CHUNK",
                                  "QWEN4EXP_TOKENIZE_CACHE_TOKENS", "QWEN4EXP_MOE_DECODE",
                                  "QWEN4EXP_QSA_PREFILL_SELECT", "QWEN4EXP_QSA_HOST_LENGTHS", "QWEN4EXP_PLE_VERIFY",
                                  "QWEN4EXP_MTP_DRAFT_HEAD", "QWEN4EXP_MTP_DRAFT_VOCAB", "QWEN4EXP_MTP_DRAFT_VOCAB_FILE"}
    for name, s in envs.SWITCHES.items():
        assert s.name == name and s.doc and s.kind in ("bool", "choice", "path", "float", "int")
        assert (s.kind == "choice") == bool(s.choices)
        if s.kind == "choice":
            assert s.default in s.choices
    assert envs.SWITCHES["QWEN4EXP_VLLM_GDN"].choices == ("auto", "ours", "vllm")


@pytest.mark.parametrize("name", sorted(envs.SWITCHES))
def test_default_and_choices_parse(name, monkeypatch):
    s = envs.SWITCHES[name]
    assert getattr(envs, name) == s.default  # unset
    monkeypatch.setenv(name, "")
    envs.reset()
    assert getattr(envs, name) == s.default  # set but empty
    cases = [(c, c) for c in s.choices] + [(c.upper(), c) for c in s.choices] + _CHOICES.get(s.kind, [])
    for raw, want in cases:
        monkeypatch.setenv(name, raw)
        envs.reset()
        assert getattr(envs, name) == want, raw
        assert envs.get(name) == want
        assert s.parse(raw) == want


@pytest.mark.parametrize("name", sorted(n for n, s in envs.SWITCHES.items() if s.kind in _BAD))
def test_bad_value_names_the_variable(name, monkeypatch):
    bad = _BAD[envs.SWITCHES[name].kind]
    monkeypatch.setenv(name, bad)
    envs.reset()
    with pytest.raises(ValueError, match=name) as e:
        getattr(envs, name)
    assert bad in str(e.value)
    with pytest.raises(ValueError, match=name):
        envs.get(name, {name: bad})


def test_float_switch_refuses_text(monkeypatch):
    monkeypatch.setenv("QWEN4EXP_SESSION_TTL", "ten")
    with pytest.raises(ValueError, match="QWEN4EXP_SESSION_TTL must be a number"):
        envs.QWEN4EXP_SESSION_TTL


def test_values_kept_until_reset(monkeypatch):
    monkeypatch.setenv("QWEN4EXP_PLE_TABLE", "gpu")
    assert envs.QWEN4EXP_PLE_TABLE == "gpu"
    monkeypatch.setenv("QWEN4EXP_PLE_TABLE", "host")
    assert envs.QWEN4EXP_PLE_TABLE == "gpu"  # parsed once, kept for the process
    envs.reset()
    assert envs.QWEN4EXP_PLE_TABLE == "host"  # re-read


def test_explicit_environment_is_read_fresh(monkeypatch):
    monkeypatch.setenv("QWEN4EXP_CACHE_DIR", "/from/process")
    assert envs.get("QWEN4EXP_CACHE_DIR", {"QWEN4EXP_CACHE_DIR": "/from/mapping"}) == "/from/mapping"
    assert envs.get("QWEN4EXP_CACHE_DIR", {}) == ""
    assert envs.QWEN4EXP_CACHE_DIR == "/from/process"


def test_unknown_names_refused():
    with pytest.raises(AttributeError, match="QWEN4EXP_NOPE"):
        envs.QWEN4EXP_NOPE
    with pytest.raises(AttributeError):
        envs.get("QWEN4EXP_NOPE")
    assert "QWEN4EXP_OPS" in dir(envs)


def test_table_lists_every_switch():
    t = envs.table(lambda name: "gpu" if name == "QWEN4EXP_PLE_TABLE" else None)
    rows = t.splitlines()
    assert len(rows) == 2 + len(envs.SWITCHES)
    for name in envs.SWITCHES:
        assert sum(f"`{name}`" in r for r in rows) == 1
    assert "| gpu |" in next(r for r in rows if "QWEN4EXP_PLE_TABLE" in r)


# ----------------------------------------------------------------------------------------- nothing reads around it
_ENV_CALLS = {"get", "getenv", "pop", "setdefault", "getenvb"}


def _env_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of every ``QWEN4EXP_*`` literal read from an environment: ``os.environ.get("X")``,
    ``os.getenv("X")``, ``os.environ["X"]``, ``"X" in os.environ``, and the same through any mapping whose
    expression names ``environ`` or ``env`` (``env.get("X")``)."""
    found = []

    def envish(node) -> bool:
        text = ast.unparse(node)
        return bool(re.search(r"\b(os\.environ|environ|env|environment)\b", text)) or text == "os"

    def name_of(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("QWEN4EXP_"):
            return node.value
        return None

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _ENV_CALLS:
            if envish(node.func.value) and node.args and name_of(node.args[0]):
                found.append((node.lineno, name_of(node.args[0])))
        elif isinstance(node, ast.Subscript) and envish(node.value) and name_of(node.slice):
            found.append((node.lineno, name_of(node.slice)))
        elif isinstance(node, ast.Compare) and name_of(node.left) and any(envish(c) for c in node.comparators):
            found.append((node.lineno, name_of(node.left)))
    return found


def test_detector_finds_reads():
    src = ('import os\nos.environ.get("QWEN4EXP_A", "1")\nos.getenv("QWEN4EXP_B")\nos.environ["QWEN4EXP_C"]\n'
           '"QWEN4EXP_D" in os.environ\nenv.get("QWEN4EXP_E")\nos.environ.get("OTHER")\nd.get("QWEN4EXP_F")\n')
    assert [n for _, n in _env_reads(src)] == ["QWEN4EXP_A", "QWEN4EXP_B", "QWEN4EXP_C", "QWEN4EXP_D", "QWEN4EXP_E"]


def test_no_switch_read_outside_envs():
    offenders = []
    for dirpath, _, files in os.walk(PACKAGE):
        for f in files:
            path = os.path.join(dirpath, f)
            if not f.endswith(".py") or os.path.samefile(path, envs.__file__):
                continue
            with open(path, encoding="utf-8") as fh:
                for line, name in _env_reads(fh.read()):
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{line} reads {name}")
    assert not offenders, ("read QWEN4EXP_* switches through qwen4exp.envs (declare new ones there): "
                           + "; ".join(offenders))


def test_docs_name_only_declared_switches():
    """The README and docs/ (where the README's switch tables moved) name only declared switches."""
    import glob

    named = {}
    for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        with open(path, encoding="utf-8") as f:
            for n in re.findall(r"\bQWEN4EXP_[A-Z0-9_]*[A-Z0-9]", f.read()):
                named.setdefault(n, os.path.relpath(path, ROOT))
    assert "QWEN4EXP_OPS" in named  # (the docs do document the switches: a scan that found none proves nothing)
    undeclared = sorted(f"{where}: {n}" for n, where in named.items()
                        if n not in envs.SWITCHES and n not in envs.DEV_SWITCHES)
    assert not undeclared, f"the docs name switches that qwen4exp/envs.py does not declare: {undeclared}"


def test_every_name_the_tests_tools_and_benchmarks_read_is_declared():
    """Every QWEN4EXP_* name read from an environment by the tests, tools, benchmarks and recipes (Python reads,
    and names the Makefile and the shell tools set or read) is declared in ``envs.SWITCHES`` or
    ``envs.DEV_SWITCHES``; the two tables do not overlap."""
    assert not set(envs.SWITCHES) & set(envs.DEV_SWITCHES)
    declared = set(envs.SWITCHES) | set(envs.DEV_SWITCHES)
    undeclared = []
    for top in ("tests", "tools", "benchmarks", "recipes"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(dirpath, f)
                if f.endswith(".py") and f != "test_envs.py":
                    with open(path, encoding="utf-8") as fh:
                        names = [n for _, n in _env_reads(fh.read())]
                elif f.endswith(".sh"):
                    with open(path, encoding="utf-8") as fh:
                        names = re.findall(r"\b(QWEN4EXP_[A-Z0-9_]+)=", fh.read())
                else:
                    continue
                undeclared += [f"{os.path.relpath(path, ROOT)}: {n}" for n in names if n not in declared]
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as fh:
        undeclared += [f"Makefile: {n}" for n in re.findall(r"\b(QWEN4EXP_[A-Z0-9_]+)=", fh.read())
                       if n not in declared]
    gone = {"QWEN4EXP_QSA_METADATA"}  # (a removed switch a test sets to show it changes nothing)
    assert not [u for u in undeclared if u.split(": ")[1] not in gone], undeclared
    rows = envs.table(switches=envs.DEV_SWITCHES).splitlines()
    assert len(rows) == 2 + len(envs.DEV_SWITCHES)


def test_typed_accessors_match_the_switches():
    """The TYPE_CHECKING block of envs.py names every switch with the type its kind parses to (Optional where the
    default is None), and nothing else."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(envs))
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    declared = {st.target.id: ast.unparse(st.annotation) for st in block.body if isinstance(st, ast.AnnAssign)}
    want = {}
    for name, sw in envs.SWITCHES.items():
        t = envs.KIND_TYPES[sw.kind]
        want[name] = f"Optional[{t}]" if sw.default is None else t
    assert declared == want
    for name, sw in envs.SWITCHES.items():  # the defaults are of those types
        if sw.default is not None:
            assert type(sw.default).__name__ == envs.KIND_TYPES[sw.kind], name
