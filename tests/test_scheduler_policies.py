"""``qwen4exp.serving.policies``: AgentScheduler's policies on their own, without vLLM or an engine (the adapter that
feeds them vLLM's state: ``qwen4exp.serving.scheduler``; its private touchpoints: tests/test_scheduler_contract.py).
Table-driven on small cases: checkpoint tracking and resume, retention, admission (continuation first, the chunk cap,
the pause budget, which admitted next turns run first) and victim order, with ties, zero budgets, a session closed
mid-turn and a resume after preemption."""

import itertools
import sys

import pytest

from qwen4exp.serving.policies import (ATTENTION, CONTINUATIONS_PER_STEP, HEAD_WAIT_S, OTHER, STATE_ALIGN, Admission,
                                       Admitted, Candidate, Checkpoint, CheckpointTracker, Freed, GroupBlocks, Queued,
                                       Resume, Retention, VictimOrder, exact_resume_supported, newest_cached,
                                       resume_groups, resume_in_reach, resume_matches)


def test_no_vllm_import():
    import subprocess

    code = ("import sys; import qwen4exp.serving.policies; "
            "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- checkpoint tracking -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("hashes, computed, want", [
    ([], 3, None),
    (["h0"], 0, None),  # nothing computed yet
    (["h0", "h1", "h2"], 3, 2),
    (["h0", "h1", "h2"], 2, 1),  # only computed blocks count
    (["h0", None, None], 3, 0),  # the newest cached one
    (["h0", "h1", None, None, None], 5, 1),
    (["h0", None, None, None, None, None], 6, None),  # further back than the lookback: not a checkpoint
    (["h0", None, None, None, None], 5, 0),  # the last block the search reaches (lookback + 1 from the end)
    (["h0", None, None, None, None, None], 2, None),  # (the lookback counts from the end of all the blocks)
    (["h0", None, None, None], 4, 0),
    ([None, None], 2, None),  # null placeholders only
])
def test_newest_cached(hashes, computed, want):
    assert newest_cached(hashes, computed) == want


def test_checkpoint_tracker_keeps_one_decode_checkpoint_a_request():
    t = CheckpointTracker()
    a, b, c, d = (object() for _ in range(4))
    prompt = Checkpoint(a, "ha", False)
    assert t.update("r", [prompt, None]) == []  # the prompt's checkpoint; the second group has none yet
    assert t.update("r", [None, None]) == []  # nothing new: kept
    d1 = Checkpoint(b, "hb", True)
    assert t.update("r", [d1, Checkpoint(c, "hc", True)]) == []  # the prompt's is vLLM's own: not evicted
    assert t.update("r", [Checkpoint(b, "hb", True), None]) == []  # the same block again: nothing replaced
    d2 = Checkpoint(d, "hd", True)
    assert t.update("r", [d2, None]) == [d1]  # a newer decode checkpoint replaces the one before
    assert "r" in t and len(t) == 1
    assert t.take("r") == [d2, Checkpoint(c, "hc", True)]
    assert "r" not in t and t.take("r") == []
    t.update("x", [prompt])
    t.drop("x")
    t.drop("never")  # (a request that never cached anything)
    assert len(t) == 0


def test_checkpoint_holds_only_its_own_state():
    c = Checkpoint(object(), "h", True)
    assert c.holds("h") and not c.holds(None) and not c.holds("other")


# --- the exact resume point ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kinds, state_groups, connector, want", [
    ([ATTENTION, STATE_ALIGN], 1, False, True),
    ([STATE_ALIGN], 1, False, True),
    ([ATTENTION, STATE_ALIGN], 0, False, False),  # no cached hybrid-state group
    ([ATTENTION, STATE_ALIGN], 1, True, False),  # a KV connector
    ([ATTENTION, OTHER], 1, False, False),  # e.g. MTP's speculative blocks, sliding window, caching off
    ([], 0, False, False),
])
def test_exact_resume_supported(kinds, state_groups, connector, want):
    assert exact_resume_supported(kinds, state_groups, connector) is want


NULL = "null"


def group(bs, state, blocks, null=()):
    return GroupBlocks(bs, state, blocks, [i in null for i in range(len(blocks))])


@pytest.mark.parametrize("tokens, groups, want", [
    (10, [group(4, False, ["a0", "a1", "a2", "a3"]), group(4, True, ["s0", "s1", "s2"], null={0, 1})],
     (("a0", "a1", "a2"), (NULL, NULL, "s2"))),
    (8, [group(4, False, ["a0", "a1", "a2"]), group(4, True, ["s0", "s1"], null={0})],
     (("a0", "a1"), (NULL, "s1"))),  # on a block boundary
    (1, [group(4, True, ["s0"])], (("s0",),)),
    (10, [group(4, False, ["a0", "a1"])], None),  # blocks missing
    (10, [group(4, False, ["a0", "a1", "a2"], null={1})], None),  # a null attention block (skipped by a window)
    (10, [group(4, True, ["s0", "s1", "s2"], null={2})], None),  # the state block is gone
    (10, [group(4, False, ["a0", "a1", "a2"]), group(8, True, ["s0", "s1"], null={0})],
     (("a0", "a1", "a2"), (NULL, "s1"))),  # groups of different block sizes
])
def test_resume_groups(tokens, groups, want):
    assert resume_groups(tokens, groups, NULL) == want


def resume(tokens=10, hashes=("h0", "h1"), tail=(7, 8), salt=None, lora=None, mm=()):
    return Resume(tokens, list(hashes), list(tail), (), salt, lora, mm)


@pytest.mark.parametrize("r, hit, num_tokens, bound, want", [
    (None, 0, 20, None, False),  # no pin (closed, expired, released under pressure)
    (resume(10), 0, 20, None, True),
    (resume(10), 10, 20, None, False),  # vLLM's own hit reaches as far
    (resume(10), 8, 20, None, True),
    (resume(10), 0, 11, None, True),  # leaves the last token to compute
    (resume(10), 0, 10, None, False),  # would leave nothing to compute
    (resume(10), 0, 20, 10, True), (resume(10), 0, 20, 9, False),  # vLLM's max_cache_hit_length
    (resume(10), 0, 20, 0, False),
])
def test_resume_in_reach(r, hit, num_tokens, bound, want):
    assert resume_in_reach(r, hit, num_tokens, bound) is want


@pytest.mark.parametrize("kw, want", [
    ({}, True),
    ({"salt": "x"}, False), ({"lora": 1}, False), ({"hashes": ["h0", "hX"]}, False), ({"hashes": ["h0"]}, False),
    ({"tail": [7, 9]}, False), ({"tail": [7]}, False), ({"mm": ((0, 4, "img"),)}, False),
])
def test_resume_matches(kw, want):
    args = {"salt": None, "lora": None, "hashes": ["h0", "h1"], "tail": [7, 8], "mm": ()} | kw
    assert resume_matches(resume(), args["salt"], args["lora"], args["hashes"], args["tail"], args["mm"]) is want


def test_resume_after_preemption_takes_the_next_turns_own_hit():
    """A next turn preempted after taking its session's blocks has them itself (the pin went at ALLOCATED): on
    readmission no resume point is offered (the session holds no pin) and vLLM's own lookup decides; a preempted
    request's computed tokens are lost (resume_in_reach is asked only for a turn with none computed)."""
    assert not resume_in_reach(None, 0, 20, None)
    # the same turn before its preemption: the resume point reached past vLLM's hit
    assert resume_in_reach(resume(10), 4, 20, None)


# --- retention -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("session, resumable, closed", list(itertools.product([False, True], repeat=3)))
def test_only_open_sessions_keep_blocks(session, resumable, closed):
    matter = Retention.session_matter(session=session, resumable=resumable, closed=closed)
    assert matter is (session and not resumable and not closed)
    for normal, closes, ttl, sole in itertools.product([False, True], [False, True], [0, 5.0], [False, True]):
        got = Retention.on_free(session=session, resumable=resumable, closed=closed, finished_normally=normal,
                                closes=closes, ttl=ttl, sole_active=sole)
        assert (got is Freed.PLAIN) is (not matter)


@pytest.mark.parametrize("normal, closes, ttl, sole, want", [
    (True, False, 10.0, True, Freed.PIN),
    (True, False, 10.0, False, Freed.UNPINNED),  # another turn of the session still runs (sub-agents)
    (True, False, 0, True, Freed.UNPINNED),  # retention off (TTL 0)
    (True, True, 10.0, True, Freed.CLOSE),  # session_close on the last turn
    (True, True, 10.0, False, Freed.CLOSE),
    (False, False, 10.0, True, Freed.ABORT),
    (False, True, 10.0, True, Freed.ABORT),  # an aborted closing turn is an abort
    (False, False, 0, False, Freed.ABORT),
])
def test_what_a_finished_session_turn_does(normal, closes, ttl, sole, want):
    assert Retention.on_end(finished_normally=normal, closes=closes, ttl=ttl, sole_active=sole) is want


def test_a_session_closed_mid_turn():
    """A session dropped while its turn runs (an event the state machine refused: it is CLOSED now): the turn's
    blocks go back as any request's, no pin, no event."""
    assert Retention.on_free(session=True, resumable=False, closed=True, finished_normally=True, closes=False,
                             ttl=10.0, sole_active=True) is Freed.PLAIN


@pytest.mark.parametrize("defer, fence, processed, now", [
    (False, 7, 0, True), (True, 0, 0, True), (True, 3, 3, True), (True, 4, 3, False), (True, 2, 3, True),
])
def test_release_waits_for_the_step_that_wrote_the_blocks(defer, fence, processed, now):
    assert Retention.release_now(defer, fence, processed) is now
    assert Retention.pin_fence(defer, 9) == (9 if defer else 0)


# --- admission: continuation first -------------------------------------------------------------------------------
NOW = 1000.0


def q(cont=False, waited=0.0, priority=0):
    return Queued(cont, NOW - waited, priority)


@pytest.mark.parametrize("queue, want", [
    ([], []),
    ([q(), q()], []),  # no next turn waits
    ([q(), q(True), q(), q(True)], [1, 3]),
    ([q(True), q(True)], [0, 1]),  # already in front
    ([q(waited=HEAD_WAIT_S + 1), q(True)], []),  # a first turn at the head waited too long: FCFS
    ([q(waited=HEAD_WAIT_S), q(True)], [1]),  # exactly HEAD_WAIT_S: not past it (a tie goes to the next turn)
    ([q(True, waited=HEAD_WAIT_S + 1), q(), q(True)], [0, 2]),  # the head that waited is a next turn itself
    ([q()] + [q(True)] * (CONTINUATIONS_PER_STEP + 2), list(range(1, CONTINUATIONS_PER_STEP + 1))),
])
def test_continuations_first_fcfs(queue, want):
    assert Admission().favoured_fcfs(queue, NOW) == want


def test_admission_limits():
    a = Admission(per_step=0)  # a zero budget: nothing favoured
    assert a.favoured_fcfs([q(True)], NOW) == [] and a.favoured_by_priority([q(True)], 0, True) == 0
    a = Admission(per_step=1, head_wait_s=0.0)
    assert a.favoured_fcfs([q(waited=0.1), q(True), q(True)], NOW) == []
    assert a.favoured_fcfs([q(), q(True), q(True)], NOW) == [1]  # waited 0 s: not past 0 s


@pytest.mark.parametrize("positions, moves", [([], False), ([0], False), ([0, 1], False), ([1], True),
                                              ([0, 2], True), ([1, 0], True)])
def test_moves(positions, moves):
    assert Admission.moves(positions) is moves


@pytest.mark.parametrize("queue, best, want", [
    ([], 0, True),
    ([q(True, waited=10)], 0, True),  # a next turn that waited does not pause favouring
    ([q(waited=HEAD_WAIT_S + 1)], 0, False),
    ([q(waited=HEAD_WAIT_S + 1, priority=1)], 0, True),  # a worse class's first turn does not either
    ([q(waited=HEAD_WAIT_S)], 0, True),
])
def test_favouring_under_priority(queue, best, want):
    assert Admission().favouring(queue, best, NOW) is want


@pytest.mark.parametrize("ordered, best, favouring, want", [
    ([q(True), q(True), q()], 0, True, 2),
    ([q(True), q(True)], 0, False, 0),  # favouring paused
    ([q(priority=-1), q(True)], -1, True, 0),  # a first turn of the best class in front
    ([q(True), q(True, priority=1)], 0, True, 1),  # a next turn of a worse class is not favoured
    ([q(True)] * (CONTINUATIONS_PER_STEP + 3), 0, True, CONTINUATIONS_PER_STEP),
    ([], 0, True, 0),
])
def test_favoured_by_priority(ordered, best, favouring, want):
    assert Admission().favoured_by_priority(ordered, best, favouring) == want


def test_favoured_by_priority_reads_the_queue_lazily():
    read = []

    def queue():
        for x in [q(True)] * 10:
            read.append(x)
            yield x

    assert Admission().favoured_by_priority(queue(), 0, True) == CONTINUATIONS_PER_STEP
    assert len(read) == CONTINUATIONS_PER_STEP


@pytest.mark.parametrize("favouring, cont, rank", [(True, True, 0), (True, False, 1), (False, True, 1),
                                                   (False, False, 1)])
def test_rank(favouring, cont, rank):
    assert Admission.rank(favouring, cont) == rank


# --- admission: which admitted next turns run first ----------------------------------------------------------------
def test_continuing_turns_run_first_until_their_prompt_is_computed():
    state = {"c1": Admitted(True, 10), "c2": Admitted(True, 0), "c3": Admitted(False, 10)}
    assert Admission.still_continuing({"c1", "c2", "c3", "gone"}, state) == {"c1"}
    assert Admission.still_continuing(set(), state) == set()
    assert Admission.running_order(["long", "c1", "x", "c2"], {"c1", "c2"}) == [1, 3, 0, 2]
    assert Admission.running_order(["c1", "long"], {"c1"}) == [0, 1]  # already in front
    assert Admission.running_order([], {"c1"}) == []
    favoured = {"cut": Admitted(True, 500), "lost": Admitted(True, 34_116), "done": Admitted(True, 0),
                "waits": Admitted(False, 50_500), "edge": Admitted(True, 2048)}
    assert Admission.newly_continuing(favoured, 2048) == {"cut", "edge"}
    assert Admission.newly_continuing(favoured, 0) == set()
    assert Admission.newly_continuing({}, 2048) == set()


# --- admission: the chunk cap --------------------------------------------------------------------------------------
@pytest.mark.parametrize("pinned, resume_tokens, pin_tokens, block, held", [
    (False, None, 0, 16, 0),  # the pin went (pressure): the whole prompt is new
    (True, 5000, 5001, 1568, 5000),  # the exact resume point
    (True, None, 5000, 1568, 4704),  # the finished turn's last block boundary
    (True, None, 15, 16, 0),
    (True, 0, 100, 16, 0),  # a resume point at 0 is still the resume point
])
def test_held_tokens(pinned, resume_tokens, pin_tokens, block, held):
    assert Admission.held_tokens(pinned, resume_tokens, pin_tokens, block) == held


@pytest.mark.parametrize("cap, block, new, want", [
    (2048, 1568, [], 0),  # nothing favoured
    (0, 1568, [800], 0),  # the switch off
    (-1, 1568, [800], 0),
    (2048, 1568, [800], 1568),  # whole blocks
    (5000, 1568, [800], 4704),
    (100, 1568, [800], 1568),  # at least one block
    (2048, 1568, [3000], 3000),  # at least the turn's own new tokens
    (2048, 1568, [800, 2796], 2796),
    (2048, 16, [-5], 2048),  # (a turn shorter than what is held)
    (16, 16, [16], 16),  # ties
])
def test_continuation_chunk(cap, block, new, want):
    assert Admission.continuation_chunk(cap, block, new) == want


@pytest.mark.parametrize("cap, budget, threshold, binds", [
    (0, 8192, 0, False), (2048, 8192, 0, True), (8192, 8192, 0, False), (9000, 8192, 0, False),
    (2048, 8192, 4096, True), (2048, 8192, 2048, False), (2048, 8192, 1024, False),
])
def test_cap_binds(cap, budget, threshold, binds):
    assert Admission.cap_binds(cap, budget, threshold) is binds


# --- admission: the pause budget -----------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk, paused, chunked, running, spec, most, want", [
    (4096, True, True, 4, 0, 16384, (3140, 3136)),
    (4096, True, True, 4, 3, 16384, (3152, 3136)),
    (100, True, True, 4, 0, 16384, (1572, 1568)),
    (4096, True, True, 0, 0, 16384, (3136, 3136)),  # no running request
    (4096, False, True, 4, 0, 16384, (0, 0)),  # no session in a tool pause
    (0, True, True, 4, 0, 16384, (0, 0)),  # the switch off
    (4096, True, False, 4, 0, 16384, (0, 0)),  # without chunked prefill
    (4096, True, True, 4, 0, 3140, (0, 0)),  # only where it binds (a tie does not)
    (4096, True, True, 4, 0, 3141, (3140, 3136)),
    (4096, True, True, 4, 0, 0, (0, 0)),
])
def test_pause_budget(chunk, paused, chunked, running, spec, most, want):
    assert Admission.pause_budget(chunk, 1568, paused=paused, chunked_prefill=chunked, running=running,
                                  spec_tokens=spec, step_budget=most) == want


# --- victim order --------------------------------------------------------------------------------------------------
def c(prompt, computed, preemptions=0, arrival=0.0, freeable=True):
    return Candidate(freeable, preemptions, prompt, computed, arrival)


def test_the_victim_goes_last():
    named = {"decode-long": c(100, 900, arrival=1), "prefill-small": c(800, 700, arrival=2),
             "decode-short": c(100, 120, arrival=3), "prefill-big": c(900, 100, arrival=4),
             "preempted-before": c(900, 0, preemptions=1, arrival=5),
             "in-flight": c(900, 10, arrival=6, freeable=False)}
    names = list(named)
    order = [names[i] for i in VictimOrder.order(list(named.values()))]
    assert order == ["in-flight", "preempted-before", "decode-long", "decode-short", "prefill-small", "prefill-big"]


@pytest.mark.parametrize("cands, victim", [
    ([c(100, 200, arrival=1), c(100, 200, arrival=2)], 1),  # a tie: the latest arrival
    ([c(100, 200, arrival=2), c(100, 200, arrival=1)], 0),
    ([c(100, 200, arrival=1), c(100, 200, arrival=1)], 1),  # a full tie: the stable order's last
    ([c(100, 50), c(100, 500)], 0),  # a prefill before a decode
    ([c(100, 100), c(100, 101)], 0),  # prompt exactly computed: a decode (the least computed goes)
    ([c(100, 0, preemptions=2), c(100, 0, preemptions=1)], 1),  # fewer preemptions go first
    ([c(100, 0, freeable=False), c(100, 0)], 1),
])
def test_victim_ties(cands, victim):
    assert VictimOrder.order(cands)[-1] == victim


@pytest.mark.parametrize("fcfs, n, applies", [(True, 0, False), (True, 1, False), (True, 2, True),
                                              (False, 5, False)])
def test_victim_order_applies(fcfs, n, applies):
    assert VictimOrder.applies(fcfs, n) is applies


def test_resumed_after_preemption_is_not_taken_again_first():
    """No ping-pong: a request readmitted after a preemption (counted in num_preemptions) stays over any request
    never preempted, whatever their progress."""
    for prompt, computed in itertools.product([10, 100], [0, 50, 200]):
        order = VictimOrder.order([c(100, 0, preemptions=1, arrival=9), c(prompt, computed, arrival=0)])
        assert order[-1] == 1
