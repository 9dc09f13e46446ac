"""Upstream transformers' own ``qwen4_exp`` (the parity oracle): its modules, and helpers that build random upstream
models from our presets.

Tests take the oracle from here (``from upstream import UC, UM``), never through ``pytest.importorskip``: with
transformers installed, a missing ``transformers.models.qwen4_exp`` module is an error naming the module and the
pinned transformers range (the oracle's ~190 tests must not quietly turn into skips when upstream moves it); only
when transformers itself is absent do they skip, saying so.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import tomllib

import pytest
import torch

UPSTREAM_PACKAGE = "transformers.models.qwen4_exp"


def pinned_transformers() -> str:
    """The project's transformers requirement (pyproject.toml), e.g. ``transformers>=5.16.1,<5.20``."""
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return next(d for d in deps if d.replace(" ", "").startswith("transformers") and not d.startswith("transformers-"))


def require(module: str):
    """``transformers.models.qwen4_exp.<module>``. Skips (module level) only when transformers is not installed;
    otherwise a failed import fails loudly, naming the module, the installed transformers and the pinned range."""
    pin = pinned_transformers()
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"upstream oracle: transformers is not installed (the project pins {pin})",
                    allow_module_level=True)
    name = f"{UPSTREAM_PACKAGE}.{module}"
    try:
        return importlib.import_module(name)
    except ImportError as e:
        error = e
    from packaging.requirements import Requirement

    where = "inside" if Requirement(pin).specifier.contains(version, prereleases=True) else "OUTSIDE"
    pytest.fail(f"upstream oracle missing: cannot import {name} from transformers {version} ({where} the pinned "
                f"range {pin}): {error}. The parity tests need upstream's qwen4_exp; if transformers moved or renamed "
                f"it, update tests/upstream.py and the pin.", pytrace=False)


UC = require("configuration_qwen4_exp")
UM = require("modeling_qwen4_exp")

# the random upstream models' helpers are recipes/vision_tiny.py's (one definition: it builds the tiny composite
# checkpoint users try images with, and the tests' own)
_RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
if _RECIPES not in sys.path:
    sys.path.insert(0, _RECIPES)
from vision_tiny import OURS_ONLY as _OURS_ONLY  # noqa: E402
from vision_tiny import randomize, upstream_conditional  # noqa: E402,F401


def upstream_text_config(cfg):
    d = cfg.to_dict()
    for k in _OURS_ONLY:
        d.pop(k, None)
    return UC.Qwen4ExpTextConfig(**d)


def upstream_causal_lm(cfg, seed: int = 0, attn: str = "eager"):
    torch.manual_seed(seed)
    ucfg = upstream_text_config(cfg)
    ucfg._attn_implementation = attn
    return randomize(UM.Qwen4ExpForCausalLM(ucfg).float().eval(), seed=seed)
