"""``qwen4exp.serving.sessions``: the session state machine on its own (no engine). Every (state, event) pair either
moves as the module's table says or raises; random event sequences (aborts, expiries, pressure, resets in every
state) never leak or double-free a pin's blocks, and the states always agree with what is held."""

import random

import pytest

from qwen4exp.serving.sessions import (COUNTERS, EVICTION_REASONS, TRANSITIONS, Event, IllegalTransition, Sessions,
                                       State, close_flag)


class Pool:
    """Counts references like vLLM's block pool: pinning takes blocks, release gives them back exactly once."""

    def __init__(self):
        self.held, self.next = set(), 0

    def take(self, n):
        blocks = list(range(self.next, self.next + n))
        self.next += n
        self.held.update(blocks)
        return blocks

    def release(self, blocks, fence):
        for b in blocks:
            assert b in self.held, f"block {b} released twice or never pinned"
            self.held.remove(b)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(ttl=5.0, **kw):
    pool, clock = Pool(), Clock()
    return Sessions(pool.release, ttl=ttl, clock=clock, **kw), pool, clock


def drive_to(s, pool, state):
    """Session 'a' in ``state`` through legal events."""
    if state is State.CLOSED:
        return
    s.fire("a", Event.ARRIVE, "r1")
    if state is State.ACTIVE:
        return
    s.fire("a", Event.FINISH, "r1", s.new_pin(pool.take(3), 0, "r1"))
    if state is State.HANDOFF:
        s.fire("a", Event.ARRIVE, "r2")


# what each listed pair gives for a session with one turn (the turn the event names)
EXPECTED = {
    (State.CLOSED, Event.ARRIVE): State.ACTIVE, (State.ACTIVE, Event.ARRIVE): State.ACTIVE,
    (State.RETAINED, Event.ARRIVE): State.HANDOFF, (State.HANDOFF, Event.ARRIVE): State.HANDOFF,
    (State.HANDOFF, Event.ALLOCATED): State.ACTIVE, (State.ACTIVE, Event.FINISH): State.RETAINED,
    (State.ACTIVE, Event.CLOSE): State.CLOSED, (State.ACTIVE, Event.ABORT): State.CLOSED,
    (State.HANDOFF, Event.ABORT): State.CLOSED, (State.HANDOFF, Event.PRESSURE): State.ACTIVE,
    (State.HANDOFF, Event.RESET): State.ACTIVE, (State.RETAINED, Event.EXPIRE): State.CLOSED,
    (State.RETAINED, Event.PRESSURE): State.CLOSED, (State.RETAINED, Event.RESET): State.CLOSED,
    (State.RETAINED, Event.CLOSE): State.CLOSED,
}


def test_table_is_the_documented_one():
    assert set(TRANSITIONS) == set(EXPECTED)


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.value)
@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.value)
def test_every_pair_moves_as_listed_or_raises(state, event):
    s, pool, _ = make()
    drive_to(s, pool, state)
    assert s.state("a") is state
    rid = "r2" if state is State.HANDOFF else "r1"
    pin = s.new_pin(pool.take(2), 0, rid) if event is Event.FINISH else None
    if (state, event) not in EXPECTED:
        with pytest.raises(IllegalTransition, match=f"event '{event.value}' is not allowed in state '{state.value}'"):
            s.fire("a", event, rid, pin)
        return
    assert s.fire("a", event, rid if event is not Event.ARRIVE else "r9", pin) is EXPECTED[(state, event)]
    after = s.state("a")
    assert (after in (State.RETAINED, State.HANDOFF)) == bool(pool.held)  # a pin exactly when a pinned state


def test_finish_with_other_turns_running_pins_nothing():
    s, pool, _ = make()
    s.fire("a", Event.ARRIVE, "r1")
    s.fire("a", Event.ARRIVE, "r2")  # a sub-agent's turn beside it
    assert s.fire("a", Event.FINISH, "r1", None) is State.ACTIVE
    assert s.fire("a", Event.FINISH, "r2", s.new_pin(pool.take(4), 0, "r2")) is State.RETAINED
    assert s.pinned_blocks() == 4


def test_ttl_expiry_and_lru_pressure_order():
    s, pool, clock = make(ttl=5.0)
    for i, sid in enumerate("abc"):
        clock.t = float(i)
        s.fire(sid, Event.ARRIVE, f"r{sid}")
        s.fire(sid, Event.FINISH, f"r{sid}", s.new_pin(pool.take(2), 0, f"r{sid}"))
    clock.t = 5.5  # a's pin (t=0) is past its TTL; b's (t=1) and c's are not
    assert s.expire() == 1 and s.state("a") is State.CLOSED and s.counts["expired"] == 1
    s.fire("b", Event.ARRIVE, "rb2")  # b becomes the most recently used
    assert s.release_one() and s.state("c") is State.CLOSED  # the least recently used pin goes first
    assert s.state("b") is State.HANDOFF
    assert s.release_one() and s.state("b") is State.ACTIVE and not pool.held
    assert not s.release_one()


def test_pressure_takes_idle_pins_before_one_a_waiting_turn_is_about_to_use():
    s, pool, clock = make(ttl=5.0)
    s.fire("a", Event.ARRIVE, "ra")
    s.fire("a", Event.FINISH, "ra", s.new_pin(pool.take(2), 0, "ra"))
    s.fire("a", Event.ARRIVE, "ra2")  # a's next turn waits for its pin (HANDOFF)
    for sid in "bc":
        s.fire(sid, Event.ARRIVE, f"r{sid}")
        s.fire(sid, Event.FINISH, f"r{sid}", s.new_pin(pool.take(2), 0, f"r{sid}"))
    s.sessions.move_to_end("a", last=False)  # a is the least recently used session now
    assert s.state("a") is State.HANDOFF
    assert s.release_one() and s.state("b") is State.CLOSED and s.state("a") is State.HANDOFF
    assert s.release_one() and s.state("c") is State.CLOSED and s.state("a") is State.HANDOFF
    assert s.release_one() and s.state("a") is State.ACTIVE and not pool.held  # the last pin left
    assert not s.release_one()


def test_bound_drops_least_recent_pins_not_running_turns():
    s, pool, _ = make(max_sessions=2)
    s.fire("run", Event.ARRIVE, "r0")
    for sid in "xy":
        s.fire(sid, Event.ARRIVE, f"r{sid}")
        s.fire(sid, Event.FINISH, f"r{sid}", s.new_pin(pool.take(1), 0, f"r{sid}"))
    s.bound()
    assert set(s.sessions) == {"run", "y"} and s.counts["evicted_lru"] == 1


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.value)
def test_explicit_close_releases_only_an_idle_sessions_pin(state):
    """``Sessions.close`` (the close endpoint): RETAINED -> CLOSED with the pin released and counted as a close; a
    session with a turn running or waiting (ACTIVE, HANDOFF) is left as it is; one without a record (CLOSED: never seen,
    or ended) answers "unknown", not "closed", which would read as if it had been open."""
    s, pool, _ = make()
    drive_to(s, pool, state)
    held = set(pool.held)
    out = s.close("a")
    assert out["state"] == ("unknown" if state is State.CLOSED else state.value)
    if state is State.RETAINED:
        assert out == {"state": "retained", "released": True, "released_blocks": 3, "turns_in_flight": 0}
        assert s.state("a") is State.CLOSED and not pool.held and s.pinned_blocks() == 0
        assert s.evictions["close"] == 1 and s.counts["closed"] == 1
        assert s.fire("a", Event.ARRIVE, "r3") is State.ACTIVE  # the next turn is a first turn: no hand-off
        assert s.counts["handed_off"] == 0
        return
    assert out["released"] is False and out["released_blocks"] == 0 and s.state("a") is state
    assert out["turns_in_flight"] == (0 if state is State.CLOSED else 1) and pool.held == held
    assert s.evictions["close"] == 0 and not s.counts["illegal_transitions"]


@pytest.mark.parametrize("value,want", [(True, True), (False, False), (1, True), (0, False), (1.0, True),
                                        ("true", True), ("TRUE", True), (" yes ", True), ("1", True),
                                        ("false", False), ("No", False), ("0", False)])
def test_close_flag_values(value, want):
    assert close_flag(value) is want


@pytest.mark.parametrize("value", ["", "maybe", "2", "on", 2, -1, None, [], {}])
def test_close_flag_refuses_other_values(value):
    with pytest.raises(ValueError, match="expected one of true/1/yes or false/0/no"):
        close_flag(value)


def test_negative_ttl_is_refused():
    with pytest.raises(ValueError, match="TTL"):
        Sessions(lambda b, f: None, ttl=-1)


@pytest.mark.parametrize("seed", range(20))
def test_random_event_sequences_leak_nothing(seed):
    rng = random.Random(seed)
    s, pool, clock = make(ttl=3.0, max_sessions=5)
    running: dict[str, set] = {}  # what the engine would have: running turns per session
    legal = illegal = 0
    for step in range(400):
        clock.t += rng.random()
        sid = rng.choice("abcdefg")
        state = s.state(sid)
        turns = running.setdefault(sid, set())
        event = rng.choice(list(Event))
        rid = rng.choice(sorted(turns)) if turns and event in (Event.FINISH, Event.CLOSE, Event.ABORT) else f"q{step}"
        pin = s.new_pin(pool.take(rng.randint(1, 4)), step, rid) if event is Event.FINISH else None
        try:
            s.fire(sid, event, rid, pin)
            legal += 1
            if event is Event.ARRIVE:
                turns.add(rid)
            elif event in (Event.FINISH, Event.CLOSE, Event.ABORT):
                turns.discard(rid)
        except IllegalTransition as e:
            illegal += 1
            assert (state, event) not in TRANSITIONS and e.state is state
            if pin is not None:  # the caller frees blocks a refused pin would have held
                pool.release(pin.blocks, 0)
        if pin is not None and s.state(sid) is not State.RETAINED and pin.blocks[0] in pool.held and \
                all(x.pin is not pin for x in s.sessions.values()):
            pool.release(pin.blocks, 0)  # not kept as a pin: vLLM frees them (the scheduler does this)
        if rng.random() < 0.1:
            s.expire()
        if rng.random() < 0.05:
            s.bound()
        # invariants: what is held is exactly what the pins hold; states agree with pins and turns
        assert pool.held == {b for x in s.sessions.values() if x.pin for b in x.pin.blocks}
        for x in s.sessions.values():
            assert (x.pin is not None) == (x.state in (State.RETAINED, State.HANDOFF))
            assert bool(x.active) == (x.state in (State.ACTIVE, State.HANDOFF)), x
        assert s.handoff == {sid for sid, x in s.sessions.items() if x.state is State.HANDOFF}
        # the counts kept for /metrics agree with the records
        assert s.pinned_blocks() == len(pool.held)
        assert s.by_state() == {st.value: sum(x.state is st for x in s.sessions.values())
                                for st in State if st is not State.CLOSED}
        if rng.random() < 0.02 and s.sessions:
            s.forget(rng.choice(sorted(s.sessions)))  # the scheduler's way out of a refused event
    s.release_all()
    assert not pool.held and s.pinned_blocks() == 0
    assert legal > 50 and illegal > 50 and s.counts["illegal_transitions"] == illegal
    # every pin taken was handed off or evicted for a reason
    assert s.counts["retained"] == s.counts["handed_off"] + sum(s.evictions.values())
    assert set(s.evictions) == set(EVICTION_REASONS) and s.evictions["ttl"] == s.counts["expired"] > 0
    assert set(s.snapshot()) >= set(COUNTERS) | {"sessions", "pinned_blocks", "evictions"}
