"""The private vLLM scheduler interface ``qwen4exp.serving.scheduler.AgentScheduler`` relies on, pinned against the
installed vLLM (imported; the part every supported minor must keep is read from each minor's source by
tests/test_vllm_patch_contract.py): vLLM says
``--scheduler-cls`` classes use a non-public interface that changes between minor versions (0.33 renames
``has_requests``; plugins written for 0.25 broke on a removed ``skipped_waiting``). When vLLM is upgraded this file
fails first, naming what moved; the scheduler itself refuses other minor versions at start-up."""

import inspect

import pytest
import vllm
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue, PriorityRequestQueue, RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import MambaManager, SingleTypeKVCacheManager
from vllm.v1.request import Request, RequestStatus

from qwen4exp.serving import scheduler as agent


def params(fn):
    return list(inspect.signature(fn).parameters)


def test_vllm_is_a_supported_minor_version():
    from qwen4exp.vllm.patches import vllm_minor

    assert vllm_minor(vllm.__version__) in agent.SUPPORTED_VLLM, vllm.__version__


def test_other_minor_versions_are_refused(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32, 0\.33, 0\.34 .* this is vLLM 0\.35\.0"):
        agent.AgentScheduler.__init__(object.__new__(agent.AgentScheduler))


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_newer_checked_minors_pass_the_gate(monkeypatch, version):
    """0.33 and 0.34 pass the version gate (their source contract: tests/test_vllm_patch_contract.py); here the
    constructor then goes on to vLLM's, which wants its arguments."""
    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(TypeError):
        agent.AgentScheduler.__init__(object.__new__(agent.AgentScheduler))


def test_scheduler_methods_we_override_or_call():
    assert params(Scheduler._free_blocks) == ["self", "request"]
    assert params(Scheduler.add_request) == ["self", "request"]
    assert params(Scheduler.schedule)[:1] == ["self"]
    assert params(Scheduler.reset_prefix_cache)[:1] == ["self"] and params(Scheduler.shutdown) == ["self"]
    # _free_request -> _free_blocks is the one place a finished request's blocks go back (what a pin intercepts)
    assert "self._free_blocks(request)" in inspect.getsource(Scheduler._free_request)
    assert "del self.requests[request.request_id]" in inspect.getsource(Scheduler._free_blocks)
    # deferred frees: what _release_blocks mirrors
    src = inspect.getsource(Scheduler._request_blocks_can_be_freed)
    assert "self.defer_block_free" in src and "request.last_sched_seq <= self.processed_step_seq" in src
    init = inspect.getsource(Scheduler.__init__)
    for attr in ("self.defer_block_free", "self.processed_step_seq", "self.deferred_frees", "self.waiting",
                 "self.requests", "self.kv_cache_manager"):
        assert attr in init, attr
    assert "self.kv_cache_manager.allocate_slots(" in inspect.getsource(Scheduler.schedule)
    assert issubclass(AsyncScheduler, Scheduler)
    assert "self.kv_cache_manager.cache_blocks(" in inspect.getsource(AsyncScheduler._update_request_with_output)


def test_kv_cache_manager_and_coordinator():
    assert params(KVCacheManager.pop_blocks_for_free) == ["self", "request"]
    assert params(KVCacheManager.allocate_slots)[:3] == ["self", "request", "num_new_tokens"]
    assert "return None" in inspect.getsource(KVCacheManager.allocate_slots)  # "does not fit": retried after a release
    assert "self.coordinator.cache_blocks(" in inspect.getsource(KVCacheManager.allocate_slots)
    assert "self.coordinator.cache_blocks(" in inspect.getsource(KVCacheManager.cache_blocks)
    assert params(KVCacheCoordinator.cache_blocks) == ["self", "request", "num_computed_tokens"]
    assert "single_type_managers" in inspect.getsource(KVCacheCoordinator.cache_blocks)


def test_sparse_state_retention_reads_the_junction():
    """The end-of-turn checkpoint sets ``request.shared_prefix_boundary``; vLLM keeps the state block ending at
    its block boundary through ``reachable_block_mask(reachable_boundaries=...)``."""
    assert "request.shared_prefix_boundary" in inspect.getsource(SingleTypeKVCacheManager.cache_blocks)
    assert "reachable_boundaries" in params(MambaManager.reachable_block_mask)
    assert issubclass(MambaManager, SingleTypeKVCacheManager)
    for attr in ("req_to_blocks", "block_size", "enable_caching", "block_pool"):
        assert f"self.{attr}" in inspect.getsource(SingleTypeKVCacheManager.__init__), attr


def test_block_pool_and_blocks():
    assert params(BlockPool.free_blocks)[:2] == ["self", "ordered_blocks"]
    assert params(BlockPool.touch)[:2] == ["self", "blocks"]
    assert params(BlockPool._maybe_evict_cached_block) == ["self", "block"]
    b = KVCacheBlock(block_id=0)
    assert hasattr(b, "is_null") and b.block_hash is None


def test_request_fields():
    init = inspect.getsource(Request.__init__)
    for attr in ("self.session_id", "self.shared_prefix_boundary", "self.resumable", "self.arrival_time",
                 "self.num_prompt_tokens", "self.sampling_params"):
        assert attr in init, attr
    assert "last_sched_seq" in inspect.getsource(Scheduler)
    assert {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED", "WAITING", "RUNNING"} <= set(
        RequestStatus.__members__)


def test_the_step_prefill_cap_is_read_from_the_config_in_each_schedule():
    """AgentScheduler caps prefill chunks for one step by setting ``scheduler_config.long_prefill_token_threshold``
    around ``schedule``: vLLM must read it there (per step, for running and waiting requests alike) and in the
    hybrid block-aligned split, not once at construction."""
    src = inspect.getsource(Scheduler.schedule)
    assert "self.scheduler_config.long_prefill_token_threshold" in src
    assert src.count("0 < long_prefill_token_threshold < num_new_tokens") == 2  # running, then waiting requests
    assert src.index("First, schedule the RUNNING requests") < src.index("Next, schedule the WAITING requests")
    assert "self.scheduler_config.long_prefill_token_threshold" in inspect.getsource(
        Scheduler._mamba_block_aligned_split)
    assert "self.scheduler_config" in inspect.getsource(Scheduler.__init__)


@pytest.mark.parametrize("queue", [FCFSRequestQueue, PriorityRequestQueue])
def test_waiting_queue_api(queue):
    for name in ("peek_request", "remove_requests", "prepend_requests", "__iter__", "__len__"):
        assert callable(getattr(queue, name)), name


def test_the_step_token_budget_is_read_in_each_schedule():
    """Short steps during tool pauses set ``max_num_scheduled_tokens`` around ``schedule``: vLLM must take its step
    budget from it there and in the hybrid block-aligned split, and check the step against it."""
    src = inspect.getsource(Scheduler.schedule)
    assert "token_budget = self.max_num_scheduled_tokens" in src
    assert "total_num_scheduled_tokens <= self.max_num_scheduled_tokens" in src
    assert "self.max_num_scheduled_tokens" in inspect.getsource(Scheduler._mamba_block_aligned_split)
    assert "self.waiting = create_request_queue(self.policy)" in inspect.getsource(Scheduler.__init__)


def test_the_priority_queue_we_subclass():
    """``SessionPriorityQueue`` keeps its own heap of keyed entries: the methods it inherits from vLLM's
    ``PriorityRequestQueue`` must go through ``_heap`` and ``add_request`` only."""
    from qwen4exp.serving.scheduler import SessionPriorityQueue

    for name in ("prepend_request", "prepend_requests"):
        assert "self.add_request(" in inspect.getsource(getattr(PriorityRequestQueue, name)), name
    for name in ("__bool__", "__len__"):
        assert "self._heap" in inspect.getsource(getattr(PriorityRequestQueue, name)), name
    overridden = {n for n, v in vars(SessionPriorityQueue).items() if callable(v)}
    abstract = {n for n, v in vars(RequestQueue).items() if getattr(v, "__isabstractmethod__", False)}
    assert abstract - overridden == {"prepend_request", "prepend_requests", "__bool__", "__len__"}


# --- the route of AgentScheduler's numbers to /metrics (qwen4exp.serving.metrics) ------------------------------------
def test_stat_logger_plugins_are_loaded_into_the_api_servers_logger_manager():
    from vllm.plugins import STAT_LOGGER_PLUGINS_GROUP
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics import loggers

    assert STAT_LOGGER_PLUGINS_GROUP == "vllm.stat_logger_plugins"
    src = inspect.getsource(loggers.load_stat_logger_plugin_factories)
    assert "STAT_LOGGER_PLUGINS_GROUP" in src and "issubclass" in src and "StatLoggerBase" in src
    init = inspect.getsource(AsyncLLM.__init__)
    assert "load_stat_logger_plugin_factories()" in init and "log_stats or has_custom_loggers" in init
    assert "custom_stat_loggers=custom_stat_loggers" in init
    assert params(loggers.AggregateStatLoggerBase.__init__) == ["self", "vllm_config", "engine_indexes"]
    assert params(loggers.StatLoggerBase.record) == ["self", "scheduler_stats", "iteration_stats",
                                                     "mm_cache_stats", "engine_idx"]
    assert {"log_engine_initialized"} <= set(loggers.StatLoggerBase.__abstractmethods__)


def test_plugin_loggers_record_before_vllms_prometheus_logger():
    """AgentStatLogger pops its keys from the carrier before vLLM's loggers read it: the plugins come first."""
    from vllm.v1.metrics import loggers

    src = inspect.getsource(loggers.StatLoggerManager.__init__)
    assert src.index("stat_logger_factories.extend(custom_stat_loggers)") < src.index(
        "stat_logger_factories.append(default_logger_factory)") < src.index("PrometheusStatLogger(vllm_config")
    assert "for stat_logger in self.stat_loggers:" in inspect.getsource(loggers.StatLoggerManager.record)
    # vLLM's Prometheus logger, built after ours, unregisters only its own ("vllm:") series
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    assert 'startswith("vllm:")' in inspect.getsource(unregister_vllm_metrics)
    assert "unregister_vllm_metrics()" in inspect.getsource(loggers.PrometheusStatLogger.__init__)


def test_the_carrier_field():
    """SchedulerStats.running_lora_adapters: made empty by the engine core, filled in the API server with LoRA names
    only (keys added, none removed), after the engine's stats arrive and before the loggers record them."""
    import dataclasses

    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.stats import LoRARequestStates, SchedulerStats

    field = {f.name: f for f in dataclasses.fields(SchedulerStats)}["running_lora_adapters"]
    assert field.type in (dict[str, int], "dict[str, int]") and field.default_factory is dict
    assert "running_lora_adapters" not in inspect.getsource(Scheduler.make_stats)
    src = inspect.getsource(LoRARequestStates.update_scheduler_stats)
    assert "scheduler_stats.running_lora_adapters[lora_name] =" in src and ".pop(" not in src
    handler = inspect.getsource(AsyncLLM._run_output_handler)
    assert handler.index("update_scheduler_stats(outputs.scheduler_stats)") < handler.index(".record(")
    assert "scheduler_stats=outputs.scheduler_stats" in handler


def test_make_stats_is_sent_after_the_steps_frees():
    """AgentScheduler.make_stats adds its numbers to vLLM's; update_from_output builds the stats after it freed the
    finished requests (so a turn's pin shows in the stats sent with its last token)."""
    assert params(Scheduler.make_stats)[:1] == ["self"]
    assert "return None" in inspect.getsource(Scheduler.make_stats)  # (stats off: nothing carried)
    src = inspect.getsource(Scheduler.update_from_output)
    assert src.index("self._free_request(request)") < src.rindex("self.make_stats(")
    assert "make_stats" not in AsyncScheduler.__dict__


# --- the close endpoint's channel to the scheduler (qwen4exp.serving.session_api) ------------------------------------
def test_utility_calls_reach_an_engine_core_method_between_steps():
    """POST /v1/sessions/{id}/close: the API server's engine client sends a utility call; the engine core's input
    loop (run between steps) looks the method up on itself by name, which AgentScheduler installs on EngineCore."""
    from vllm.v1.engine.core import EngineCore, EngineCoreProc
    from vllm.v1.engine.core_client import AsyncMPClient

    src = inspect.getsource(EngineCoreProc._handle_client_request)
    assert "EngineCoreRequestType.UTILITY" in src and "getattr(self, method_name)" in src
    assert "self._handle_client_request(" in inspect.getsource(EngineCoreProc._process_input_queue)
    loop = inspect.getsource(  # (under a fault-tolerance wrapper)
        inspect.getclosurevars(EngineCoreProc.run_busy_loop).nonlocals["busy_loop_func"])
    assert loop.index("self._process_input_queue()") < loop.index("self._process_engine_step()")
    assert issubclass(EngineCoreProc, EngineCore) and "self.scheduler" in inspect.getsource(EngineCore.__init__)
    assert params(AsyncMPClient.call_utility_all_async) == ["self", "method", "args"]
    assert "self.client_index" in inspect.getsource(AsyncMPClient._call_utility_async)


def test_a_stats_only_output_reaches_the_stat_loggers():
    """After a release the close sends the scheduler's stats to the calling API server at once: an EngineCoreOutputs
    with only scheduler_stats, put on the engine core's output queue for that client, recorded by AsyncLLM's output
    handler like a step's."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCoreProc

    assert "self.output_queue" in inspect.getsource(EngineCoreProc.__init__)
    sockets = inspect.getsource(EngineCoreProc.process_output_sockets)
    assert "client_index, outputs = output" in sockets and "sockets[client_index]" in sockets
    out = EngineCoreOutputs()
    assert out.outputs == [] and out.utility_output is None and hasattr(out, "scheduler_stats")
    handler = inspect.getsource(AsyncLLM._run_output_handler)
    assert "num_outputs = len(outputs.outputs)" in handler and "scheduler_stats=outputs.scheduler_stats" in handler


def test_the_exact_resume_point_rides_on_the_partial_hit_path():
    """``AgentScheduler._get_local_prefix_cache_hit`` hands vLLM a finished turn's blocks up to its exact end; vLLM
    copies the partly filled blocks on write (attention and "align" hybrid state), and the worker runs the copies
    with ``copy_kv_cache_blocks_inplace``, which ``qwen4exp.vllm.block_copy`` replaces where the runners call it."""
    import vllm.v1.worker.gpu_model_runner as runner

    assert params(Scheduler._get_local_prefix_cache_hit) == ["self", "request"]
    assert "self._get_local_prefix_cache_hit(request)" in inspect.getsource(Scheduler.schedule)
    assert "return blocks, num_local, shared_prefix_boundary, False" in inspect.getsource(
        Scheduler._get_local_prefix_cache_hit)
    assert callable(KVCacheManager.create_kv_cache_blocks) and callable(KVCacheManager.prefix_cache_lookup_enabled)
    assert "_partial_hit_reqs" in inspect.getsource(SingleTypeKVCacheManager.add_local_computed_blocks)
    assert "partial_hit" in inspect.getsource(MambaManager.allocate_new_blocks)
    for attr in ("self.mamba_cache_mode", "self.num_speculative_blocks"):
        assert attr in inspect.getsource(MambaManager.__init__), attr
    assert "copy_kv_cache_blocks_inplace(" in inspect.getsource(runner.GPUModelRunner._update_states)
    assert hasattr(runner, "copy_kv_cache_blocks_inplace")
    for attr in ("block_hashes", "cache_salt", "mm_features", "lora_request", "all_token_ids"):
        assert hasattr(Request, attr) or f"self.{attr}" in inspect.getsource(Request.__init__), attr


# --- the adapter's list of touchpoints (qwen4exp.serving.scheduler.TOUCHPOINTS) ----------------------------------
def _defines(cls, name: str) -> bool:
    """A method or class attribute, a dataclass / msgspec field, or an attribute an ``__init__`` in the MRO sets."""
    if hasattr(cls, name) or name in getattr(cls, "__dataclass_fields__", {}) or name in getattr(
            cls, "__struct_fields__", ()):
        return True
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and hasattr(init, "__code__") and f"self.{name}" in inspect.getsource(init):
            return True
    return False


@pytest.mark.parametrize("owner", sorted(agent.TOUCHPOINTS), ids=lambda o: o[1])
def test_every_touchpoint_the_adapter_lists_exists(owner):
    """Every private attribute ``AgentScheduler`` lists in ``TOUCHPOINTS`` exists in the installed vLLM (the lines
    its hooks rely on: the tests above)."""
    import importlib

    module, name = owner
    cls = getattr(importlib.import_module(module), name)
    missing = [a for a in agent.TOUCHPOINTS[owner] if not _defines(cls, a)]
    assert not missing, f"{module}.{name} lacks {missing}"
    # (last_sched_seq is set on requests by the scheduler, not by Request: test_request_fields)
