"""AgentScheduler's preemption victims (issue 27 item 4).

* ``_order_victims`` on made-up running lists: vLLM (FCFS) preempts ``running[-1]``, so the requests after the one
  being scheduled are ordered with the victim last: blocks that can be freed before ones an async step still holds,
  never-preempted before preempted-before (no ping-pong), unfinished prefills (largest remainder first) before
  decodes (least computed first), later arrivals first; nothing before the request moves; under the priority policy
  nothing moves at all.
* An engine run (``tests/preempt_turns.py``: ten requests, a KV cache of 28 blocks, CPU float32) under vLLM's default
  scheduler and AgentScheduler: both preempt, AgentScheduler throws away fewer computed tokens, and every greedy
  output equals the output of a run with room for all (200 blocks, no preemption).
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def req(name, prompt, computed, preemptions=0, arrival=0.0, freeable=True):
    return SimpleNamespace(name=name, num_prompt_tokens=prompt, num_computed_tokens=computed,
                           num_preemptions=preemptions, arrival_time=arrival, freeable=freeable)


def fake_scheduler(running, policy=None):
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    from qwen4exp.serving.scheduler import AgentScheduler

    s = SimpleNamespace(running=running, policy=policy or SchedulingPolicy.FCFS,
                        _request_blocks_can_be_freed=lambda r: r.freeable)
    s._victim_order = lambda r: AgentScheduler._victim_order(s, r)
    return s, lambda r: AgentScheduler._order_victims(s, r)


def names(running):
    return [r.name for r in running]


@pytest.mark.vllm
def test_the_victim_goes_last_and_nothing_before_the_request_moves():
    head, cur = req("head", 100, 150), req("cur", 100, 300)
    tail = [req("decode-long", 100, 900, arrival=1), req("prefill-small", 800, 700, arrival=2),
            req("decode-short", 100, 120, arrival=3), req("prefill-big", 900, 100, arrival=4),
            req("preempted-before", 900, 0, preemptions=1, arrival=5), req("in-flight", 900, 10, arrival=6,
                                                                                freeable=False)]
    running = [head, cur, *tail]
    s, order = fake_scheduler(running)
    order(cur)
    assert running is s.running
    assert names(running) == ["head", "cur", "in-flight", "preempted-before", "decode-long", "decode-short",
                              "prefill-small", "prefill-big"]
    order(tail[0])  # a request not in the running list (a waiting one being admitted): nothing moves
    order(req("waiting", 10, 0))
    assert names(running)[-1] == "prefill-big"


@pytest.mark.vllm
def test_ties_go_to_the_latest_arrival_and_priority_policy_is_left_alone():
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    cur = req("cur", 10, 20)
    running = [cur, req("late", 100, 50, arrival=9), req("early", 100, 50, arrival=1)]
    s, order = fake_scheduler(running)
    order(cur)
    assert names(running) == ["cur", "early", "late"]
    running = [cur, req("a", 900, 0), req("b", 100, 500)]
    s, order = fake_scheduler(running, SchedulingPolicy.PRIORITY)
    order(cur)
    assert names(running) == ["cur", "a", "b"]  # vLLM's priority rule picks among all running requests itself


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, cls, blocks in (("default", "default", 28), ("agent", "qwen4exp.serving.scheduler.AgentScheduler", 28),
                              ("room", "default", 200)):
        work = tmp_path_factory.mktemp(name)
        env = dict(os.environ, TMPDIR=str(work), QWEN4EXP_CACHE_DIR=str(work / "cache"))
        p = subprocess.run([sys.executable, os.path.join(HERE, "preempt_turns.py"), cls, str(blocks),
                            str(work / "r.json")], env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-6000:]
        out[name] = json.loads((work / "r.json").read_text())
    return out


@pytest.mark.vllm
def test_cost_ordered_victims_throw_away_less_and_outputs_stay(runs):
    d, a, room = runs["default"], runs["agent"], runs["room"]
    assert a["scheduler"] == "AgentScheduler" and d["scheduler"] == "Scheduler"
    assert not room["preemptions"]
    assert d["preemptions"] and a["preemptions"]
    assert a["lost_tokens"] < d["lost_tokens"], (a["preemptions"], d["preemptions"])
    assert a["counted"] == a["lost_tokens"]  # the scheduler's own count (preempted_tokens) of what it threw away
    assert a["outputs"] == room["outputs"] and d["outputs"] == room["outputs"]
