"""Agent-aware scheduling for vLLM 0.32-0.34: ``--scheduler-cls qwen4exp.serving.scheduler.AgentScheduler``.

Without ``--scheduler-cls`` vLLM schedules as it always does; with it, requests that carry a ``session_id`` (the body
field, the ``X-Session-ID`` header or ``vllm_xargs.session_id``) get:

* **the end-of-turn hybrid checkpoint**: in vLLM's "align" prefix-cache mode the GDN/PLE state of a prompt is kept
  only at the prompt's last block boundary, so turn N+1 re-prefills turn N's output. Here a session request's decode
  also keeps its state at the last block boundary it crossed (one checkpoint a request: each newer one evicts the
  one before), so turn N+1 resumes from within one block of where turn N stopped. (Under MTP out of reach: vLLM
  drops the last matched block of the draft's EAGLE-type KV group from every hit.)
* **the exact resume point**: where every KV-cache group allows it (full attention, and hybrid-state groups in "align"
  mode without speculative blocks: not under MTP), the pin also records the blocks holding turn N's K/V and state
  after exactly the tokens it computed (``Resume``), and turn N+1, when its prompt starts with those tokens, takes
  them as its cached prefix: vLLM's partial-hit path copies the partly filled blocks on write
  (``qwen4exp.vllm.block_copy`` makes that copy whole), so only the new tokens are prefilled.
* **soft retention** (``QWEN4EXP_SESSION_TTL`` seconds, default 10): the blocks of a session's finished turn stay
  referenced, so a tool pause does not let other traffic evict them; they are the first to go under memory pressure
  (before any running request is preempted, after plain cached blocks), and go at once on ``session_close`` (body
  ``"vllm_xargs": {"session_close": true}`` or, through ``qwen4exp-serve``, the ``X-Session-Close: 1`` header on the
  last turn), on an explicit close of an idle session (``close_session``: ``POST /v1/sessions/{id}/close`` on
  ``qwen4exp-serve``, reaching the engine core as the utility call ``CLOSE_UTILITY``), on an abort, or on a
  prefix-cache reset. The state machine and its counters: ``qwen4exp.serving.sessions``; on ``/metrics`` (when stats
  are on): ``qwen4exp.serving.metrics``. An event the state machine refuses is logged and counted, the session
  dropped, and the engine goes on.
* **continuation first**: a waiting turn whose session's blocks are pinned goes ahead of first turns, at most
  ``CONTINUATIONS_PER_STEP`` a step and never past a head of the queue that has waited ``HEAD_WAIT_S``; in such a
  step no prefill chunk is longer than ``QWEN4EXP_CONTINUATION_CHUNK`` tokens (vLLM's
  ``long_prefill_token_threshold`` for that step), so a first turn in the middle of a long prefill, which vLLM
  schedules before any waiting request, leaves the next turn room in the same step; a next turn admitted with part
  of its prefill left (vLLM ends a chunk that starts mid-block at the block boundary) runs that part first in the
  steps after, ahead of running first-turn prefills. Under ``--scheduling-policy priority`` (``X-Vllm-Priority``)
  the priority classes come first: next turns go ahead of the first turns of their own class
  (``SessionPriorityQueue``), with the same ``HEAD_WAIT_S`` guard within the best waiting class.
* **short steps during tool pauses**: while a session's finished turn is held for its next turn, no step schedules
  more than ``QWEN4EXP_PAUSE_CHUNK`` prefill tokens (plus its decode tokens), so a next turn that arrives while a
  step runs (with async scheduling, while the step after it is already planned) waits for short steps, not for whole
  ``--max-num-batched-tokens`` prefill chunks of first turns.

The policies themselves are plain classes without vLLM (``qwen4exp.serving.policies``: ``CheckpointTracker`` and
the resume functions, ``Retention``, ``Admission``, ``VictimOrder``; the session state machine:
``qwen4exp.serving.sessions``), tested without an engine (``tests/test_scheduler_policies.py``,
``tests/test_sessions.py``). This module is the adapter: it reads vLLM's requests, queues and KV-cache managers, asks
the policies, and applies their decisions through vLLM's private interface, so a vLLM upgrade touches this module
only. What it touches (``TOUCHPOINTS``, each checked against the installed vLLM by
``tests/test_scheduler_contract.py``, which also pins the source lines the hooks rely on):

* ``Scheduler`` methods overridden: ``schedule`` (per step: ``scheduler_config.long_prefill_token_threshold`` and
  ``max_num_scheduled_tokens`` set and restored), ``add_request``, ``_free_blocks`` (the pin),
  ``_preempt_request`` (counted), ``_get_local_prefix_cache_hit`` (the exact resume point), ``make_stats``
  (``SchedulerStats.running_lora_adapters`` carries the session numbers), ``reset_prefix_cache``, ``shutdown``;
  called: ``_request_blocks_can_be_freed``; read: ``policy``, ``waiting`` (replaced by ``SessionPriorityQueue``
  under the priority policy; FCFS: ``peek_request``, ``remove_requests``, ``prepend_requests``), ``running``,
  ``requests``, ``cache_config.block_size``, ``scheduler_config.enable_chunked_prefill``, ``num_spec_tokens``,
  ``connector``, ``hash_block_size``, ``defer_block_free``, ``processed_step_seq``, ``deferred_frees``;
* the KV-cache manager: ``allocate_slots`` and the coordinator's ``cache_blocks`` (wrapped on this scheduler's
  instances), ``pop_blocks_for_free``, ``create_kv_cache_blocks``, ``prefix_cache_lookup_enabled``, the
  coordinator's ``single_type_managers`` (``FullAttentionManager``, ``MambaManager``: ``req_to_blocks``,
  ``block_size``, ``enable_caching``, ``mamba_cache_mode``, ``num_speculative_blocks``), the block pool's
  ``free_blocks``, ``touch``, ``_maybe_evict_cached_block``, ``null_block``, and ``KVCacheBlock.is_null`` /
  ``block_hash``;
* ``Request`` fields: ``session_id``, ``shared_prefix_boundary`` (written: the decode checkpoint), ``resumable``,
  ``status``, ``num_computed_tokens``, ``num_prompt_tokens``, ``num_tokens``, ``num_preemptions``, ``arrival_time``,
  ``priority``, ``last_sched_seq``, ``block_hashes``, ``all_token_ids``, ``prompt_token_ids``, ``cache_salt``,
  ``lora_request``, ``mm_features``, ``sampling_params.extra_args``;
* ``EngineCore``: the utility method ``qwen4exp_close_session`` (installed), its ``scheduler`` and
  ``output_queue``, ``EngineCoreOutputs(scheduler_stats=...)``.

The class is vLLM's ``Scheduler`` on CPU and ``AsyncScheduler`` where async scheduling is on (GPUs): subclassing
``Scheduler`` there would turn the async overlap off. Besides ``tests/test_scheduler_contract.py`` (the installed
vLLM, imported), ``tests/test_vllm_patch_contract.py`` checks each supported minor's source (0.32, 0.33, 0.34);
another vLLM minor version is refused at start-up.
"""

from __future__ import annotations

import heapq
import time

import vllm
from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import PriorityRequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager
from vllm.v1.request import RequestStatus

from qwen4exp import envs
from qwen4exp.serving import metrics
from qwen4exp.serving.policies import (ATTENTION, OTHER, STATE_ALIGN, Admission, Admitted, Candidate, Checkpoint,
                                       CheckpointTracker, Freed, GroupBlocks, Queued, Resume, Retention, VictimOrder,
                                       exact_resume_supported, newest_cached, resume_groups, resume_in_reach,
                                       resume_matches)
from qwen4exp.serving.policies import CONTINUATIONS_PER_STEP, HEAD_WAIT_S  # noqa: F401 (re-exported)
from qwen4exp.serving.sessions import Event, IllegalTransition, Sessions, State, close_flag
from qwen4exp.vllm import patches

logger = init_logger("vllm.plugins.qwen4exp.scheduler")

SUPPORTED_VLLM = patches.SUPPORTED_VLLM_MINORS  # the minors whose scheduler contract is checked (patches)
_ADMISSION = Admission()  # (CONTINUATIONS_PER_STEP, HEAD_WAIT_S)

# The private vLLM interface this adapter touches (module docstring), as (module, class) -> attributes: each one is
# checked against the installed vLLM by tests/test_scheduler_contract.py (a method, a class attribute, a dataclass
# field, or an attribute its ``__init__`` sets).
TOUCHPOINTS = {
    ("vllm.v1.core.sched.scheduler", "Scheduler"): (
        "schedule", "add_request", "_free_blocks", "_preempt_request", "_get_local_prefix_cache_hit", "make_stats",
        "reset_prefix_cache", "shutdown", "_request_blocks_can_be_freed", "policy", "waiting", "running", "requests",
        "kv_cache_manager", "cache_config", "scheduler_config", "max_num_scheduled_tokens", "num_spec_tokens",
        "connector", "hash_block_size", "defer_block_free", "processed_step_seq", "deferred_frees"),
    ("vllm.v1.core.sched.request_queue", "FCFSRequestQueue"): ("peek_request", "remove_requests", "prepend_requests"),
    ("vllm.v1.core.sched.request_queue", "PriorityRequestQueue"): ("add_request", "pop_request", "peek_request",
                                                                   "remove_request", "remove_requests", "__iter__"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager"): (
        "allocate_slots", "coordinator", "pop_blocks_for_free", "create_kv_cache_blocks", "prefix_cache_lookup_enabled",
        "block_pool"),
    ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator"): ("cache_blocks", "single_type_managers"),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager"): (
        "req_to_blocks", "block_size", "enable_caching", "block_pool"),
    ("vllm.v1.core.single_type_kv_cache_manager", "MambaManager"): ("mamba_cache_mode", "num_speculative_blocks"),
    ("vllm.v1.core.block_pool", "BlockPool"): ("free_blocks", "touch", "_maybe_evict_cached_block", "null_block"),
    ("vllm.v1.core.kv_cache_utils", "KVCacheBlock"): ("is_null", "block_hash"),
    ("vllm.v1.request", "Request"): (
        "session_id", "shared_prefix_boundary", "resumable", "status", "num_computed_tokens", "num_prompt_tokens",
        "num_tokens", "num_preemptions", "arrival_time", "priority", "block_hashes", "all_token_ids",
        "prompt_token_ids", "cache_salt", "lora_request", "mm_features", "sampling_params"),
    ("vllm.config.scheduler", "SchedulerConfig"): (
        "long_prefill_token_threshold", "enable_chunked_prefill", "async_scheduling"),
    ("vllm.config.cache", "CacheConfig"): ("block_size",),
    ("vllm.sampling_params", "SamplingParams"): ("extra_args",),
    ("vllm.v1.metrics.stats", "SchedulerStats"): ("running_lora_adapters",),
    ("vllm.v1.engine.core", "EngineCore"): ("scheduler",),
    ("vllm.v1.engine.core", "EngineCoreProc"): ("output_queue",),
    ("vllm.v1.engine", "EngineCoreOutputs"): ("scheduler_stats",),
}
_RETAINABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
CLOSE_UTILITY = "qwen4exp_close_session"  # the EngineCore method the API server calls (qwen4exp.serving.session_api)


class SessionPriorityQueue(PriorityRequestQueue):
    """vLLM's priority queue (``--scheduling-policy priority``: the lowest ``priority`` first, e.g. from the
    ``X-Vllm-Priority`` header, then the earliest arrival) with one key between the two: within a priority class,
    ``rank(request)`` 0 (a session's next turn, while favoured) goes before 1 (first turns). ``refresh`` re-keys the
    heap where a rank changed since it was pushed (a session's pin released, favouring paused)."""

    def __init__(self, rank) -> None:
        super().__init__()
        self._rank = rank
        self._heap: list[tuple] = []  # (priority, rank, arrival_time, request_id, id, request)

    def _entry(self, r) -> tuple:
        return (r.priority, self._rank(r), r.arrival_time, r.request_id, id(r), r)

    def add_request(self, request) -> None:
        heapq.heappush(self._heap, self._entry(request))

    def pop_request(self):
        if not self._heap:
            raise IndexError("pop from empty heap")
        return heapq.heappop(self._heap)[-1]

    def peek_request(self):
        if not self._heap:
            raise IndexError("peek from empty heap")
        return self._heap[0][-1]

    def remove_request(self, request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests) -> None:
        gone = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[-1]) not in gone]
        heapq.heapify(self._heap)

    def rekey(self, request) -> None:
        """Key ``request`` again if it is queued here (its rank may have changed)."""
        for i, e in enumerate(self._heap):
            if e[-1] is request:
                self._heap[i] = self._entry(request)
                heapq.heapify(self._heap)
                return

    def requests(self) -> list:
        """The queued requests, in no particular order."""
        return [e[-1] for e in self._heap]

    def __iter__(self):
        heap = self._heap[:]
        while heap:
            yield heapq.heappop(heap)[-1]

    def refresh(self) -> bool:
        if not any(e[1] != self._rank(e[-1]) for e in self._heap):
            return False
        self._heap = [self._entry(e[-1]) for e in self._heap]
        heapq.heapify(self._heap)
        return True


def _mm_before(request, n: int) -> tuple:
    """The request's multimodal items that start before token ``n``: (offset, length, identifier)."""
    return tuple((f.mm_position.offset, f.mm_position.length, f.identifier) for f in (request.mm_features or ())
                 if f.mm_position.offset < n)


def _group_kind(manager) -> str:
    """A KV-cache group's kind for ``policies.exact_resume_supported``."""
    if type(manager) is FullAttentionManager and manager.enable_caching:
        return ATTENTION
    if (isinstance(manager, MambaManager) and manager.enable_caching and manager.mamba_cache_mode == "align"
            and manager.num_speculative_blocks == 0):
        return STATE_ALIGN
    return OTHER


def _lora_id(request):
    return request.lora_request.lora_int_id if request.lora_request is not None else None


def _closes_session(request) -> bool:
    extra = getattr(request.sampling_params, "extra_args", None) or {}
    value = extra.get("session_close")
    if value is None:
        return False
    try:
        return close_flag(value)
    except ValueError:  # (qwen4exp-serve answers these with a 400; plain `vllm serve` lets them through)
        logger.warning("AgentScheduler: request %s: ignoring vllm_xargs.session_close=%r (want true/1/yes or "
                       "false/0/no)", request.request_id, value)
        return False


def _close_session_utility(self, session_id: str, client_index: int = 0) -> dict:
    """``EngineCore.qwen4exp_close_session`` (installed by ``AgentScheduler``): the scheduler's ``close_session``,
    run by the engine core's busy loop between steps like any utility call. After a release the session numbers go
    to the calling API server at once (a stats-only output, as vLLM's DP load stats), not with the next step."""
    close = getattr(self.scheduler, "close_session", None)
    if close is None:
        return {"agent_scheduler": False}
    out = close(session_id)
    queue = getattr(self, "output_queue", None)  # (EngineCoreProc: the output socket thread's queue)
    if out.get("released") and queue is not None and (stats := self.scheduler.make_stats()) is not None:
        from vllm.v1.engine import EngineCoreOutputs

        queue.put_nowait((client_index, EngineCoreOutputs(scheduler_stats=stats)))
    return out


def _install_close_utility(scheduler=None) -> None:
    """``EngineCore.qwen4exp_close_session`` (the ``engine_core_close_utility`` entry of ``qwen4exp.vllm.patches``)."""
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, CLOSE_UTILITY, None) is not _close_session_utility:
        setattr(EngineCore, CLOSE_UTILITY, _close_session_utility)


def _install_kv_cache_hooks(scheduler) -> None:
    """The scheduler's own coordinator ``cache_blocks`` and manager ``allocate_slots`` go through its checkpoint
    and pin-release hooks (the ``kv_cache_hooks`` entry of ``qwen4exp.vllm.patches``; instance attributes only)."""
    coordinator = scheduler.kv_cache_manager.coordinator
    scheduler._cache_blocks = coordinator.cache_blocks
    coordinator.cache_blocks = scheduler._cache_blocks_with_turn_checkpoint
    scheduler._allocate_slots = scheduler.kv_cache_manager.allocate_slots
    scheduler.kv_cache_manager.allocate_slots = scheduler._allocate_slots_releasing_pins


class AgentScheduler(Scheduler):
    """vLLM's scheduler with agent sessions (module docstring). ``AgentScheduler(...)`` builds the async variant
    when the engine schedules asynchronously."""

    # its stats carry ``metrics.payload`` (``metrics.uses_agent_scheduler`` asks this of a configured scheduler
    # class, so that metrics, which this module imports, never imports this module back)
    sends_session_stats = metrics.CARRIES_SESSION_STATS

    def __new__(cls, *args, **kwargs):
        if cls is AgentScheduler:
            config = kwargs.get("vllm_config", args[0] if args else None)
            if config is not None and config.scheduler_config.async_scheduling:
                cls = AsyncAgentScheduler
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        if patches.vllm_minor(vllm.__version__) not in SUPPORTED_VLLM:
            raise RuntimeError(f"qwen4exp.serving.scheduler.AgentScheduler supports vLLM "
                               f"{', '.join(SUPPORTED_VLLM)} (it uses the scheduler's private interface, checked per "
                               f"minor version by tests/test_vllm_patch_contract.py); this is vLLM {vllm.__version__}")
        super().__init__(*args, **kwargs)
        self.sessions = Sessions(self._release_blocks, ttl=envs.QWEN4EXP_SESSION_TTL)
        self._favouring = True  # (priority policy: off while a first turn of the best class has waited HEAD_WAIT_S)
        if self.policy == SchedulingPolicy.PRIORITY:  # next turns first within their priority class
            self.waiting = SessionPriorityQueue(self._waiting_rank)
        self._metrics_sent: dict[str, int] = {}  # what the last stats carried (qwen4exp.serving.metrics.payload)
        self.checkpoints = CheckpointTracker()  # per request, its newest checkpoint per hybrid group
        self.exact_resumes = 0  # next turns that resumed at their previous turn's exact end
        self._resume_offered: set[str] = set()  # requests handed a resume point, not yet allocated
        self.preempted_tokens = 0  # computed tokens thrown away by preemptions (recomputed on readmission)
        self.capped_steps = 0  # steps whose prefill chunks were capped for a waiting next turn
        self._continuing: set[str] = set()  # favoured next turns admitted with part of their prefill still to run
        self.continued_steps = 0  # steps that moved such a turn ahead of another running request
        self.paused_steps = 0  # steps that ran at the short budget of a tool pause (QWEN4EXP_PAUSE_CHUNK)
        coordinator = self.kv_cache_manager.coordinator
        self._mamba_groups = [(g, m) for g, m in enumerate(coordinator.single_type_managers)
                              if isinstance(m, MambaManager) and m.enable_caching]
        # the exact resume point needs every group to be plain full attention or a hybrid-state group in "align"
        # mode without speculative blocks (MTP: the state of the last accepted token moves between slots)
        self._exact_resume = exact_resume_supported([_group_kind(m) for m in coordinator.single_type_managers],
                                                    len(self._mamba_groups), self.connector is not None)
        patches.apply("scheduler", self)  # this scheduler's cache_blocks / allocate_slots, EngineCore's utility
        logger.info("%s: session TTL %.1f s, end-of-turn checkpoint in %d hybrid-state group(s), exact resume %s",
                    type(self).__name__, self.sessions.ttl, len(self._mamba_groups),
                    "on" if self._exact_resume else "off")

    # --- the end-of-turn hybrid checkpoint ----------------------------------------------------------------------
    def _cache_blocks_with_turn_checkpoint(self, request, num_computed_tokens: int):
        if request.session_id is None:
            return self._cache_blocks(request, num_computed_tokens)
        decoding = num_computed_tokens > request.num_prompt_tokens
        if decoding:
            # a "shared-prefix junction" at the newest computed token: vLLM's sparse state retention then keeps the
            # state block ending at the last block boundary crossed (the same rule that keeps the prompt's)
            request.shared_prefix_boundary = num_computed_tokens
        self._cache_blocks(request, num_computed_tokens)
        if self._mamba_groups:
            self._track_checkpoint(request, num_computed_tokens, decoding)

    def _track_checkpoint(self, request, num_computed_tokens: int, decoding: bool) -> None:
        """Remember the request's newest cached state block per hybrid group (``CheckpointTracker``); a decode
        checkpoint a newer one replaces is evicted from the prefix cache if it still holds its state."""
        found = []
        for _, manager in self._mamba_groups:
            blocks = manager.req_to_blocks.get(request.request_id, ())
            i = newest_cached([None if b.is_null else b.block_hash for b in blocks],
                              num_computed_tokens // manager.block_size)
            found.append(None if i is None else Checkpoint(blocks[i], blocks[i].block_hash, decoding))
        for old in self.checkpoints.update(request.request_id, found):
            if old.holds(old.block.block_hash):
                self.kv_cache_manager.block_pool._maybe_evict_cached_block(old.block)

    def _checkpoint_blocks(self, request, held: list) -> list:
        """The request's tracked checkpoint blocks that still hold their state and that ``held`` lacks, touched
        (referenced once more) so that they stay cached while pinned."""
        ids = {id(b) for b in held}
        extra = [c.block for c in self.checkpoints.take(request.request_id)
                 if c.holds(c.block.block_hash) and id(c.block) not in ids]
        if extra:
            self.kv_cache_manager.block_pool.touch(extra)
        return extra

    # --- the exact resume point ------------------------------------------------------------------------------
    def _resume_record(self, request) -> Resume | None:
        """Before a finished turn's blocks are popped: the blocks that hold its KV and its hybrid state after exactly
        ``num_computed_tokens`` tokens (``policies.resume_groups``; None when they are not all there)."""
        n = request.num_computed_tokens
        if not self._exact_resume or not 0 < n <= request.num_tokens:
            return None
        coordinator = self.kv_cache_manager.coordinator
        views = []
        for manager in coordinator.single_type_managers:
            blocks = manager.req_to_blocks.get(request.request_id, ())
            views.append(GroupBlocks(manager.block_size, isinstance(manager, MambaManager), blocks,
                                     [b.is_null for b in blocks]))
        groups = resume_groups(n, views, self.kv_cache_manager.block_pool.null_block)
        if groups is None:
            return None
        hashes = list(request.block_hashes[: n // self.hash_block_size])
        return Resume(n, hashes, list(request.all_token_ids[len(hashes) * self.hash_block_size: n]), groups,
                      request.cache_salt, _lora_id(request), _mm_before(request, n))

    def _get_local_prefix_cache_hit(self, request, *args, **kwargs):
        """vLLM's prefix-cache lookup, or, for a session's next turn whose prompt starts with everything the previous
        turn computed, that turn's blocks up to its exact end (the attention tail block and the hybrid state are
        copied on write by vLLM's partial-hit path): the next turn prefills only its new tokens. vLLM 0.33+ pass
        ``max_cache_hit_length`` (an upper bound on the hit, None for none): a resume point past it is not offered."""
        hit = super()._get_local_prefix_cache_hit(request, *args, **kwargs)
        if request.session_id is None or request.num_computed_tokens or request.prompt_token_ids is None:
            return hit
        self._resume_offered.discard(request.request_id)  # (offered at an earlier try that did not fit)
        r = self.sessions.resume_point(request.session_id)
        bound = args[0] if args else kwargs.get("max_cache_hit_length")
        if (not resume_in_reach(r, hit[1], request.num_tokens, bound)
                or not self.kv_cache_manager.prefix_cache_lookup_enabled(request)
                or not resume_matches(r, request.cache_salt, _lora_id(request),
                                      request.block_hashes[: len(r.block_hashes)],
                                      request.prompt_token_ids[len(r.block_hashes) * self.hash_block_size: r.tokens],
                                      _mm_before(request, r.tokens))):
            return hit
        self._resume_offered.add(request.request_id)  # counted once it is allocated (schedule)
        blocks = self.kv_cache_manager.create_kv_cache_blocks(tuple(list(g) for g in r.groups))
        return blocks, r.tokens, 0, False

    # --- soft retention ----------------------------------------------------------------------------------------
    def _release_blocks(self, blocks: list, fence: int) -> None:
        """Give pinned blocks back to the pool (tail first), after the step that wrote them if it may still run."""
        if Retention.release_now(self.defer_block_free, fence, self.processed_step_seq):
            self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))
        else:
            self.deferred_frees.append((fence, blocks))

    def _allocate_slots_releasing_pins(self, *args, **kwargs):
        new_blocks = self._allocate_slots(*args, **kwargs)
        while new_blocks is None and self.sessions.release_one(Event.PRESSURE):
            new_blocks = self._allocate_slots(*args, **kwargs)
        if new_blocks is None:  # vLLM preempts next (a running request) or stops admitting (a waiting one)
            self._order_victims(args[0] if args else kwargs["request"])
        return new_blocks

    # --- preemption ----------------------------------------------------------------------------------------------
    def _order_victims(self, request) -> None:
        """vLLM is about to preempt ``self.running[-1]`` (its FCFS rule: the last admitted) to make room for the
        running ``request``; only the requests after it, not yet scheduled this step, can be taken. Order those so
        the last is the one ``victim_order`` picks. Under ``--scheduling-policy priority`` vLLM's own choice (the
        lowest priority, then the latest arrival) stands."""
        if self.policy != SchedulingPolicy.FCFS:
            return
        running = self.running
        try:
            i = running.index(request)
        except ValueError:  # a waiting request: no preemption follows
            return
        if VictimOrder.applies(True, len(running) - i - 1):
            running[i + 1:] = sorted(running[i + 1:], key=self._victim_order)

    def _victim_order(self, r) -> tuple:
        """Sort key of preemption candidates, the victim last (``VictimOrder.key``)."""
        return VictimOrder.key(Candidate(self._request_blocks_can_be_freed(r), r.num_preemptions, r.num_prompt_tokens,
                                         r.num_computed_tokens, r.arrival_time))

    def _preempt_request(self, request, *args, **kwargs):
        self.preempted_tokens += request.num_computed_tokens  # computed work the preemption throws away
        return super()._preempt_request(request, *args, **kwargs)

    def add_request(self, request) -> None:
        super().add_request(request)
        if request.session_id is not None and request.request_id in self.requests and not request.resumable:
            self._fire(request.session_id, Event.ARRIVE, request.request_id)
            self.sessions.bound()
            if isinstance(self.waiting, SessionPriorityQueue):
                self.waiting.rekey(request)  # (queued before ARRIVE made it a next turn)

    def _free_blocks(self, request):
        sid = request.session_id
        if not Retention.session_matter(session=sid is not None, resumable=bool(request.resumable),
                                        closed=sid is not None and self.sessions.state(sid) is State.CLOSED):
            return super()._free_blocks(request)
        normal = request.status in _RETAINABLE
        decision = Retention.on_end(finished_normally=normal, closes=normal and _closes_session(request),
                                    ttl=self.sessions.ttl,
                                    sole_active=self.sessions.sessions[sid].active == {request.request_id})
        if decision in (Freed.PIN, Freed.UNPINNED):
            pin = None
            if decision is Freed.PIN:
                fence = Retention.pin_fence(self.defer_block_free, request.last_sched_seq)
                resume = self._resume_record(request)
                blocks = self.kv_cache_manager.pop_blocks_for_free(request)
                pin = self.sessions.new_pin(blocks + self._checkpoint_blocks(request, blocks), fence,
                                            request.request_id, resume, request.num_computed_tokens)
            state = self._fire(sid, Event.FINISH, request.request_id, pin)
            if pin is None:
                self.checkpoints.drop(request.request_id)
                return super()._free_blocks(request)
            if state is not State.RETAINED:  # refused: nothing holds the popped blocks
                self._release_blocks(pin.blocks, pin.fence)
            del self.requests[request.request_id]
            return
        self.checkpoints.drop(request.request_id)
        self._fire(sid, Event.ABORT if decision is Freed.ABORT else Event.CLOSE, request.request_id)
        return super()._free_blocks(request)

    def _fire(self, sid: str, event: Event, request_id: str | None = None, pin=None) -> State | None:
        """``sessions.fire``; an event the state machine refuses (a bug, counted on /metrics) drops the session
        (its pin released) instead of failing the engine step: None then."""
        try:
            return self.sessions.fire(sid, event, request_id, pin)
        except IllegalTransition as e:
            logger.error("AgentScheduler: %s; the session's retention is dropped", e)
            self.sessions.forget(sid)
            return None

    def close_session(self, session_id: str) -> dict:
        """An explicit close (``Sessions.close``): a retained session's pin released now; a session with turns in
        flight is left alone (``turns_in_flight``); an unknown one is answered ``state: "closed"``."""
        return self.sessions.close(session_id)

    # --- admission -----------------------------------------------------------------------------------------------
    def _is_continuation(self, r) -> bool:
        """A waiting next turn of a session whose blocks are held for it (HANDOFF)."""
        return r.session_id is not None and r.status == RequestStatus.WAITING and r.session_id in self.sessions.handoff

    def _waiting_rank(self, r) -> int:
        """``SessionPriorityQueue``'s key within a priority class (``Admission.rank``): 0 for a next turn while
        favouring is on, else 1."""
        return Admission.rank(self._favouring, self._favouring and self._is_continuation(r))

    def _continuations_first_by_priority(self) -> list:
        """``--scheduling-policy priority``: the queue itself orders next turns first within their class
        (``SessionPriorityQueue``); here favouring pauses while a first turn of the best waiting class has waited
        ``HEAD_WAIT_S`` (and resumes when none has; ``Admission.favouring``). The favoured turns: the next turns at
        the front of the queue, at most ``CONTINUATIONS_PER_STEP`` (``Admission.favoured_by_priority``)."""
        waiting = self.waiting
        if not waiting or not self.sessions.handoff:  # (no next turn waits: only ranks left over from one that went)
            self._favouring = True
            waiting.refresh()
            return []
        now, best = time.time(), waiting.peek_request().priority
        self._favouring = _ADMISSION.favouring((Queued(self._is_continuation(r), r.arrival_time, r.priority)
                                                for r in waiting.requests()), best, now)
        waiting.refresh()
        seen = []

        def ordered():
            for r in waiting:
                seen.append(r)
                yield Queued(self._is_continuation(r), r.arrival_time, r.priority)

        return seen[:_ADMISSION.favoured_by_priority(ordered(), best, self._favouring)]

    def _continuations_first(self) -> list:
        """Move the waiting turns of sessions whose blocks are held (HANDOFF) ahead of the queue, at most
        ``CONTINUATIONS_PER_STEP``, unless the queue's head has waited ``HEAD_WAIT_S`` (``Admission.favoured_fcfs``);
        the turns favoured."""
        waiting = self.waiting
        if isinstance(waiting, SessionPriorityQueue):
            return self._continuations_first_by_priority()
        if not waiting or not self.sessions.handoff:
            return []
        queue = list(waiting)
        positions = _ADMISSION.favoured_fcfs([Queued(self._is_continuation(r), r.arrival_time) for r in queue],
                                             time.time())
        favoured = [queue[i] for i in positions]
        if Admission.moves(positions):
            waiting.remove_requests(favoured)
            waiting.prepend_requests(reversed(favoured))  # (vLLM's FCFS queue prepends them one by one: extendleft)
        return favoured

    def _continuations_running_first(self) -> None:
        """Move favoured turns admitted with part of their prefill left to the front of the running queue
        (``Admission.still_continuing``, ``Admission.running_order``): vLLM ends a chunk that starts mid-block at the
        block boundary, so a turn resuming just short of one is admitted with the rest of its new tokens still to
        prefill, and as a running request behind a long first-turn prefill (admitted before it) it would wait for
        all that prefill's chunks. At the front it takes only its remaining prompt tokens (under one block) before
        the others."""
        if self._continuing:
            state = {rid: Admitted(r.status == RequestStatus.RUNNING, r.num_prompt_tokens - r.num_computed_tokens)
                     for rid in self._continuing if (r := self.requests.get(rid)) is not None}
            keep = Admission.still_continuing(self._continuing, state)
            self._continuing.intersection_update(keep)
        if self._continuing:
            positions = Admission.running_order([r.request_id for r in self.running], self._continuing)
            if Admission.moves(positions):  # (counted where it went ahead of another)
                self.running[:] = [self.running[i] for i in positions]
                self.continued_steps += 1

    def _track_continuing(self, favoured: list) -> None:
        """After a step: the favoured turns it admitted with part of their prompt left, at most a chunk's worth
        (``QWEN4EXP_CONTINUATION_CHUNK`` or one block: the rest of a turn cut at a block boundary), run first in the
        steps after (``Admission.newly_continuing``). ``num_computed_tokens`` already counts what this step
        scheduled."""
        most = max(self.cache_config.block_size, envs.QWEN4EXP_CONTINUATION_CHUNK)
        self._continuing.update(Admission.newly_continuing(
            {r.request_id: Admitted(r.status == RequestStatus.RUNNING, r.num_prompt_tokens - r.num_computed_tokens)
             for r in favoured}, most))

    def _continuation_chunk(self, favoured: list) -> int:
        """The prefill cap of a step in which ``favoured`` turns wait (0: none; ``Admission.continuation_chunk``):
        vLLM schedules running requests before waiting ones, so a first turn in the middle of a long prefill would
        take the whole token budget and the next turn would wait for every one of its chunks."""
        cap = envs.QWEN4EXP_CONTINUATION_CHUNK
        if not favoured or cap <= 0:
            return 0
        block = self.cache_config.block_size
        new_tokens = []
        for r in favoured:
            pin = self.sessions.pin_of(r.session_id)
            held = Admission.held_tokens(pin is not None, None if pin is None or pin.resume is None
                                         else pin.resume.tokens, 0 if pin is None else pin.tokens, block)
            new_tokens.append(r.num_tokens - held)
        return Admission.continuation_chunk(cap, block, new_tokens)

    def _pause_budget(self) -> tuple[int, int]:
        """(the step's token budget, its prefill part) while a session is in a tool pause, else (0, 0)
        (``Admission.pause_budget``: ``QWEN4EXP_PAUSE_CHUNK`` in whole blocks plus every running request's decode
        tokens, only with chunked prefill and where it binds)."""
        chunk = envs.QWEN4EXP_PAUSE_CHUNK
        if chunk <= 0 or not self.scheduler_config.enable_chunked_prefill:
            return 0, 0
        return Admission.pause_budget(
            chunk, self.cache_config.block_size,
            paused=bool(self.sessions.retained_count() or self.sessions.handoff),
            chunked_prefill=True, running=len(self.running), spec_tokens=self.num_spec_tokens,
            step_budget=self.max_num_scheduled_tokens)

    def schedule(self, *args, **kwargs):
        self.sessions.expire()
        self._continuations_running_first()
        favoured = self._continuations_first()
        cap = self._continuation_chunk(favoured)
        budget, chunk = (0, 0) if cap else self._pause_budget()
        config = self.scheduler_config
        saved, saved_budget = config.long_prefill_token_threshold, self.max_num_scheduled_tokens
        capped = Admission.cap_binds(cap, self.max_num_scheduled_tokens, saved)
        # the per_step_scheduler_config entry of qwen4exp.vllm.patches: set for this step, restored below
        if capped:  # (vLLM reads the threshold at the start of its schedule and where it aligns a chunk)
            config.long_prefill_token_threshold = cap
            self.capped_steps += 1
        if budget:  # (read at the start of vLLM's schedule, where it aligns a chunk and in its final check)
            self.max_num_scheduled_tokens = budget
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            config.long_prefill_token_threshold = saved
            self.max_num_scheduled_tokens = saved_budget
        if budget and out.total_num_scheduled_tokens >= chunk:  # (counted where the short budget was filled)
            self.paused_steps += 1
        self._track_continuing(favoured)
        for sid in list(self.sessions.handoff):
            if any((r := self.requests.get(rid)) is not None and r.status != RequestStatus.WAITING
                   for rid in self.sessions.sessions[sid].active):
                self._fire(sid, Event.ALLOCATED)
        if self._resume_offered:
            for rid in list(self._resume_offered):
                r = self.requests.get(rid)
                if r is None or r.status != RequestStatus.WAITING:  # allocated with the hit (or gone)
                    self._resume_offered.discard(rid)
                    self.exact_resumes += r is not None
        return out

    def make_stats(self, *args, **kwargs):
        stats = super().make_stats(*args, **kwargs)
        if stats is not None:  # carried to the API server's AgentStatLogger (stats_carrier in qwen4exp.vllm.patches)
            stats.running_lora_adapters.update(metrics.payload(
                self.sessions, self._metrics_sent,
                {"exact_resumes": self.exact_resumes, "preempted_tokens": self.preempted_tokens,
                 "capped_steps": self.capped_steps, "continued_steps": self.continued_steps,
                 "paused_steps": self.paused_steps}))
        return stats

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        self.sessions.release_all(Event.RESET)
        return super().reset_prefix_cache(*args, **kwargs)

    def shutdown(self) -> None:
        self.sessions.release_all(Event.RESET)
        super().shutdown()


class AsyncAgentScheduler(AgentScheduler, AsyncScheduler):
    """``AgentScheduler`` over vLLM's ``AsyncScheduler`` (what ``AgentScheduler(...)`` builds when scheduling is
    asynchronous)."""
