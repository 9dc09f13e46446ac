"""``qwen4exp.serving.metrics`` without a server: the scheduler's payload (gauges when they change, counters as
increases), its trip through vLLM's engine-core -> API-server serialisation, the ``AgentStatLogger`` plugin (pops its
keys before vLLM's loggers read the carrier as LoRA names, sets the Prometheus series, registers nothing without
``AgentScheduler``), the installed entry point, and ``AgentScheduler`` dropping a session on a refused event instead
of failing the engine step. The server-side check: ``tests/test_vllm_server_prefix_cache.py``."""

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from qwen4exp.serving import metrics
from qwen4exp.serving.sessions import EVICTION_REASONS, Event, IllegalTransition, Sessions, State

pytestmark = [pytest.mark.vllm]

AGENT = "qwen4exp.serving.scheduler.AgentScheduler"


def config(scheduler_cls=AGENT, model="coder"):
    return SimpleNamespace(scheduler_config=SimpleNamespace(scheduler_cls=scheduler_cls),
                           model_config=SimpleNamespace(served_model_name=model))


def value(name, engine="0", model="coder", **labels):
    return REGISTRY.get_sample_value(name, dict(model_name=model, engine=engine, **labels))


def ours_registered() -> list[str]:
    return [c._name for c in REGISTRY._collector_to_names if getattr(c, "_name", "").startswith("qwen4exp:")]


@pytest.fixture
def sessions():
    released = []
    return Sessions(lambda blocks, fence: released.extend(blocks), ttl=10.0), released


def retain(s, sid, rid, n):
    s.fire(sid, Event.ARRIVE, rid)
    s.fire(sid, Event.FINISH, rid, s.new_pin(list(range(n)), 0, rid))


def test_payload_sends_changes_and_counter_increases(sessions):
    s, _ = sessions
    sent = {}
    assert metrics.payload(s, sent) == {}  # all zero: what the API server starts from
    retain(s, "a", "r1", 3)
    assert metrics.payload(s, sent) == {"qwen4exp:num_sessions:retained": 1, "qwen4exp:retained_sessions": 1,
                                        "qwen4exp:retained_blocks": 3}
    assert metrics.payload(s, sent) == {}  # nothing changed
    s.fire("a", Event.ARRIVE, "r2")
    s.fire("a", Event.ALLOCATED)  # the next turn took the pin over
    retain(s, "b", "r3", 2)
    s.release_one(Event.PRESSURE)  # b's pin (a holds none now)
    with pytest.raises(IllegalTransition):
        s.fire("a", Event.EXPIRE)  # ACTIVE: refused
    assert metrics.payload(s, sent) == {
        "qwen4exp:num_sessions:retained": 0, "qwen4exp:num_sessions:active": 1, "qwen4exp:retained_sessions": 0,
        "qwen4exp:retained_blocks": 0, "qwen4exp:retention_hits": 1, "qwen4exp:retention_evictions:pressure": 1,
        "qwen4exp:illegal_transitions": 1}
    s.fire("a", Event.FINISH, "r2", s.new_pin([7], 0, "r2"))
    s.fire("a", Event.CLOSE)
    assert metrics.payload(s, sent) == {"qwen4exp:num_sessions:active": 0, "qwen4exp:retention_evictions:close": 1}
    # the scheduler's own totals (exact resumes, preempted tokens): increases too
    assert metrics.payload(s, sent, {"exact_resumes": 2, "preempted_tokens": 300}) == {
        "qwen4exp:exact_resumes": 2, "qwen4exp:preempted_tokens": 300}
    assert metrics.payload(s, sent, {"exact_resumes": 2, "preempted_tokens": 420}) == {
        "qwen4exp:preempted_tokens": 120}


def test_payload_survives_the_trip_to_the_api_server(sessions):
    """The carrier is serialised with the engine core's outputs (msgpack, decoded against vLLM's types)."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    s, _ = sessions
    retain(s, "a", "r1", 5)
    stats = SchedulerStats(num_running_reqs=1)
    stats.running_lora_adapters.update(metrics.payload(s, {}))
    frames = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    back = MsgpackDecoder(EngineCoreOutputs).decode(frames).scheduler_stats
    assert back.running_lora_adapters == stats.running_lora_adapters and back.num_running_reqs == 1
    assert back.running_lora_adapters["qwen4exp:retained_blocks"] == 5


def test_logger_pops_its_keys_and_sets_the_series(sessions):
    from vllm.v1.metrics.stats import SchedulerStats

    s, _ = sessions
    log = metrics.AgentStatLogger(config(), engine_indexes=[0, 1])
    for state in metrics.STATES:  # there from the start, per engine
        assert value("qwen4exp:num_sessions", "0", state=state) == value("qwen4exp:num_sessions", "1", state=state) == 0
    for reason in EVICTION_REASONS:
        assert value("qwen4exp:retention_evictions_total", reason=reason) == 0
    sent = {}
    retain(s, "a", "r1", 4)
    retain(s, "b", "r2", 2)
    s.fire("b", Event.ARRIVE, "r3")
    stats = SchedulerStats(running_lora_adapters={"my-lora": 2, **metrics.payload(s, sent)})
    log.record(stats, None, engine_idx=1)
    assert stats.running_lora_adapters == {"my-lora": 2}  # what vLLM's loggers then see
    assert value("qwen4exp:retained_sessions", "1") == 2 and value("qwen4exp:retained_blocks", "1") == 6
    assert value("qwen4exp:num_sessions", "1", state="handoff") == 1
    assert value("qwen4exp:num_sessions", "1", state="retained") == 1
    assert value("qwen4exp:retained_sessions", "0") == 0  # the other engine's series untouched
    s.fire("b", Event.ALLOCATED)
    s.expire()
    s.clock = lambda: 1e12
    s.expire()  # a's pin: past its TTL
    log.record(SchedulerStats(running_lora_adapters=metrics.payload(s, sent)), None, engine_idx=1)
    s.fire("b", Event.FINISH, "r3", s.new_pin([1], 0, "r3"))
    s.fire("b", Event.ARRIVE, "r4")
    s.fire("b", Event.ALLOCATED)
    log.record(SchedulerStats(running_lora_adapters=metrics.payload(s, sent)), None, engine_idx=1)
    assert value("qwen4exp:retention_hits_total", "1") == 2  # counters add the increases
    assert value("qwen4exp:retention_evictions_total", "1", reason="ttl") == 1
    assert value("qwen4exp:retained_sessions", "1") == 0 and value("qwen4exp:num_sessions", "1", state="active") == 1
    log.record(None, None)
    log.record(SchedulerStats(running_lora_adapters={"qwen4exp:from_a_newer_scheduler": 1}), None)  # ignored
    metrics.AgentStatLogger(config(), engine_indexes=[0])  # built again in one process: series start over
    assert value("qwen4exp:retention_hits_total", "1") is None and value("qwen4exp:retention_hits_total") == 0


@pytest.mark.parametrize("cls", [None, "vllm.v1.core.sched.scheduler.Scheduler", "no.such.Scheduler"])
def test_without_agent_scheduler_nothing_is_registered(cls):
    from vllm.v1.metrics.stats import SchedulerStats

    metrics._unregister_ours()  # (series left by other tests in this process)
    log = metrics.AgentStatLogger(config(cls))
    stats = SchedulerStats(running_lora_adapters={"my-lora": 1})
    log.record(stats, None)
    assert not ours_registered() and stats.running_lora_adapters == {"my-lora": 1}


def test_agent_scheduler_classes_are_recognised():
    from qwen4exp.serving.scheduler import AgentScheduler, AsyncAgentScheduler

    for cls in (AGENT, "qwen4exp.serving.scheduler.AsyncAgentScheduler", AgentScheduler, AsyncAgentScheduler,
                "qwen4exp.vllm.scheduler.AgentScheduler"):  # (the old path of launch lines, forwarded)
        assert metrics.uses_agent_scheduler(config(cls)), cls
    assert not metrics.uses_agent_scheduler(config("qwen4exp.serving.scheduler.NoSuchClass"))


def test_the_entry_point_is_installed():
    """vLLM's own loader finds the plugin (``make venv`` installs this package's entry points)."""
    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

    assert metrics.AgentStatLogger in load_stat_logger_plugin_factories(), \
        "the package's vllm.stat_logger_plugins entry point is not installed: `make venv` (pyproject.toml changed)"


def test_a_refused_event_drops_the_session_not_the_engine(sessions):
    from qwen4exp.serving.scheduler import AgentScheduler

    s, released = sessions
    sched = object.__new__(AgentScheduler)
    sched.sessions = s
    retain(s, "a", "r1", 3)
    assert sched._fire("a", Event.FINISH, "r1") is None  # RETAINED: a finish is refused
    assert s.state("a") is State.CLOSED and released == [0, 1, 2]
    assert s.counts["illegal_transitions"] == 1 and s.evictions["error"] == 1
    assert s.pinned_blocks() == 0 and s.by_state() == {"active": 0, "retained": 0, "handoff": 0}
    assert sched._fire("a", Event.ARRIVE, "r2") is State.ACTIVE  # the session starts over
