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

_OURS_ONLY = ("model_type", "transformers_version", "architectures", "mtp_num_hidden_layers",
              "mtp_use_dedicated_embeddings", "mamba_ssm_dtype")


def upstream_text_config(cfg):
    d = cfg.to_dict()
    for k in _OURS_ONLY:
        d.pop(k, None)
    return UC.Qwen4ExpTextConfig(**d)


def randomize(model, head_scale: float = 8.0, seed: int = 0):
    """Make every mechanism matter: non-zero norm weights and PLE conv (upstream inits them to zero), and a larger
    output head so that argmaxes are not decided by rounding."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n or "hc_norm" in n or n.endswith(("norm_key.weight",
                                                                                              "norm_query.weight",
                                                                                              "norm_conv.weight")):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            elif "ple.conv1d" in n:
                p.normal_(0, 0.3, generator=g)
        head = model.lm_head.weight
        head.mul_(head_scale)
    return model


def upstream_causal_lm(cfg, seed: int = 0, attn: str = "eager"):
    torch.manual_seed(seed)
    ucfg = upstream_text_config(cfg)
    ucfg._attn_implementation = attn
    return randomize(UM.Qwen4ExpForCausalLM(ucfg).float().eval(), seed=seed)


def upstream_conditional(cfg, seed: int = 0):
    torch.manual_seed(seed)
    d = cfg.to_dict()
    for k in ("transformers_version", "architectures", "model_type"):
        d.pop(k, None)
    td = d.pop("text_config").to_dict() if hasattr(d.get("text_config"), "to_dict") else d.pop("text_config")
    vd = d.pop("vision_config").to_dict() if hasattr(d.get("vision_config"), "to_dict") else d.pop("vision_config")
    for k in _OURS_ONLY:
        td.pop(k, None)
    for k in ("model_type", "transformers_version", "architectures"):
        vd.pop(k, None)
    ucfg = UC.Qwen4ExpConfig(text_config=td, vision_config=vd, **{k: v for k, v in d.items()
                                                                     if k.endswith("token_id")})
    ucfg._attn_implementation = "eager"
    ucfg.text_config._attn_implementation = "eager"
    return randomize(UM.Qwen4ExpForConditionalGeneration(ucfg).float().eval(), seed=seed)
