"""Fill vLLM's model-class inspection cache (``$VLLM_CACHE_ROOT/modelinfos``) for the Qwen4Exp target and MTP
classes, upstream's and ours, all at once.

Why: an engine's API process inspects each model class it serves (target and draft) in a fresh subprocess, ~26 s
each on a fresh machine, one after the other, and saves the result keyed by the module file's hash. On a device
lease every engine start of a new class pays that; run here in parallel right after the kit's install it costs the
time of one, and every later start reads the cache.

    python tools/warm_modelinfo.py            # prints one line per class: cached / inspected / failed (seconds)

Uses vLLM's registry entries (``ModelRegistry.models``: private); with a vLLM whose registry differs it says so and
exits 0 (the engines then inspect as before)."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

ARCHS = ("Qwen4ExpForConditionalGeneration", "Qwen4ExpMTP")


def entries() -> dict:
    """{label: registry entry}: upstream's in-tree classes, then ours (the plugin's register() replaces them)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models import registry

    models = ModelRegistry.models
    # upstream's from vLLM's own table, not the live registry: where the plugin has registered already (earlier in
    # this process), the live entries are ours
    found = {}
    for a in ARCHS:
        if a in registry._VLLM_MODELS:
            mod, cls = registry._VLLM_MODELS[a]
            found[f"upstream {a}"] = registry._LazyRegisteredModel(
                module_name=mod if mod.startswith("vllm.") else f"vllm.model_executor.models.{mod}", class_name=cls)
    import qwen4exp.vllm as plugin

    plugin.register()
    found.update({f"ours {a}": models[a] for a in ARCHS if a in models})
    # only lazily registered ones are inspected in a subprocess (and cached); one class may serve two labels
    seen, out = set(), {}
    for label, e in found.items():
        key = (getattr(e, "module_name", None), getattr(e, "class_name", None))
        if None not in key and key not in seen and hasattr(e, "inspect_model_cls"):
            seen.add(key)
            out[label] = e
    return out


def main() -> int:
    try:
        todo = entries()
    except Exception as e:  # a vLLM without these internals: nothing to warm
        print(f"warm_modelinfo: skipped ({type(e).__name__}: {e})")
        return 0

    def one(item):
        label, e = item
        t0 = time.monotonic()
        try:
            hit = e._load_modelinfo_from_cache(e._get_modelinfo_module_hash(_path(e))) is not None
        except Exception:
            hit = False
        try:
            e.inspect_model_cls()
            what = "cached" if hit else "inspected"
        except Exception as exc:
            last = (str(exc).strip().splitlines() or [""])[-1][:160]
            what = f"failed ({type(exc).__name__}: {last})"
        return f"{label} ({e.module_name}.{e.class_name}): {what} in {time.monotonic() - t0:.1f} s"

    with ThreadPoolExecutor(max(1, len(todo))) as pool:  # each inspection is its own subprocess
        for line in pool.map(one, todo.items()):
            print(line, flush=True)
    return 0


def _path(e):
    import importlib.util
    from pathlib import Path

    return Path(importlib.util.find_spec(e.module_name).origin)


if __name__ == "__main__":
    sys.exit(main())
