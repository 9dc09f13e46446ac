"""``AgentScheduler``'s session numbers on vLLM's ``/metrics``.

The scheduler runs in the engine-core process, ``/metrics`` is served by the API server. vLLM 0.32 already carries a
``SchedulerStats`` from the engine core to the API server with every output batch (when stats are on), and loads
stat loggers from the ``vllm.stat_logger_plugins`` entry-point group into the API server's ``StatLoggerManager``,
ahead of its own Prometheus logger. So:

* engine side: ``AgentScheduler.make_stats`` adds ``payload(...)`` to the stats' ``running_lora_adapters`` (a
  ``dict[str, int]`` that the engine core leaves empty: the API server fills it with LoRA names, used by vLLM only for
  the ``vllm:lora_requests_info`` label when LoRA is on) under keys prefixed ``qwen4exp:``;
* API-server side: ``AgentStatLogger`` (this package's ``vllm.stat_logger_plugins`` entry point) pops those keys
  before vLLM's loggers see them and sets its Prometheus series in the default registry that ``/metrics`` exports.

Gauges are sent when they change, counters as the increase since the last payload: a ``SchedulerStats`` goes to one
API server, so with several (``--api-server-count``) the counters add up across them and the gauges' "mostrecent"
multiprocess mode picks the newest value. Series (labels ``model_name`` and ``engine`` as vLLM's):

* ``qwen4exp:num_sessions{state}``: sessions per state of the state machine (active, retained, handoff);
* ``qwen4exp:retained_sessions``, ``qwen4exp:retained_blocks``: sessions holding a pin, and the blocks they hold;
* ``qwen4exp:retention_hits_total``: next turns that took over their session's pinned blocks;
* ``qwen4exp:retention_evictions_total{reason}``: pins released without a hand-off (ttl, pressure, close, abort,
  reset, error);
* ``qwen4exp:illegal_transitions_total``: session events refused by the state machine (the session is then dropped,
  the engine goes on);
* ``qwen4exp:exact_resumes_total``: next turns that resumed at the exact end of their previous turn (prefilling only
  their new tokens);
* ``qwen4exp:preempted_tokens_total``: computed tokens thrown away by preemptions (all requests; recomputed when the
  request is readmitted);
* ``qwen4exp:capped_steps_total``: steps whose prefill chunks were capped for a waiting next turn
  (``QWEN4EXP_CONTINUATION_CHUNK``);
* ``qwen4exp:continued_steps_total``: steps that moved the rest of a next turn's prompt (cut at a block boundary
  when it was admitted) ahead of other running requests;
* ``qwen4exp:paused_steps_total``: steps that ran at the short budget of a tool pause (``QWEN4EXP_PAUSE_CHUNK``).

Without ``--scheduler-cls`` naming ``AgentScheduler`` (or a subclass) the logger registers nothing (a subclass outside
this package: its series appear with its first numbers). vLLM turns its
stats on in the API server whenever a stat-logger plugin is installed (``--disable-log-stats`` then keeps only the
periodic log lines off). The vLLM internals used here are pinned by ``tests/test_scheduler_contract.py``.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from qwen4exp.serving.sessions import EVICTION_REASONS, State

PREFIX = "qwen4exp:"
STATES = tuple(s.value for s in State if s is not State.CLOSED)
# name -> (documentation, extra label name or None, its values)
GAUGES = {
    "num_sessions": ("Agent sessions per state of AgentScheduler's session state machine.", "state", STATES),
    "retained_sessions": ("Agent sessions whose last turn's KV blocks are held for their next turn.", None, ()),
    "retained_blocks": ("KV cache blocks held for the next turn of retained agent sessions.", None, ()),
}
COUNTERS = {
    "retention_hits": ("Next turns of an agent session that took over their session's held blocks.", None, ()),
    "retention_evictions": ("Held session blocks released without a next turn taking them over, by reason.",
                            "reason", EVICTION_REASONS),
    "illegal_transitions": ("Session events refused by AgentScheduler's state machine.", None, ()),
    "exact_resumes": ("Next turns of an agent session that resumed at the exact end of their previous turn.", None,
                      ()),
    "preempted_tokens": ("Computed tokens thrown away by preemptions under AgentScheduler.", None, ()),
    "capped_steps": ("Engine steps whose prefill chunks AgentScheduler capped for a waiting next turn.", None, ()),
    "continued_steps": ("Engine steps that moved the rest of a next turn's prompt, cut at a block boundary, ahead "
                        "of other running requests.", None, ()),
    "paused_steps": ("Engine steps AgentScheduler kept to the short budget of a tool pause (QWEN4EXP_PAUSE_CHUNK).",
                     None, ()),
}


def _key(name: str, label: str | None = None) -> str:
    return PREFIX + name + ("" if label is None else ":" + label)


def payload(sessions, sent: dict[str, int], counters: dict[str, int] | None = None) -> dict[str, int]:
    """What changed since the last payload of ``sessions`` (a ``qwen4exp.serving.sessions.Sessions``): gauges as they
    are now, counters as increases. ``counters``: the scheduler's own totals by ``COUNTERS`` name (exact resumes,
    preempted tokens). ``sent`` holds what was sent before (the scheduler keeps it; updated here)."""
    by_state = sessions.by_state()
    now = {_key("num_sessions", s): n for s, n in by_state.items()}
    now[_key("retained_sessions")] = by_state[State.RETAINED.value] + by_state[State.HANDOFF.value]
    now[_key("retained_blocks")] = sessions.pinned_blocks()
    out = {k: v for k, v in now.items() if sent.get(k, 0) != v}
    totals = {_key("retention_hits"): sessions.counts["handed_off"],
              _key("illegal_transitions"): sessions.counts["illegal_transitions"]}
    totals.update({_key("retention_evictions", r): n for r, n in sessions.evictions.items()})
    totals.update({_key(name): n for name, n in (counters or {}).items()})
    out.update({k: v - sent.get(k, 0) for k, v in totals.items() if v != sent.get(k, 0)})
    sent.update(now)
    sent.update(totals)
    return out


# the mark of a scheduler class whose stats carry ``payload`` (``AgentScheduler.sends_session_stats``): looked up on
# the configured class, so that this module (which the scheduler imports) does not import the scheduler
CARRIES_SESSION_STATS = "qwen4exp.serving.metrics.payload"


def uses_agent_scheduler(vllm_config) -> bool:
    """Whether ``vllm_config``'s scheduler class is ``AgentScheduler`` or a subclass (by its ``sends_session_stats``
    mark; a class path is resolved as vLLM resolves it)."""
    cls = vllm_config.scheduler_config.scheduler_cls
    if cls is None:
        return False
    if isinstance(cls, str):
        if not cls.startswith("qwen4exp."):
            return False  # (not imported into the API server: the series then appear with the first numbers)
        from vllm.utils.import_utils import resolve_obj_by_qualname

        try:
            cls = resolve_obj_by_qualname(cls)
        except Exception:
            return False
    return isinstance(cls, type) and getattr(cls, "sends_session_stats", None) is CARRIES_SESSION_STATS


def _unregister_ours() -> None:
    """Drop series of an earlier logger in this process (an engine built twice, as in tests)."""
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(PREFIX):
            REGISTRY.unregister(collector)


class AgentStatLogger(AggregateStatLoggerBase):
    """The ``vllm.stat_logger_plugins`` entry point: ``AgentScheduler``'s numbers into Prometheus (module docstring)."""

    def __init__(self, vllm_config, engine_indexes: list[int] | None = None):
        self.engine_indexes = engine_indexes or [0]
        self.model_name = vllm_config.model_config.served_model_name
        self.series: dict[str, dict[int, object]] = {}  # payload key -> engine index -> labelled child
        self._gauges: set[str] = set()
        if uses_agent_scheduler(vllm_config):
            self._register()  # (series at 0 from the start; another scheduler class sending numbers: at its first)

    def _register(self) -> None:
        _unregister_ours()
        for kind, table in ((Gauge, GAUGES), (Counter, COUNTERS)):
            for name, (doc, label, values) in table.items():
                labels = ["model_name", "engine"] + ([label] if label else [])
                extra = dict(multiprocess_mode="mostrecent") if kind is Gauge else {}
                metric = kind(PREFIX + name, doc, labelnames=labels, **extra)
                for value in (values if label else (None,)):
                    self.series[_key(name, value)] = {
                        i: metric.labels(self.model_name, str(i), *([value] if label else []))
                        for i in self.engine_indexes}
                    if kind is Gauge:
                        self._gauges.add(_key(name, value))

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if scheduler_stats is None:
            return
        carrier = scheduler_stats.running_lora_adapters
        ours = [k for k in carrier if k.startswith(PREFIX)]
        if not ours:
            return
        values = {k: carrier.pop(k) for k in ours}  # before vLLM's loggers read the dict as LoRA names
        if not self.series:
            self._register()
        for k, v in values.items():
            child = self.series.get(k, {}).get(engine_idx)
            if child is None:
                continue  # (a newer scheduler's key this logger does not know)
            if k in self._gauges:
                child.set(v)
            elif v > 0:
                child.inc(v)

    def log_engine_initialized(self):
        pass
