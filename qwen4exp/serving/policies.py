"""AgentScheduler's scheduling policies as plain classes: no vLLM import, no engine.

``AgentScheduler`` (``qwen4exp.serving.scheduler``) is the adapter: it reads vLLM's requests, KV-cache managers and
queues, hands these classes plain data (request ids, token and block counts, block hashes, session flags, arrival
times) and applies what they decide through vLLM's private interface. The session state machine (which session
holds a pin, and the order pins go under pressure) is ``qwen4exp.serving.sessions``. Tests: ``tests/test_sessions.py``
and ``tests/test_scheduler_policies.py`` (both without an engine).

* ``CheckpointTracker``, ``newest_cached``: the end-of-turn hybrid checkpoint (the newest cached state block per
  hybrid group, one decode checkpoint a request).
* ``Resume``, ``resume_groups``, ``exact_resume_supported``, ``resume_in_reach``, ``resume_matches``: the exact
  resume point (what a finished turn keeps, and whether a next turn may take it).
* ``Retention``: what a finished session request's blocks do (pinned, freed, which session event).
* ``Admission``: continuation first (FCFS and priority queues), the prefill chunk cap of a step in which a next turn
  waits, the short step budget of a tool pause, and which admitted next turns run first.
* ``VictimOrder``: which running request vLLM preempts first.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

CONTINUATIONS_PER_STEP = 4  # continuation turns moved ahead of the queue per step
HEAD_WAIT_S = 2.0  # ... unless the head of the queue has waited this long (first turns are never starved)


# --- checkpoint tracking and resume ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """A cached hybrid-state block a request passed: ``block`` (the adapter's handle), the hash it was cached under,
    and whether the request was decoding (a decode checkpoint is evicted when a newer one replaces it; a prompt's is
    vLLM's own and stays)."""

    block: Any
    block_hash: Any
    decoding: bool

    def holds(self, current_hash: Any) -> bool:
        """Whether the block still holds this state (vLLM resets the hash of a block it evicted or reused)."""
        return current_hash == self.block_hash


CHECKPOINT_LOOKBACK = 4  # checkpoints sit at the end of what was just cached: look no further back than this


def newest_cached(hashes: Sequence[Any], computed_blocks: int, lookback: int = CHECKPOINT_LOOKBACK) -> int | None:
    """Index of the newest cached state block of a request in one hybrid group: ``hashes`` has, per block of the
    request, its hash or None (a null placeholder, or not cached); only the first ``computed_blocks`` count, and the
    search stops ``lookback`` blocks from the end. None when there is none."""
    for i in range(min(len(hashes), computed_blocks) - 1, -1, -1):
        if hashes[i] is not None:
            return i
        if len(hashes) - i > lookback:
            break
    return None


class CheckpointTracker:
    """Per request, the newest checkpoint of each hybrid group (vLLM returns a checkpoint block to the pool,
    evictable, once the state has moved past it: the session's pin takes it back at the end of the turn)."""

    def __init__(self) -> None:
        self._latest: dict[str, list[Optional[Checkpoint]]] = {}

    def update(self, request_id: str, found: Sequence[Optional[Checkpoint]]) -> list[Checkpoint]:
        """``found``: per hybrid group the newest checkpoint now cached (None: none found). A group keeps its
        previous checkpoint where nothing or the same block was found. Returns the decode checkpoints a newer one
        replaced (one decode checkpoint a request): the adapter evicts those that still hold their state."""
        prev = self._latest.get(request_id)
        latest, replaced = [], []
        for k, f in enumerate(found):
            old = prev[k] if prev else None
            if f is None or (old is not None and f.block is old.block):
                latest.append(old)
                continue
            if old is not None and old.decoding:
                replaced.append(old)
            latest.append(f)
        self._latest[request_id] = latest
        return replaced

    def take(self, request_id: str) -> list[Checkpoint]:
        """The request's checkpoints (at most one per group), forgotten here: its turn ended."""
        return [c for c in self._latest.pop(request_id, None) or () if c is not None]

    def drop(self, request_id: str) -> None:
        self._latest.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._latest

    def __len__(self) -> int:
        return len(self._latest)


@dataclass
class Resume:
    """Where a session's finished turn stopped, kept with its pin: the exact resume point of the next turn.
    ``tokens`` tokens were computed (prompt + output, less the last sampled token unless a step already fed it);
    ``groups`` has, per KV-cache group, the blocks a next turn takes over as its computed prefix: an attention group
    its first ceil(tokens / block) blocks (the last one partly filled), a hybrid-state group vLLM's null placeholders
    and the block holding the state after exactly ``tokens`` tokens. The rest identifies what was computed, so a
    next turn resumes only if its prompt starts with the same tokens under the same salt, LoRA and images: vLLM's
    hashes of the full hash blocks (they cover tokens, salt, LoRA and images), the ids of the tokens after them."""

    tokens: int
    block_hashes: list
    tail_ids: list
    groups: tuple
    cache_salt: object
    lora_id: object
    mm: tuple


ATTENTION, STATE_ALIGN, OTHER = "attention", "state-align", "other"  # KV-cache group kinds, for the exact resume


def exact_resume_supported(kinds: Sequence[str], state_groups: int, connector: bool) -> bool:
    """The exact resume point needs a hybrid-state group with caching, no KV connector, and every group plain full
    attention with caching (``ATTENTION``) or a cached hybrid-state group in "align" mode without speculative blocks
    (``STATE_ALIGN``; under MTP the state of the last accepted token moves between slots)."""
    return bool(state_groups) and not connector and all(k in (ATTENTION, STATE_ALIGN) for k in kinds)


@dataclass(frozen=True)
class GroupBlocks:
    """A finished request's blocks in one KV-cache group: ``state`` for a hybrid-state group (only its last block
    holds anything: the state), ``null`` per block whether it is vLLM's null placeholder."""

    block_size: int
    state: bool
    blocks: Sequence[Any]
    null: Sequence[bool]


def resume_groups(tokens: int, groups: Sequence[GroupBlocks], null_block: Any) -> tuple | None:
    """Per group the blocks that hold a request's K/V and state after exactly ``tokens`` tokens: an attention group
    its first ceil(tokens / block) blocks, none of them null; a state group null placeholders and the (non-null)
    block holding the state at that point. None where a group lacks them."""
    out = []
    for g in groups:
        k = -(-tokens // g.block_size)
        if len(g.blocks) < k:
            return None
        if g.state:
            if g.null[k - 1]:
                return None
            out.append((null_block,) * (k - 1) + (g.blocks[k - 1],))
        else:
            if any(g.null[:k]):
                return None
            out.append(tuple(g.blocks[:k]))
    return tuple(out)


def resume_in_reach(resume: Resume | None, hit_tokens: int, num_tokens: int, bound: int | None) -> bool:
    """Whether a next turn of ``num_tokens`` tokens (prompt) may take ``resume`` over vLLM's own hit of
    ``hit_tokens``: it must reach further, leave at least the turn's last token to compute, and stay within vLLM's
    bound on the hit (``max_cache_hit_length``, vLLM 0.33+; None: no bound)."""
    return (resume is not None and resume.tokens > hit_tokens and resume.tokens <= num_tokens - 1
            and (bound is None or resume.tokens <= bound))


def resume_matches(resume: Resume, cache_salt: Any, lora_id: Any, block_hashes: Sequence, tail_ids: Sequence,
                   mm: tuple) -> bool:
    """Whether the next turn computes what ``resume`` holds: the same salt and LoRA, the same hashes for the full
    hash blocks (``block_hashes``: the turn's first ``len(resume.block_hashes)``), the same token ids after them up to
    ``resume.tokens`` (``tail_ids``), the same images before that point (``mm``)."""
    return (cache_salt == resume.cache_salt and lora_id == resume.lora_id
            and list(block_hashes) == list(resume.block_hashes) and list(tail_ids) == list(resume.tail_ids)
            and mm == resume.mm)


# --- retention -------------------------------------------------------------------------------------------------------
class Freed(enum.Enum):
    """What becomes of a finished request's blocks (``Retention.on_free``)."""

    PLAIN = "plain"  # not a session matter (no session, a resumable request, a closed session): vLLM frees them
    PIN = "pin"  # the session's last running turn ended normally: pinned for its next turn (FINISH with a pin)
    UNPINNED = "unpinned"  # ended normally, but other turns run or the TTL is 0: FINISH without a pin, then freed
    CLOSE = "close"  # ended normally with session_close: CLOSE, then freed
    ABORT = "abort"  # aborted or failed: ABORT, then freed


class Retention:
    """Soft retention of a session's finished turn (the pins themselves, their release order and TTL:
    ``qwen4exp.serving.sessions``)."""

    @staticmethod
    def session_matter(*, session: bool, resumable: bool, closed: bool) -> bool:
        """Whether a finished request's blocks are the session's business: it has a session id, is no resumable
        (streaming-input) request, and its session is not CLOSED (dropped after a refused event). Otherwise vLLM
        frees them (``Freed.PLAIN``)."""
        return session and not resumable and not closed

    @staticmethod
    def on_end(*, finished_normally: bool, closes: bool, ttl: float, sole_active: bool) -> Freed:
        """A session request ended: ``finished_normally`` (stopped or length-capped), ``closes`` (it carries
        ``session_close``; only asked of a request that finished normally), ``sole_active`` (it is its session's
        only running turn)."""
        if finished_normally and not closes:
            return Freed.PIN if ttl > 0 and sole_active else Freed.UNPINNED
        return Freed.CLOSE if finished_normally else Freed.ABORT

    @classmethod
    def on_free(cls, *, session: bool, resumable: bool, closed: bool, finished_normally: bool, closes: bool,
                ttl: float, sole_active: bool) -> Freed:
        """Both steps at once (``session_matter``, then ``on_end``)."""
        if not cls.session_matter(session=session, resumable=resumable, closed=closed):
            return Freed.PLAIN
        return cls.on_end(finished_normally=finished_normally, closes=closes, ttl=ttl, sole_active=sole_active)

    @staticmethod
    def pin_fence(defer_block_free: bool, last_sched_seq: int) -> int:
        """The step a pin's blocks wait for before they go back (0: none; vLLM's deferred frees)."""
        return last_sched_seq if defer_block_free else 0

    @staticmethod
    def release_now(defer_block_free: bool, fence: int, processed_step_seq: int) -> bool:
        """Whether released blocks go back to the pool now, or after the step ``fence`` (still in flight)."""
        return not defer_block_free or fence <= processed_step_seq


# --- admission -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Queued:
    """A waiting request as admission sees it: a next turn of a session whose blocks are held for it
    (``continuation``), its arrival time and priority class (lower first)."""

    continuation: bool
    arrival_time: float
    priority: int = 0


@dataclass(frozen=True)
class Admitted:
    """A running request as the continuation tracking sees it: still running, and its prompt tokens left."""

    running: bool
    prompt_left: int


class Admission:
    """Continuation first, the prefill chunk cap of a step in which a next turn waits, the pause budget."""

    def __init__(self, per_step: int = CONTINUATIONS_PER_STEP, head_wait_s: float = HEAD_WAIT_S) -> None:
        self.per_step, self.head_wait_s = per_step, head_wait_s

    # continuation first ------------------------------------------------------------------------------------------
    def favoured_fcfs(self, queue: Sequence[Queued], now: float) -> list[int]:
        """FCFS queue: the positions of the next turns to move ahead of the queue (in queue order), at most
        ``per_step``; none when the head is no such turn and has waited past ``head_wait_s``."""
        if not queue:
            return []
        favoured = [i for i, q in enumerate(queue) if q.continuation][:self.per_step]
        if 0 not in favoured and now - queue[0].arrival_time > self.head_wait_s:
            return []
        return favoured

    @staticmethod
    def moves(favoured: Sequence[int]) -> bool:
        """Whether the favoured positions are not already the front of the queue."""
        return any(p != i for i, p in enumerate(favoured))

    def favouring(self, queue: Iterable[Queued], best_priority: int, now: float) -> bool:
        """Priority queue: favouring is on unless a first turn of the best waiting class has waited past
        ``head_wait_s``."""
        return not any(q.priority == best_priority and not q.continuation and now - q.arrival_time > self.head_wait_s
                       for q in queue)

    @staticmethod
    def rank(favouring: bool, continuation: bool) -> int:
        """``SessionPriorityQueue``'s key within a priority class: 0 for a next turn while favouring, else 1."""
        return 0 if favouring and continuation else 1

    def favoured_by_priority(self, ordered: Iterable[Queued], best_priority: int, favouring: bool) -> int:
        """Priority queue in its order: how many at its front are favoured next turns of the best class (at most
        ``per_step``; read lazily, stopping at the first that is not)."""
        n = 0
        if not favouring or self.per_step <= 0:
            return 0
        for q in ordered:
            if q.priority != best_priority or not q.continuation:
                break
            n += 1
            if n == self.per_step:
                break
        return n

    # which admitted next turns run first ---------------------------------------------------------------------------
    @staticmethod
    def still_continuing(continuing: Iterable[str], state: Mapping[str, Admitted]) -> set[str]:
        """Of the next turns running first, those still running with prompt left (a request not in ``state`` is
        gone)."""
        return {rid for rid in continuing
                if (a := state.get(rid)) is not None and a.running and a.prompt_left > 0}

    @staticmethod
    def running_order(running: Sequence[str], continuing: set[str]) -> list[int]:
        """The running queue's new order (positions): the continuing turns first, each part in its order."""
        return ([i for i, rid in enumerate(running) if rid in continuing]
                + [i for i, rid in enumerate(running) if rid not in continuing])

    @staticmethod
    def newly_continuing(favoured: Mapping[str, Admitted], most: int) -> set[str]:
        """After a step: the favoured turns it admitted (running) with part of their prompt left, at most ``most``
        tokens (a chunk's worth: a turn that lost its session's blocks has its whole prompt left and is prefilled as
        any other)."""
        return {rid for rid, a in favoured.items() if a.running and 0 < a.prompt_left <= most}

    # the prefill chunk cap ---------------------------------------------------------------------------------------
    @staticmethod
    def held_tokens(pinned: bool, resume_tokens: int | None, pin_tokens: int, block: int) -> int:
        """Tokens a session holds for its next turn: the exact resume point, else the finished turn's last block
        boundary; 0 without a pin."""
        if not pinned:
            return 0
        return resume_tokens if resume_tokens is not None else pin_tokens // block * block

    @staticmethod
    def continuation_chunk(cap: int, block: int, new_tokens: Sequence[int]) -> int:
        """The prefill cap of a step in which next turns wait with ``new_tokens`` each past what their session
        holds (0: none waits, or ``cap`` is 0): ``cap`` in whole blocks, at least one block and at least the
        turns' own new tokens, so they are not chunked themselves."""
        if not new_tokens or cap <= 0:
            return 0
        return max(block, cap // block * block, max(0, *new_tokens))

    @staticmethod
    def cap_binds(cap: int, step_budget: int, threshold: int) -> bool:
        """Whether the cap changes the step: below the step's token budget and below vLLM's own
        ``long_prefill_token_threshold`` (0: none)."""
        return 0 < cap < step_budget and not 0 < threshold <= cap

    # the pause budget --------------------------------------------------------------------------------------------
    @staticmethod
    def pause_budget(chunk: int, block: int, *, paused: bool, chunked_prefill: bool, running: int, spec_tokens: int,
                     step_budget: int) -> tuple[int, int]:
        """(the step's token budget, its prefill part) while a session is in a tool pause (``paused``: one is
        RETAINED or HANDOFF), else (0, 0): the prefill part is ``chunk`` in whole blocks (at least one), and every
        running request's decode tokens (1 + ``spec_tokens``) come on top. Only with chunked prefill and where it is
        below ``step_budget``."""
        if chunk <= 0 or not chunked_prefill or not paused:
            return 0, 0
        chunk = max(block, chunk // block * block)
        budget = chunk + running * (1 + spec_tokens)
        return (budget, chunk) if budget < step_budget else (0, 0)


# --- victim order ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """A running request as preemption sees it."""

    freeable: bool  # its blocks can be freed now (no async step in flight holds them)
    preemptions: int
    prompt_tokens: int
    computed_tokens: int
    arrival_time: float


class VictimOrder:
    """Which running request goes first when vLLM must preempt (FCFS: it takes the last of the running queue; the
    pins of ``qwen4exp.serving.sessions`` go before any of these)."""

    @staticmethod
    def applies(fcfs: bool, candidates: int) -> bool:
        """Reorder only under FCFS (under priority vLLM's own rule stands) and where there is a choice."""
        return fcfs and candidates > 1

    @staticmethod
    def key(c: Candidate) -> tuple:
        """Sort key, the victim last: one whose blocks cannot be freed now is kept; a request preempted before is
        kept over one never preempted (no ping-pong); an unfinished prefill goes before any decode, the largest
        remaining prefill first; among decodes the least computed first; the latest arrival last."""
        prefilling = c.computed_tokens < c.prompt_tokens
        return (c.freeable, -c.preemptions, prefilling,
                c.prompt_tokens - c.computed_tokens if prefilling else -c.computed_tokens, c.arrival_time)

    @classmethod
    def order(cls, candidates: Sequence[Candidate]) -> list[int]:
        """The candidates' positions, the first victim last (a stable sort)."""
        return sorted(range(len(candidates)), key=lambda i: cls.key(candidates[i]))
