"""Agent sessions as a state machine: which session holds a soft pin on its last turn's KV blocks, and why.

Pure bookkeeping (no vLLM import): ``AgentScheduler`` (``qwen4exp.serving.scheduler``) feeds it the engine's events and
hands it a ``release(blocks, fence)`` callback that returns pinned blocks to vLLM's block pool.

A session is what the requests of one ``session_id`` share. When its last running turn ends normally, that turn's
KV blocks and hybrid-state blocks stay referenced (a *pin*) for ``ttl`` seconds, so the prefix cache cannot evict
them while the agent runs a tool; the session's next turn finds them cached. A pin is soft: it is the first thing
given back under memory pressure (before any running request is preempted), at TTL, on an explicit close
(``session_close`` on the last turn, or ``Sessions.close`` once no turn runs), on an abort, and on a prefix-cache
reset. It never blocks admission (SGLang's pinned streaming sessions wedged workers under concurrent multi-turn
load; this is the evictable kind).

States and the events that move them (any other pair raises ``IllegalTransition``):

    CLOSED   --arrive-->  ACTIVE       (no record: the session's first turn, or one after a close)
    ACTIVE   --arrive-->  ACTIVE       (turns of one session may overlap: sub-agents)
    ACTIVE   --finish-->  RETAINED     (its last running turn ended: pin that turn's blocks)
                          ACTIVE       (other turns still run: the blocks go back unpinned)
    ACTIVE   --close/abort--> CLOSED | ACTIVE (other turns still run)
    RETAINED --arrive-->  HANDOFF      (the next turn is waiting; the pin holds until its blocks are allocated)
    HANDOFF  --arrive-->  HANDOFF
    HANDOFF  --allocated--> ACTIVE     (the next turn holds the cached blocks itself: the pin is released)
    HANDOFF  --abort-->   CLOSED | ACTIVE (pin released)
    HANDOFF  --pressure/reset--> ACTIVE (pin released; the waiting turn goes on without it)
    RETAINED --expire/pressure/reset/close--> CLOSED (pin released)

Counters (``Sessions.counts``, cumulative): the events above, ``illegal_transitions`` (pairs refused), and
``Sessions.evictions``: pins released other than by a hand-off, by reason (``EVICTION_REASONS``). What reaches
``/metrics``: ``qwen4exp.serving.metrics``.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


CLOSE_TRUE = ("true", "1", "yes")
CLOSE_FALSE = ("false", "0", "no")


def close_flag(value: Any) -> bool:
    """A ``session_close`` value (``vllm_xargs`` field or ``X-Session-Close`` header) as a bool: true/1/yes or
    false/0/no (any case), a JSON bool, or the numbers 1/0; anything else raises ``ValueError``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in CLOSE_TRUE or v in CLOSE_FALSE:
            return v in CLOSE_TRUE
    raise ValueError(f"expected one of {'/'.join(CLOSE_TRUE)} or {'/'.join(CLOSE_FALSE)}, got {value!r}")


SESSION_ID_HEADER = "X-Session-ID"  # vLLM's header for a request's session_id
SESSION_ID_MAX_LEN = 256
SESSION_ID_RULE = (f"a session id is 1 to {SESSION_ID_MAX_LEN} printable ASCII characters (space to '~'), not all "
                   f"spaces")


def session_id_problem(value: Any) -> str | None:
    """Why ``value`` is no valid session id, as the end of a sentence naming where it came from (None if it is one).
    A session id (the ``X-Session-ID`` header, the body's ``session_id``, ``vllm_xargs.session_id``, the close
    route's path) is 1 to ``SESSION_ID_MAX_LEN`` (256) printable ASCII characters (space to ``~``), not all spaces:
    ``qwen4exp-serve`` answers any other with a 400 (``qwen4exp.serve.check_session_ids``) instead of vLLM's silent
    acceptance (an empty header meant no session; a 20 kB one was kept as the key of the session's state)."""
    if not isinstance(value, str):
        return f"is a JSON {type(value).__name__}, not a string"
    if not value.strip(" "):
        return "is empty" if not value else "is all spaces"
    if len(value) > SESSION_ID_MAX_LEN:
        return f"is {len(value)} characters long"
    for i, c in enumerate(value):
        if not " " <= c <= "~":
            return f"holds {c!r} at position {i}"
    return None


class State(enum.Enum):
    CLOSED = "closed"
    ACTIVE = "active"
    RETAINED = "retained"
    HANDOFF = "handoff"


class Event(enum.Enum):
    ARRIVE = "arrive"
    ALLOCATED = "allocated"
    FINISH = "finish"  # a turn ended normally (stop or length) and the session stays open
    CLOSE = "close"  # a turn ended with ``session_close``, or an explicit close
    ABORT = "abort"  # a turn was aborted or failed
    EXPIRE = "expire"
    PRESSURE = "pressure"
    RESET = "reset"


class IllegalTransition(RuntimeError):
    def __init__(self, session_id: str, state: State, event: Event):
        super().__init__(f"session {session_id!r}: event {event.value!r} is not allowed in state {state.value!r}")
        self.session_id, self.state, self.event = session_id, state, event


@dataclass
class Pin:
    blocks: list  # the finished turn's blocks, in allocation order (vLLM frees them in reverse)
    fence: int  # the engine step that last wrote them (deferred frees wait for it)
    expires_at: float
    request_id: str
    size: int = 0  # blocks held, vLLM's placeholder null blocks not counted
    resume: Any = None  # the scheduler's record of where the turn stopped (an exact resume point), if it kept one
    tokens: int = 0  # tokens the finished turn computed (prompt + output)


@dataclass
class Session:
    session_id: str
    state: State = State.CLOSED
    active: set = field(default_factory=set)  # request ids of running or waiting turns
    pin: Optional[Pin] = None
    turns: int = 0


# (state, event) -> the handler's name; each handler returns the next state
TRANSITIONS: dict[tuple[State, Event], str] = {
    (State.CLOSED, Event.ARRIVE): "_arrive",
    (State.ACTIVE, Event.ARRIVE): "_arrive",
    (State.RETAINED, Event.ARRIVE): "_arrive_pinned",
    (State.HANDOFF, Event.ARRIVE): "_arrive_pinned",
    (State.HANDOFF, Event.ALLOCATED): "_hand_off",
    (State.ACTIVE, Event.FINISH): "_finish",
    (State.ACTIVE, Event.CLOSE): "_end_turn",
    (State.ACTIVE, Event.ABORT): "_end_turn",
    (State.HANDOFF, Event.ABORT): "_end_turn",
    (State.HANDOFF, Event.PRESSURE): "_drop_pin_keep_turns",
    (State.HANDOFF, Event.RESET): "_drop_pin_keep_turns",
    (State.RETAINED, Event.EXPIRE): "_close",
    (State.RETAINED, Event.PRESSURE): "_close",
    (State.RETAINED, Event.RESET): "_close",
    (State.RETAINED, Event.CLOSE): "_close",
}

COUNTERS = ("turns", "retained", "handed_off", "expired", "released_pressure", "released_reset", "closed", "aborted",
            "evicted_lru", "illegal_transitions")
# why a pin went without a hand-off to the session's next turn ("error": dropped by ``forget`` after a refused event)
EVICTION_REASONS = ("ttl", "pressure", "close", "abort", "reset", "error")
_REASON = {Event.EXPIRE: "ttl", Event.PRESSURE: "pressure", Event.CLOSE: "close", Event.ABORT: "abort",
           Event.RESET: "reset"}


class Sessions:
    """The sessions of one scheduler. ``release(blocks, fence)`` gives a pin's blocks back to the block pool;
    ``clock`` is ``time.monotonic`` unless a test drives time."""

    def __init__(self, release: Callable[[list, int], None], ttl: float, max_sessions: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        if ttl < 0:
            raise ValueError(f"session TTL must be >= 0 seconds, got {ttl}")
        self.release, self.ttl, self.max_sessions, self.clock = release, ttl, max_sessions, clock
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.handoff: set[str] = set()  # the sessions in HANDOFF (what the scheduler checks every step)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.evictions = dict.fromkeys(EVICTION_REASONS, 0)
        self._by_state = dict.fromkeys((s.value for s in State if s is not State.CLOSED), 0)
        self._pinned = 0  # blocks the pins hold (kept as they change: read every engine step for /metrics)

    # --- the machine ---------------------------------------------------------------------------------------------
    def fire(self, session_id: str, event: Event, request_id: str | None = None, pin: Pin | None = None) -> State:
        s = self.sessions.get(session_id) or Session(session_id)
        handler = TRANSITIONS.get((s.state, event))
        if handler is None:
            self.counts["illegal_transitions"] += 1
            raise IllegalTransition(session_id, s.state, event)
        before = s.state
        s.state = getattr(self, handler)(s, event, request_id, pin)
        self._count_state(before, -1)
        self._count_state(s.state, 1)
        if s.state is State.HANDOFF:
            self.handoff.add(session_id)
        else:
            self.handoff.discard(session_id)
        if s.state is State.CLOSED:
            self.sessions.pop(session_id, None)
        else:
            self.sessions[session_id] = s
            self.sessions.move_to_end(session_id)
        return s.state

    def _count_state(self, state: State, n: int) -> None:
        if state is not State.CLOSED:
            self._by_state[state.value] += n

    def _arrive(self, s, event, rid, pin):
        s.active.add(rid)
        s.turns += 1
        self.counts["turns"] += 1
        return State.ACTIVE

    def _arrive_pinned(self, s, event, rid, pin):
        self._arrive(s, event, rid, pin)
        return State.HANDOFF

    def _hand_off(self, s, event, rid, pin):
        self._drop_pin(s, None)
        self.counts["handed_off"] += 1
        return State.ACTIVE

    def _finish(self, s, event, rid, pin):
        s.active.discard(rid)
        if s.active or pin is None:  # other turns still run, or nothing to keep: the caller frees the blocks
            return State.ACTIVE if s.active else State.CLOSED
        s.pin = pin
        self._pinned += pin.size
        self.counts["retained"] += 1
        return State.RETAINED

    def _end_turn(self, s, event, rid, pin):
        s.active.discard(rid)
        self._drop_pin(s, _REASON[event])
        self.counts["aborted" if event is Event.ABORT else "closed"] += 1
        return State.ACTIVE if s.active else State.CLOSED

    def _drop_pin_keep_turns(self, s, event, rid, pin):
        self._drop_pin(s, _REASON[event])
        self.counts["released_pressure" if event is Event.PRESSURE else "released_reset"] += 1
        return State.ACTIVE

    def _close(self, s, event, rid, pin):
        self._drop_pin(s, _REASON[event])
        self.counts[{Event.EXPIRE: "expired", Event.PRESSURE: "released_pressure", Event.RESET: "released_reset",
                     Event.CLOSE: "closed"}[event]] += 1
        return State.CLOSED

    def _drop_pin(self, s, reason: str | None):
        if s.pin is not None:
            pin, s.pin = s.pin, None
            self._pinned -= pin.size
            self.release(pin.blocks, pin.fence)
            if reason is not None:
                self.evictions[reason] += 1

    def forget(self, session_id: str) -> None:
        """Drop a session's record and pin whatever its state (the way back to a known state after a refused event:
        its turns then run, and end, as turns without a session)."""
        s = self.sessions.pop(session_id, None)
        self.handoff.discard(session_id)
        if s is not None:
            self._count_state(s.state, -1)
            self._drop_pin(s, "error")

    def close(self, session_id: str) -> dict[str, Any]:
        """An explicit close of a session with no turn in flight: its pin released at once. Returns ``state`` (the
        session's state before; "unknown" where no record is kept: a session never seen, or one that ended, whose
        record goes), ``released`` (a pin was released), ``released_blocks`` and ``turns_in_flight`` (running or
        waiting turns: then nothing is done; the close belongs on the last turn)."""
        s = self.sessions.get(session_id)
        state = s.state if s is not None else State.CLOSED
        out = {"state": state.value if s is not None else "unknown", "released": False, "released_blocks": 0,
               "turns_in_flight": len(s.active) if s is not None else 0}
        if state is State.RETAINED:
            out["released_blocks"] = s.pin.size
            self.fire(session_id, Event.CLOSE)
            out["released"] = True
        return out

    # --- what the scheduler asks -------------------------------------------------------------------------------
    def state(self, session_id: str) -> State:
        s = self.sessions.get(session_id)
        return s.state if s is not None else State.CLOSED

    def new_pin(self, blocks: list, fence: int, request_id: str, resume: Any = None, tokens: int = 0) -> Pin:
        return Pin(list(blocks), fence, self.clock() + self.ttl, request_id,
                   sum(not getattr(b, "is_null", False) for b in blocks), resume, tokens)

    def pin_of(self, session_id: str) -> Optional[Pin]:
        """The session's pin while its next turn waits for it (HANDOFF), else None."""
        s = self.sessions.get(session_id)
        return s.pin if s is not None and s.state is State.HANDOFF else None

    def resume_point(self, session_id: str) -> Any:
        """The pin's resume record while the session's next turn waits for it (HANDOFF), else None."""
        pin = self.pin_of(session_id)
        return pin.resume if pin is not None else None

    def expire(self) -> int:
        """Release every pin past its TTL; the number released."""
        now, n = self.clock(), 0
        for sid in [sid for sid, s in self.sessions.items() if s.state is State.RETAINED and s.pin.expires_at <= now]:
            self.fire(sid, Event.EXPIRE)
            n += 1
        return n

    def release_one(self, event: Event = Event.PRESSURE) -> bool:
        """Release the least recently used pin (memory pressure): of an idle session (RETAINED) first, of one whose
        next turn is already waiting for it (HANDOFF) only when no other is left; False if none is held."""
        for handoff in (False, True):
            for sid, s in self.sessions.items():
                if s.pin is not None and (s.state is State.HANDOFF) == handoff:
                    self.fire(sid, event)
                    return True
        return False

    def release_all(self, event: Event = Event.RESET) -> int:
        n = 0
        while self.release_one(event):
            n += 1
        return n

    def bound(self) -> None:
        """At most ``max_sessions`` records: the least recently used pinned ones go first (turns in flight stay)."""
        while len(self.sessions) > self.max_sessions:
            victim = next((sid for sid, s in self.sessions.items() if s.state is State.RETAINED), None)
            if victim is None:
                return
            self.fire(victim, Event.PRESSURE)
            self.counts["released_pressure"] -= 1
            self.counts["evicted_lru"] += 1

    def retained_count(self) -> int:
        """Sessions in a tool pause: their finished turn held, no next turn yet (RETAINED)."""
        return self._by_state[State.RETAINED.value]

    def pinned_blocks(self) -> int:
        """Blocks the pins hold (vLLM's placeholder null blocks not counted)."""
        return self._pinned

    def by_state(self) -> dict[str, int]:
        """Sessions per state (CLOSED ones have no record)."""
        return dict(self._by_state)

    def snapshot(self) -> dict[str, Any]:
        """Per-state session counts, pinned blocks and the event counters (for logs and tests)."""
        return {"sessions": self.by_state(), "pinned_blocks": self.pinned_blocks(), **self.counts,
                "evictions": dict(self.evictions)}
