"""The package's import graph, read from the source (``ast``; nothing is imported): the serving stack
(``qwen4exp.serving``) sits on the model binding (``qwen4exp.vllm``) and never the other way round at import time.

Edges: every ``import`` / ``from ... import`` of a ``qwen4exp`` module in ``qwen4exp/**/*.py`` (relative imports
resolved; ``from P import name`` is an edge to ``P.name`` where that is a module, else to ``P``), marked top-level
(run when the module is imported: module and class bodies, ``try``/``if`` blocks; not ``if TYPE_CHECKING:``) or
lazy (inside a function). The patch registry's ``"module:function"`` strings are no edges: they are imported when a
patch is applied.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "qwen4exp"
SERVING, BINDING = "qwen4exp.serving", "qwen4exp.vllm"
# the model binding's only imports of the serving package, both inside a function (run after the binding is imported):
LAZY_BINDING_TO_SERVING = {
    ("qwen4exp.vllm", "qwen4exp.serving.media"),  # register_media_connector, where VLLM_MEDIA_CONNECTOR selects it
    ("qwen4exp.vllm.scheduler", "qwen4exp.serving.scheduler"),  # the old --scheduler-cls path, forwarding the class
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(mod: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The ``qwen4exp`` modules one import statement of ``mod`` names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in MODULES}
    if node.level:
        base = mod.split(".") if MODULES[mod].name == "__init__.py" else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    if not name.startswith("qwen4exp"):
        return set()
    out = set()
    for a in node.names:
        sub = f"{name}.{a.name}"
        if sub in MODULES:
            out.add(sub)
        elif name in MODULES:
            out.add(name)
    return out


def _edges() -> dict[tuple[str, str], bool]:
    """(importer, imported) -> whether some import of it runs at module import time."""
    edges: dict[tuple[str, str], bool] = {}

    def walk(mod: str, node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for c in child.orelse:
                    walk(mod, ast.Module(body=[c], type_ignores=[]), top)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, child):
                    if t != mod:
                        edges[(mod, t)] = edges.get((mod, t), False) or top
            walk(mod, child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    for mod, path in MODULES.items():
        walk(mod, ast.parse(path.read_text(), str(path)), True)
    return edges


EDGES = _edges()


def _in(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_graph_is_read():
    assert {"qwen4exp.serving.scheduler", "qwen4exp.vllm.model", "qwen4exp.vllm.patches"} <= set(MODULES)
    assert EDGES[("qwen4exp.serving.scheduler", "qwen4exp.serving.metrics")] is True  # top-level
    assert EDGES[("qwen4exp.serving.scheduler", "qwen4exp.vllm.patches")] is True
    assert EDGES[("qwen4exp.vllm", "qwen4exp.vllm.patches")] is False  # inside register()
    assert EDGES[("qwen4exp.vllm.model", "qwen4exp.envs")] is True  # (relative: from .. import envs)


def test_the_model_binding_does_not_import_the_serving_stack_at_import_time():
    top = sorted((a, b) for (a, b), t in EDGES.items() if t and _in(a, BINDING) and _in(b, SERVING))
    assert not top, top
    lazy = {(a, b) for (a, b), t in EDGES.items() if not t and _in(a, BINDING) and _in(b, SERVING)}
    assert lazy == LAZY_BINDING_TO_SERVING, "a new import of qwen4exp.serving in the model binding: " \
        "reach it through the patch registry (qwen4exp/vllm/patches.py) instead"


def _reach(start: str, edges) -> set[str]:
    """The modules ``start`` imports, directly or through others (every edge given, lazy ones too)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    seen, todo = set(), [start]
    while todo:
        for b in graph.get(todo.pop(), ()):
            if b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


@pytest.mark.parametrize("mod", ["qwen4exp.checkpoint", "qwen4exp.checkpoint_layout"])
def test_the_checkpoint_layout_reaches_no_runtime(mod):
    """The layout and its validator take expected shapes from the shared model assembly (``modeling``, ``layers``),
    never from a runtime's model class: no import of ``qwen4exp.hf`` or ``qwen4exp.vllm``, even inside a function
    (this was the cycle checkpoint -> hf.modeling -> hf.loading -> checkpoint)."""
    reached = _reach(mod, EDGES)
    assert "qwen4exp.modeling" in reached
    bad = sorted(m for m in reached if _in(m, "qwen4exp.hf") or _in(m, BINDING))
    assert not bad, bad


def test_no_cycle_through_the_checkpoint_loaders():
    """Neither at import time nor lazily: the layout, the validator and the two runtimes' loaders."""
    mods = {"qwen4exp.checkpoint", "qwen4exp.checkpoint_layout", "qwen4exp.hf.loading", "qwen4exp.vllm.weights"}
    bad = [c for c in _cycles(list(EDGES)) if mods & set(c)]
    assert not bad, bad


def test_the_patch_registry_names_existing_functions():
    """Entries pointing into the serving package are strings (imported when applied): each names a module and a
    top-level function of it."""
    from qwen4exp.vllm.patches import PATCHES

    for p in PATCHES:
        if p.apply is None:
            continue
        module, _, func = p.apply.partition(":")
        assert module in MODULES, p
        tree = ast.parse(MODULES[module].read_text())
        assert func in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, p


def test_no_cycle_between_serving_and_the_model_binding():
    top = [(a, b) for (a, b), t in EDGES.items() if t]
    mixed = [c for c in _cycles(top) if any(_in(m, SERVING) for m in c) and any(_in(m, BINDING) for m in c)]
    assert not mixed, mixed


def test_no_cycle_through_the_serving_stack():
    """Neither at import time nor through imports inside functions (the model binding's two allowed lazy imports
    aside: they run after the binding is imported, ``LAZY_BINDING_TO_SERVING``)."""
    every = [e for e in EDGES if e not in LAZY_BINDING_TO_SERVING]
    through = [c for c in _cycles(every) if any(_in(m, SERVING) for m in c)]
    assert not through, through


def test_top_level_cycles_elsewhere(capsys):
    """Any other import-time cycle of the package is printed (``-s`` shows it); none may involve the serving stack
    or the modules that left ``qwen4exp/vllm/`` for it."""
    cycles = _cycles([(a, b) for (a, b), t in EDGES.items() if t])
    with capsys.disabled():
        for c in cycles:
            print("import-time cycle:", " <-> ".join(c))
    assert not [c for c in cycles if any(_in(m, SERVING) or m == "qwen4exp.serve" for m in c)], cycles


@pytest.mark.parametrize("path", ["qwen4exp.vllm.scheduler.AgentScheduler",
                                  "qwen4exp.vllm.scheduler.AsyncAgentScheduler"])
def test_the_old_scheduler_path_forwards_to_the_serving_package(path):
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from qwen4exp.serving import scheduler

    assert resolve_obj_by_qualname(path) is getattr(scheduler, path.rsplit(".", 1)[1])


def test_the_old_scheduler_path_forwards_nothing_else():
    import qwen4exp.vllm.scheduler as old

    with pytest.raises(AttributeError, match="qwen4exp.serving.scheduler"):
        old.Sessions  # noqa: B018


def test_test_modules_import_helpers_not_each_other():
    """Shared test code lives in helper modules (tests/bench_support.py, served.py, prompts.py, ops/op_helpers.py,
    ...): no file under tests/ imports a ``test_*`` module, whose import would also hand pytest its tests."""
    tests = ROOT / "tests"
    names = {p.stem for p in tests.rglob("test_*.py")}
    bad = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(ROOT)} imports {m}" for m in mods if m.split(".")[0] in names]
    assert not bad, bad


def test_no_import_cycle_in_the_package():
    """Issue 53's bar: no cycle at all in ``qwen4exp/``, counting imports inside functions too (the media connector
    no longer imports the binding: ``register()`` hands it the connector's name)."""
    cycles = _cycles(list(EDGES))
    assert not cycles, cycles
