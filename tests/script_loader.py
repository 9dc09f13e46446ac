"""Import a script of ``benchmarks/``, ``tools/`` or ``recipes/`` (folders of scripts, not packages) as a module,
for tests of its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("benchmarks", "tools", "recipes")


def load_script(name: str):
    """``<folder>/<name>.py`` (the first of FOLDERS that has it) as a fresh module named ``name``."""
    for folder in FOLDERS:
        path = ROOT / folder / f"{name}.py"
        if path.exists():
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod  # (dataclasses look their module up while the script runs)
            spec.loader.exec_module(mod)
            return mod
    raise FileNotFoundError(f"no script {name}.py in {', '.join(FOLDERS)}")
