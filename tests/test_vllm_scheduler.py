"""``--scheduler-cls qwen4exp.serving.scheduler.AgentScheduler`` against vLLM's default scheduler, the same script
(``tests/agent_turns.py``: tiny-coder, float32, CPU, a 48-block KV cache) through each:

* a 3-turn session: turn N+1 finds every token turn N computed cached (its prompt *and output*, exactly: the
  default only turn N's prompt, to its last block boundary), and every turn's greedy output is the same with either
  scheduler and with a forced miss;
* other traffic between a session's turns evicts the session's blocks under the default; the pin keeps them;
* a request that needs more than is free while a pin is held gets the pin's blocks (no deadlock, no preemption);
* a pinned session's next turn goes ahead of first turns queued before it;
* while a session is in a tool pause, prefill steps are short (``QWEN4EXP_PAUSE_CHUNK``);
* a turn with ``session_close`` and an aborted turn leave no pin; after releasing the pins every block is free;
* with MTP (CUDA only: on CPU vLLM's prefix caching is off under MTP) a next turn finds no less than under the
  default (vLLM's EAGLE block drop bounds both), with the same greedy outputs.

On a GPU machine this file is part of the GPU suite (``tests/conftest.py``): there the async variant runs.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm]

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = "qwen4exp.serving.scheduler.AgentScheduler"


def _run_both(tmp_path_factory, *extra: str) -> dict:
    out = {}
    for name, cls in (("default", "default"), ("agent", AGENT)):
        work = tmp_path_factory.mktemp(name)
        # a TTL no run reaches: on a loaded machine the default 10 s let pins expire before the pressure check
        env = dict(os.environ, TMPDIR=str(work), QWEN4EXP_CACHE_DIR=str(work / "cache"), QWEN4EXP_SESSION_TTL="600")
        p = subprocess.run([sys.executable, os.path.join(HERE, "agent_turns.py"), cls, str(work / "r.json"), *extra],
                           env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-6000:]
        out[name] = json.loads((work / "r.json").read_text())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _run_both(tmp_path_factory)


@pytest.fixture(scope="module")
def mtp_runs(tmp_path_factory):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: on CPU vLLM turns prefix caching off under MTP (its align mode needs Triton), so "
                    "no turn finds anything cached with either scheduler")
    return _run_both(tmp_path_factory, "3")


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on CUDA `runs` already schedules asynchronously (vLLM's default there)")
    return _run_both(tmp_path_factory, "0", "async")


def test_async_scheduling_on_cpu_gives_the_same_turns(runs, async_runs):
    """The async variants (``AsyncAgentScheduler``, forced on CPU as GPUs run it): the same cached tokens and greedy
    outputs turn by turn as the synchronous runs."""
    assert async_runs["agent"]["scheduler"] == "AsyncAgentScheduler"
    assert async_runs["default"]["scheduler"] == "AsyncScheduler"
    for name in ("default", "agent"):
        assert async_runs[name]["turns"] == runs[name]["turns"], name
        assert async_runs[name]["pressure"] == runs[name]["pressure"], name


@pytest.fixture(scope="module")
def priority_runs(tmp_path_factory):
    return _run_both(tmp_path_factory, "0", "priority")


def test_priority_classes_come_first_then_next_turns(runs, priority_runs):
    """``--scheduling-policy priority`` (``X-Vllm-Priority``): four first turns of a higher class fill the engine
    first under either scheduler; then AgentScheduler admits the session's next turn ahead of the six first turns of
    its own class that arrived before it, where vLLM's default waits for them. Turn by turn the same cached tokens
    and greedy outputs as under FCFS; nothing stays allocated."""
    a, d = priority_runs["agent"]["priority"], priority_runs["default"]["priority"]
    for r in (a, d):
        assert max(r["higher_class"]) < min(r["first_turns"]) and max(r["higher_class"]) < r["next_turn"], r
    assert a["next_turn"] == min(a["first_turns"]), a  # in the first wave of its class
    assert sum(f < d["next_turn"] for f in d["first_turns"]) >= 4, d  # behind its class's earlier arrivals
    for name in ("agent", "default"):
        assert priority_runs[name]["turns"] == runs[name]["turns"], name
        assert priority_runs[name]["free_at_end"] == priority_runs[name]["free_at_start"], name


def test_the_session_priority_queue():
    """``SessionPriorityQueue`` and ``_continuations_first`` under the priority policy, on made-up requests: the
    priority class first, then next turns of sessions in HANDOFF, then arrival; a first turn of the best class that
    has waited HEAD_WAIT_S pauses the favouring (plain priority order) until it is admitted; a rank left over from a
    session that left HANDOFF is re-keyed; at most CONTINUATIONS_PER_STEP turns favoured."""
    import time
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    from qwen4exp.serving.scheduler import CONTINUATIONS_PER_STEP, HEAD_WAIT_S, AgentScheduler, SessionPriorityQueue

    class Sched:
        _is_continuation = AgentScheduler._is_continuation
        _waiting_rank = AgentScheduler._waiting_rank
        _continuations_first_by_priority = AgentScheduler._continuations_first_by_priority
        _continuations_first = AgentScheduler._continuations_first

    now = time.time()

    def req(rid, sid=None, priority=0, waited=0.0):
        return SimpleNamespace(request_id=rid, session_id=sid, priority=priority, arrival_time=now - waited,
                               status=RequestStatus.WAITING)

    def sched(reqs, handoff):
        s = Sched()
        s._favouring, s.sessions = True, SimpleNamespace(handoff=set(handoff))
        s.waiting = SessionPriorityQueue(s._waiting_rank)
        for r in reqs:
            s.waiting.add_request(r)
        return s

    def step(s):
        return [r.request_id for r in s._continuations_first()], [r.request_id for r in s.waiting]

    reqs = [req("f1", waited=0.5), req("lo", priority=1, waited=0.6), req("c1", "s1", waited=0.1),
            req("hi", priority=-1), req("c2", "s2", priority=1, waited=0.2), req("f2", waited=0.3)]
    s = sched(reqs, {"s1", "s2"})
    # a first turn of a better class at the front: no next turn is favoured (none is at the front) this step
    assert step(s) == ([], ["hi", "c1", "f1", "f2", "c2", "lo"])
    s.waiting.remove_request(s.waiting.peek_request())  # "hi" admitted
    assert step(s) == (["c1"], ["c1", "f1", "f2", "c2", "lo"])  # c2 is a next turn too, of a worse class
    s.sessions.handoff = {"s2"}  # s1's pin went (pressure): c1 is a plain first turn again, re-keyed
    assert step(s) == ([], ["f1", "f2", "c1", "c2", "lo"])
    assert len(s.waiting) == 5 and s.waiting.pop_request().request_id == "f1" and bool(s.waiting)

    stale = sched([req("f1", waited=HEAD_WAIT_S + 1), req("c1", "s1")], {"s1"})
    assert step(stale) == ([], ["f1", "c1"])  # a first turn waited too long: plain priority order
    stale.waiting.pop_request()
    assert step(stale) == (["c1"], ["c1"])  # admitted: favouring again
    # a stale first turn of a lower class does not pause the favouring of a better class
    assert step(sched([req("lo", priority=1, waited=HEAD_WAIT_S + 1), req("c1", "s1")], {"s1"}))[0] == ["c1"]

    many = sched([req("f1")] + [req(f"c{i}", f"s{i}") for i in range(CONTINUATIONS_PER_STEP + 2)],
                 {f"s{i}" for i in range(CONTINUATIONS_PER_STEP + 2)})
    fav, order = step(many)
    assert len(fav) == CONTINUATIONS_PER_STEP and order[:CONTINUATIONS_PER_STEP] == fav and order[-1] == "f1"
    late = req("late", "s9", waited=5.0)  # queued as a first turn, then its session turned out to hold a pin
    many.waiting.add_request(late)
    assert [r.request_id for r in many.waiting][-2:] == ["late", "f1"]  # a first turn: after the next turns
    many.sessions.handoff.add("s9")
    many.waiting.rekey(late)
    many.waiting.rekey(req("absent"))  # not queued: nothing happens
    assert [r.request_id for r in many.waiting][0] == "late" and len(many.waiting) == CONTINUATIONS_PER_STEP + 4
    many.waiting.remove_requests([r for r in many.waiting if r.request_id != "f1"])
    assert [r.request_id for r in many.waiting] == ["f1"] and many.waiting.peek_request().request_id == "f1"
    with pytest.raises(IndexError):
        SessionPriorityQueue(lambda r: 1).pop_request()


def checkpoint(n: int, block: int) -> int:
    """The last block boundary before a sequence's last token (whose KV is not computed yet)."""
    return (n - 1) // block * block


def test_agent_scheduler_class_ran(runs):
    import torch

    # CPU: vLLM schedules synchronously; CUDA: asynchronously, and AgentScheduler(...) builds its async variant
    asynchronous = torch.cuda.is_available()
    assert runs["default"]["scheduler"] == ("AsyncScheduler" if asynchronous else "Scheduler")
    assert runs["agent"]["scheduler"] == ("AsyncAgentScheduler" if asynchronous else "AgentScheduler")


def test_next_turn_reuses_the_previous_output(runs):
    a, d = runs["agent"]["turns"], runs["default"]["turns"]
    B = runs["agent"]["block_size"]
    assert B == runs["default"]["block_size"]
    for k in (1, 2):
        done = a[k - 1]["prompt"] + len(a[k - 1]["output"])  # turn k-1's tokens; its last output was never fed
        # the exact resume point: everything turn k-1 computed (not a block multiple: vLLM copies the partly filled
        # blocks on write); where async scheduling already fed the last sampled token, that one too
        assert done - 1 <= a[k]["cached"] <= done, (k, a[k]["cached"], done, B)
        assert a[k]["cached"] % B, (k, a[k]["cached"], B)  # (the partial-block path ran)
        assert d[k]["cached"] == checkpoint(a[k - 1]["prompt"], B), (k, d[k]["cached"])
        assert a[k]["cached"] > d[k]["cached"]
    assert runs["agent"]["exact_resumes"] >= 3  # turns 2 and 3, the pressure run's next turn
    for t_a, t_d in zip(a, d):
        assert t_a["output"] == t_d["output"] == t_a["output_on_a_miss"]  # greedy unchanged by scheduler and hit


def test_next_turn_under_mtp_finds_no_less_than_the_default(mtp_runs):
    """With MTP (3 drafts) the exact resume point is off (the state of the last accepted token moves between the
    speculative slots), and vLLM 0.32 drops the last matched block of the draft's EAGLE-type KV group from every
    hit, keeping a prompt's hybrid state a block back to match: a next turn then reaches at most one block below the
    last boundary turn N's K/V filled, where no decode checkpoint need exist (docs/performance.md). What holds:
    AgentScheduler's retention never finds less than the default, never more than turn N computed, and greedy
    outputs are the same with either scheduler and with a forced miss."""
    a, d = mtp_runs["agent"], mtp_runs["default"]
    assert a["prefix_caching"] and d["prefix_caching"]
    B = a["block_size"]
    assert B == d["block_size"]
    for k in (1, 2):
        prev = a["turns"][k - 1]
        done = prev["prompt"] + len(prev["output"])
        assert d["turns"][k]["cached"] <= checkpoint(prev["prompt"], B), (k, d["turns"][k]["cached"], B)
        assert d["turns"][k]["cached"] <= a["turns"][k]["cached"] <= done, (k, a["turns"][k]["cached"], done, B)
    print(f"MTP, block {B}: turn 2/3 cached {[t['cached'] for t in a['turns'][1:]]} (AgentScheduler) against "
          f"{[t['cached'] for t in d['turns'][1:]]} (default)")
    for t_a, t_d in zip(a["turns"], d["turns"]):
        assert t_a["output"] == t_d["output"] == t_a["output_on_a_miss"]


def test_pin_survives_traffic_between_turns(runs):
    a, d = runs["agent"]["pressure"], runs["default"]["pressure"]
    B = runs["agent"]["block_size"]
    assert d["next_turn_cached"] == 0  # the default let the other traffic evict the session's blocks
    assert 970 + 120 - 1 <= a["next_turn_cached"] <= 970 + 120  # the exact resume point (see above)


def test_pins_yield_to_a_request_that_needs_their_blocks(runs):
    a = runs["agent"]
    assert a["pinned_before_big"] > 0
    assert a["big_request_output_tokens"] == runs["default"]["big_request_output_tokens"] == 8
    assert a["sessions"]["released_pressure"] >= 1
    # what /metrics counts (qwen4exp.serving.metrics): each pin released under pressure is an eviction for "pressure"
    assert a["sessions"]["evictions"]["pressure"] == a["sessions"]["released_pressure"] + a["sessions"]["evicted_lru"]


def test_a_pinned_sessions_next_turn_goes_ahead_of_first_turns(runs):
    """Six first turns queued ahead of a session's next turn, four run at once: the default serves the continuation
    in arrival order (after a slot frees), AgentScheduler first (within its bounded window)."""
    a, d = runs["agent"]["admission"], runs["default"]["admission"]
    assert d["continuation_first_token_rank"] >= 4
    assert a["continuation_first_token_rank"] == 0
    assert a["continuation_first_token_step"] < d["continuation_first_token_step"]


@pytest.mark.parametrize("which", ["runs", "async_runs"])
def test_a_next_turn_does_not_wait_for_a_running_first_turns_prefill(which, request):
    """A session's next turn arrives while a first turn of nearly max_model_len is being prefilled two blocks a
    step: vLLM schedules running requests first, so under the default the next turn waits until that prefill is
    done; AgentScheduler caps the running prefill's chunk (one block here) in the steps where the next turn waits,
    and serves it at once. The next turn's new tokens straddle a block boundary, so vLLM admits it with part of its
    prefill left (a chunk starting mid-block ends at the boundary); that part runs first in the next step. The
    first turn still finishes, later by at most the steps it shared with the next turn; greedy outputs are the same
    either way. Scheduled asynchronously (GPUs; forced on CPU), a step's tokens come one engine step later."""
    runs = request.getfixturevalue(which)
    a, d = runs["agent"]["chunk"], runs["default"]["chunk"]
    ahead = runs["agent"]["scheduler"].startswith("Async")  # (one step planned ahead: outputs a step later)
    chunks = -(-a["long_prompt"] // a["step_budget"])
    if chunks < 4:
        pytest.skip(f"a block of {runs['agent']['block_size']} tokens leaves {chunks} two-block chunks within "
                    "max_model_len: too few for a prefill still running when the next turn arrives")
    why = f"agent's steps (request ids {a['ids']}): {a['trace']}"  # (what a failure on another machine needs)
    assert d["capped_steps"] == d["continued_steps"] == 0 and a["capped_steps"] >= 1, why
    # the previous turn ends just short of a block boundary: vLLM ends the next turn's first chunk there, and the
    # rest of its prefill runs first in the step after
    assert a["continued_steps"] >= 1, why
    assert d["next_turn_first_token_step"] >= chunks - 1  # behind the rest of the running prefill
    assert a["next_turn_first_token_step"] <= 2 + ahead, why
    assert a["next_turn_first_token_step"] < d["next_turn_first_token_step"]
    # the first turn is later by at most a step for each step it shared with the next turn (vLLM ends a hybrid
    # model's prefill chunk at a block boundary: beside even one decode token it gets one block of the two)
    ids = [[k.split("-")[0] for k in t["scheduled"]] for t in a["trace"]]
    shared = sum(set(a["ids"]) <= set(i) for i in ids)
    assert d["long_first_token_step"] <= a["long_first_token_step"] <= d["long_first_token_step"] + shared, why
    assert a["long_output"] == d["long_output"] and a["next_turn_output"] == d["next_turn_output"]


def test_the_step_cap_is_whole_blocks_and_never_chunks_the_waiting_turn(monkeypatch):
    """``_continuation_chunk`` on made-up turns: QWEN4EXP_CONTINUATION_CHUNK rounded down to whole blocks, at least
    one block, at least the largest favoured turn's tokens past what its session holds (the exact resume point, or
    the last block boundary of the finished turn without one); 0 when nothing is favoured or the switch is 0."""
    from types import SimpleNamespace

    from qwen4exp import envs
    from qwen4exp.serving.scheduler import AgentScheduler

    pins = {"exact": SimpleNamespace(resume=SimpleNamespace(tokens=5000), tokens=5001),
            "boundary": SimpleNamespace(resume=None, tokens=5000), "gone": None}
    s = SimpleNamespace(cache_config=SimpleNamespace(block_size=1568),
                        sessions=SimpleNamespace(pin_of=lambda sid: pins[sid]))

    def cap(*turns, chunk="2048"):
        monkeypatch.setenv("QWEN4EXP_CONTINUATION_CHUNK", chunk)
        envs.reset()
        return AgentScheduler._continuation_chunk(s, [SimpleNamespace(session_id=sid, num_tokens=n)
                                                      for sid, n in turns])

    try:
        assert cap() == 0
        assert cap(("exact", 5800)) == 1568  # 2048 -> one whole block; the turn's 800 new tokens fit
        assert cap(("exact", 5800), chunk="5000") == 4704
        assert cap(("exact", 5800), chunk="100") == 1568  # at least one block
        assert cap(("exact", 8000)) == 3000  # the turn's own 3,000 new tokens
        assert cap(("boundary", 7000)) == 7000 - 4704  # held: up to the finished turn's last block boundary
        assert cap(("exact", 5800), ("boundary", 7500)) == 7500 - 4704
        assert cap(("gone", 5800)) == 5800  # its pin went (pressure): the whole prompt, so no cap in effect
        assert cap(("exact", 5800), chunk="0") == 0
    finally:
        monkeypatch.delenv("QWEN4EXP_CONTINUATION_CHUNK")
        envs.reset()


def test_continuations_go_first_unless_a_first_turn_has_waited_too_long():
    """``_continuations_first`` and ``_continuations_running_first`` on made-up queues: waiting turns of sessions in
    HANDOFF move ahead of first turns (at most CONTINUATIONS_PER_STEP), not when a first turn at the head has waited
    HEAD_WAIT_S, still when the head that waited is such a turn itself; a favoured turn admitted with prefill left
    goes to the front of the running queue until its prompt is computed."""
    import time
    from types import SimpleNamespace

    from vllm.v1.core.sched.request_queue import FCFSRequestQueue
    from vllm.v1.request import RequestStatus

    from qwen4exp.serving.scheduler import CONTINUATIONS_PER_STEP, HEAD_WAIT_S, AgentScheduler

    class Req:  # (hashable, as vLLM's queue wants)
        def __init__(self, **kw):
            self.__dict__.update(kw)

    now = time.time()

    def req(rid, sid=None, waited=0.0, status=RequestStatus.WAITING, computed=0, prompt=100):
        return Req(request_id=rid, session_id=sid, arrival_time=now - waited, status=status,
                   num_computed_tokens=computed, num_prompt_tokens=prompt)

    def first(queue, handoff):
        s = SimpleNamespace(waiting=FCFSRequestQueue(queue), sessions=SimpleNamespace(handoff=set(handoff)))
        s._is_continuation = lambda r: AgentScheduler._is_continuation(s, r)
        favoured = AgentScheduler._continuations_first(s)
        return [r.request_id for r in favoured], [r.request_id for r in s.waiting]

    fresh = [req("f1"), req("f2"), req("c1", "s1"), req("x", "s9"), req("c2", "s2")]
    assert first(fresh, {"s1", "s2"}) == (["c1", "c2"], ["c1", "c2", "f1", "f2", "x"])
    assert first(fresh, set()) == ([], ["f1", "f2", "c1", "x", "c2"])
    stale = [req("f1", waited=HEAD_WAIT_S + 1), req("c1", "s1")]
    assert first(stale, {"s1"}) == ([], ["f1", "c1"])  # a first turn waited too long: FCFS
    stale = [req("c1", "s1", waited=HEAD_WAIT_S + 1), req("f1"), req("c2", "s2")]
    assert first(stale, {"s1", "s2"}) == (["c1", "c2"], ["c1", "c2", "f1"])  # the head is a next turn itself
    many = [req("f1")] + [req(f"c{i}", f"s{i}") for i in range(CONTINUATIONS_PER_STEP + 2)]
    fav, order = first(many, {f"s{i}" for i in range(CONTINUATIONS_PER_STEP + 2)})
    assert len(fav) == CONTINUATIONS_PER_STEP and order[:CONTINUATIONS_PER_STEP] == fav

    running = [req("long", status=RequestStatus.RUNNING, computed=512, prompt=2000),
               req("c1", "s1", status=RequestStatus.RUNNING, computed=90, prompt=100),
               req("c2", "s2", status=RequestStatus.RUNNING, computed=100, prompt=100)]
    s = SimpleNamespace(running=running, requests={r.request_id: r for r in running}, continued_steps=0,
                        _continuing={"c1", "c2", "gone"})
    AgentScheduler._continuations_running_first(s)
    assert [r.request_id for r in s.running] == ["c1", "long", "c2"] and s.running is running
    assert s._continuing == {"c1"} and s.continued_steps == 1  # c2's prompt is computed, "gone" went
    AgentScheduler._continuations_running_first(s)  # already in front: not counted again
    assert [r.request_id for r in s.running] == ["c1", "long", "c2"] and s.continued_steps == 1
    running[0].num_computed_tokens = 100
    AgentScheduler._continuations_running_first(s)
    assert s._continuing == set() and s.continued_steps == 1 and [r.request_id for r in s.running][0] == "c1"

    # which favoured turns a step leaves to run first: admitted (running), with at most a chunk's worth left
    s = SimpleNamespace(cache_config=SimpleNamespace(block_size=1568), _continuing=set())
    turns = [req("cut", "s1", status=RequestStatus.RUNNING, computed=50_000, prompt=50_500),
             req("lost", "s2", status=RequestStatus.RUNNING, computed=16_384, prompt=50_500),  # no cached prefix
             req("done", "s3", status=RequestStatus.RUNNING, computed=50_500, prompt=50_500),
             req("waits", "s4", computed=0, prompt=50_500)]
    AgentScheduler._track_continuing(s, turns)
    assert s._continuing == {"cut"}


@pytest.mark.parametrize("which", ["runs", "async_runs"])
def test_a_tool_pause_keeps_prefill_steps_short(which, request):
    """While a session's turn is held for its next turn, AgentScheduler plans no step with more than
    QWEN4EXP_PAUSE_CHUNK prefill tokens (one block here, against a step budget of three), so a next turn arriving
    mid-step waits for a short step; once nothing is held the full budget is back. The default plans full steps
    either way; greedy outputs are the same in all four runs, and nothing stays allocated."""
    runs = request.getfixturevalue(which)
    a, d, B = runs["agent"]["pause"], runs["default"]["pause"], runs["agent"]["block_size"]
    assert a["held_blocks"] > 0 and a["step_budget"] == 3 * B
    long_steps = -(-(2048 - 16) // B)
    assert max(a["held"]["step_tokens"]) <= B + 1, a["held"]["step_tokens"]  # one block + the lone decode slot
    assert sum(n == B for n in a["held"]["step_tokens"]) >= long_steps - 1
    assert a["paused_steps"] >= long_steps - 1 and d["paused_steps"] == 0
    for steps in (a["released"]["step_tokens"], d["held"]["step_tokens"], d["released"]["step_tokens"]):
        assert B + 1 < max(steps) <= 3 * B, steps
    assert a["held"]["output"] == a["released"]["output"] == d["held"]["output"] == d["released"]["output"]
    assert runs["agent"]["free_after_pause"] == runs["agent"]["free_at_start"]


def test_the_pause_budget(monkeypatch):
    """``_pause_budget`` on made-up schedulers: QWEN4EXP_PAUSE_CHUNK in whole blocks (at least one) plus every
    running request's decode slots (1 + MTP drafts), only while a session is held (RETAINED, or HANDOFF), with
    chunked prefill on, and where it is below vLLM's own budget; (0, 0) otherwise."""
    from types import SimpleNamespace

    from qwen4exp import envs
    from qwen4exp.serving.scheduler import AgentScheduler

    def budget(chunk="4096", retained=1, handoff=(), running=4, spec=0, chunked=True, most=16384):
        monkeypatch.setenv("QWEN4EXP_PAUSE_CHUNK", chunk)
        envs.reset()
        s = SimpleNamespace(cache_config=SimpleNamespace(block_size=1568), running=[None] * running,
                            num_spec_tokens=spec, max_num_scheduled_tokens=most,
                            scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked),
                            sessions=SimpleNamespace(retained_count=lambda: retained, handoff=set(handoff)))
        return AgentScheduler._pause_budget(s)

    try:
        assert budget() == (3136 + 4, 3136)  # 4,096 -> two whole blocks, + 4 decode slots
        assert budget(spec=3) == (3136 + 16, 3136)
        assert budget(chunk="100") == (1568 + 4, 1568)  # at least one block
        assert budget(retained=0, handoff={"s"}) == (3140, 3136)  # a next turn waiting for its held blocks
        assert budget(retained=0) == (0, 0)  # no session in a pause
        assert budget(chunk="0") == (0, 0)
        assert budget(chunked=False) == (0, 0)  # a prompt over the budget would never be admitted
        assert budget(most=3140) == (0, 0) and budget(most=3141) == (3140, 3136)  # only where it binds
    finally:
        monkeypatch.delenv("QWEN4EXP_PAUSE_CHUNK")
        envs.reset()


def test_close_and_abort_end_the_session_and_nothing_leaks(runs):
    a, d = runs["agent"], runs["default"]
    assert "s-close" not in a["states"] and "s-abort" not in a["states"]
    assert a["sessions"]["closed"] == 1 and a["sessions"]["aborted"] == 1
    assert a["sessions"]["handed_off"] >= 3  # each later turn took over its session's pin
    assert a["sessions"]["illegal_transitions"] == 0 and a["sessions"]["evictions"]["error"] == 0
    assert a["free_at_end"] == a["free_at_start"] - a["pinned_at_end"]
    assert a["free_after_release"] == a["free_at_start"] == d["free_at_end"] == d["free_at_start"]


def test_async_engines_get_the_async_variant():
    from types import SimpleNamespace

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from qwen4exp.serving.scheduler import AgentScheduler, AsyncAgentScheduler

    cfg = lambda a: SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=a))  # noqa: E731
    assert type(AgentScheduler.__new__(AgentScheduler, vllm_config=cfg(True))) is AsyncAgentScheduler
    assert type(AgentScheduler.__new__(AgentScheduler, vllm_config=cfg(False))) is AgentScheduler
    assert issubclass(AsyncAgentScheduler, AsyncScheduler) and issubclass(AsyncAgentScheduler, AgentScheduler)
    mro = AsyncAgentScheduler.__mro__
    assert mro.index(AgentScheduler) < mro.index(AsyncScheduler)  # our hooks wrap the async scheduler's
