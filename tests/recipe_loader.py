"""Import a script of ``recipes/`` (not a package) as a module, for tests of its functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def load_recipe(name: str):
    """``recipes/<name>.py`` as a fresh module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
