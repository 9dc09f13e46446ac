"""``qwen4exp-serve``'s CPU defaults (``qwen4exp.serve.cpu_env``): what it fills in, and what it leaves to the user;
its request guard (bodies, the ``X-Session-Close`` header) and the session close route, without a server."""

import json
import os

import pytest

from qwen4exp import serve


def test_threads_split_into_contiguous_core_groups():
    assert serve.cpu_threads_bind(2, [0, 1]) == "0|1"
    assert serve.cpu_threads_bind(2, [4, 5, 6, 7, 8]) == "4,5|6,7"  # the fifth core goes unused
    with pytest.raises(ValueError, match="3 CPU workers need at least 3 cores, 2 allowed"):
        serve.cpu_threads_bind(3, [0, 1])


@pytest.mark.parametrize("args,want", [([], 1), (["--tensor-parallel-size", "2"], 2), (["-tp=4"], 4),
                                       (["-tp", "2", "--tensor-parallel-size=3"], 3)])
def test_parallel_size_read_from_the_command_line(args, want):
    assert serve._arg_int(args, ("--tensor-parallel-size", "-tp")) == want


def test_bad_parallel_size_names_the_flag():
    with pytest.raises(SystemExit, match=r"--tensor-parallel-size needs an integer, got 'two'"):
        serve._arg_int(["--tensor-parallel-size", "two"], ("--tensor-parallel-size", "-tp"))


@pytest.mark.vllm
def test_cpu_env_binds_ranks_beyond_the_numa_nodes(tmp_path):
    """More workers than NUMA nodes: the binding is filled in (or, with fewer cores than workers, a clear error); a
    user's own binding is kept; one worker needs none."""
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    ranks = len(get_visible_memory_node()) + 1
    base = dict(QWEN4EXP_CACHE_DIR=str(tmp_path))
    args = ["m", "--tensor-parallel-size", str(ranks)]
    if len(os.sched_getaffinity(0)) >= ranks:
        env = serve.cpu_env(args, dict(base))
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == serve.cpu_threads_bind(ranks)
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    else:
        with pytest.raises(ValueError, match=f"{ranks} CPU workers need at least {ranks} cores"):
            serve.cpu_env(args, dict(base))
    kept = serve.cpu_env(args, dict(base, VLLM_CPU_OMP_THREADS_BIND="0-1|2-3"))
    assert kept["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in serve.cpu_env(["m"], dict(base))


@pytest.mark.parametrize("args,host", [(["m"], "127.0.0.1"), (["m", "--port", "8000"], "127.0.0.1"),
                                       (["m", "--host", "0.0.0.0"], "0.0.0.0"), (["m", "--host=::"], "::")])
def test_vllm_argv_binds_localhost_unless_host_given(args, host):
    argv = serve.vllm_argv(args)
    assert argv[:2] == ["vllm", "serve"] and argv[2:2 + len(args)] == args
    hosts = [a for a in argv if a == "--host" or a.startswith("--host=")]
    assert len(hosts) == 1 and serve._arg(argv, ("--host",))[1] == host
    assert argv[-2:] == ["--middleware", serve.GUARD]


def test_request_body_guard():
    bad = serve.check_request_body("/v1/completions", b'{"prompt": "\xff"}')
    assert bad is not None and bad[1] == "body" and "byte 12" in bad[0]
    assert serve.check_request_body("/v1/chat/completions", b'{"messages": []}')[1] == "messages"
    assert serve.check_request_body("/v1/chat/completions", '{"messages": [{"role": "user", "content": "é"}]}'
                                    .encode()) is None
    assert serve.check_request_body("/v1/completions", b'{"messages": []}') is None  # (chat requests only)
    assert serve.check_request_body("/v1/chat/completions", b'{"messages": ') is None  # vLLM names the JSON error


def test_request_guard_replays_the_body_and_answers_bad_ones():
    import asyncio
    import json

    seen = {}

    async def app(scope, receive, send):
        msg = await receive()
        seen["body"] = msg["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def call(body: bytes, path="/v1/chat/completions"):
        parts = [body[:5], body[5:]]
        sent = []

        async def receive():
            p = parts.pop(0)
            return {"type": "http.request", "body": p, "more_body": bool(parts)}

        async def send(m):
            sent.append(m)

        asyncio.run(serve.RequestGuard(app)({"type": "http", "method": "POST", "path": path}, receive, send))
        return sent

    good = b'{"messages": [{"role": "user", "content": "hi"}]}'
    sent = call(good)
    assert seen["body"] == good and sent[0]["status"] == 200
    seen.clear()
    sent = call(b'{"messages": []}')
    assert "body" not in seen and sent[0]["status"] == 400
    err = json.loads(sent[1]["body"])["error"]
    assert err["param"] == "messages" and err["code"] == 400 and err["type"] == "BadRequestError"


def test_serve_checks_the_model_dir_first(tmp_path, capsys):
    import json
    import shutil

    from qwen4exp.demo import ASSET

    d = tmp_path / "m"
    shutil.copytree(ASSET, d)
    serve.check_model_dir([str(d), "--port", "1"])  # intact: returns
    cfg = json.loads((d / "config.json").read_text())
    cfg["layer_types"] = cfg["layer_types"][:2]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        serve.check_model_dir([str(d)])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`layer_types`: has 2 entries but num_hidden_layers is 4" in err
    serve.check_model_dir(["Qwen/not-a-local-dir"])  # a hub id: left to vLLM


H = [(b"content-type", b"application/json"), (b"x-session-id", b"s1")]


@pytest.mark.parametrize("path", serve.SESSION_PATHS)
@pytest.mark.parametrize("value", ["1", "true", "Yes"])
def test_session_close_header_becomes_the_body_field(path, value):
    body = b'{"prompt": "x", "vllm_xargs": {"top_k_extra": 3}}'
    new, bad = serve.session_close(path, H + [(b"X-Session-Close", value.encode())], body)
    assert bad is None and json.loads(new) == {"prompt": "x", "vllm_xargs": {"top_k_extra": 3, "session_close": True}}
    # the session id from the body instead of the header
    new, bad = serve.session_close(path, [(b"x-session-close", b"1")], b'{"session_id": "s2"}')
    assert bad is None and json.loads(new)["vllm_xargs"] == {"session_close": True}


def test_session_close_header_left_alone_or_refused():
    close = [(b"x-session-close", b"1")]
    assert serve.session_close("/v1/completions", H, b'{"prompt": "x"}') == (None, None)  # no header: untouched
    assert serve.session_close("/v1/completions", H + [(b"x-session-close", b"0")], b"{}") == (None, None)
    assert serve.session_close("/v1/embeddings", H + close, b"{}") == (None, None)  # not a session request
    assert serve.session_close("/v1/completions", H + close, b'{"prompt": ') == (None, None)  # vLLM names it
    # the body field alone goes on as it is (AgentScheduler reads it)
    assert serve.session_close("/v1/completions", H, b'{"vllm_xargs": {"session_close": true}}') == (None, None)
    _, bad = serve.session_close("/v1/chat/completions", H + [(b"x-session-close", b"maybe")], b"{}")
    assert bad[1] == "X-Session-Close" and "got 'maybe'" in bad[0] and "true, 1, yes" in bad[0]
    _, bad = serve.session_close("/v1/chat/completions", H + [(b"x-session-close", b"")], b"{}")
    assert bad[1] == "X-Session-Close"
    _, bad = serve.session_close("/v1/completions", close, b'{"prompt": "x"}')  # no session id anywhere
    assert bad[1] == "X-Session-Close" and "needs a session id" in bad[0]
    _, bad = serve.session_close("/v1/completions", H, b'{"vllm_xargs": {"session_close": "nah"}}')
    assert bad[1] == "vllm_xargs.session_close" and "got 'nah'" in bad[0]


def test_request_guard_forwards_the_close_header_in_the_body():
    import asyncio

    seen = {}

    async def app(scope, receive, send):
        seen["body"], seen["headers"] = (await receive())["body"], dict(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    def call(headers, body=b'{"prompt": "hi"}'):
        sent = []

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(m):
            sent.append(m)

        headers = headers + [(b"content-length", str(len(body)).encode())]
        asyncio.run(serve.RequestGuard(app)({"type": "http", "method": "POST", "path": "/v1/completions",
                                             "headers": headers}, receive, send))
        return sent

    assert call(H + [(b"x-session-close", b"1")])[0]["status"] == 200
    assert json.loads(seen["body"])["vllm_xargs"] == {"session_close": True}
    assert int(seen["headers"][b"content-length"]) == len(seen["body"])
    seen.clear()
    sent = call(H + [(b"x-session-close", b"2")])
    assert not seen and sent[0]["status"] == 400 and json.loads(sent[1]["body"])["error"]["param"] == "X-Session-Close"


@pytest.mark.vllm
def test_close_endpoint_answers(monkeypatch):
    """The route the guard adds to vLLM's app, against a stand-in engine client: released, nothing held (unknown),
    a turn in flight (409, nothing done), and no AgentScheduler (404), each a JSON answer."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from qwen4exp.serving.scheduler import CLOSE_UTILITY

    calls, answers = [], {}

    async def call_utility_all_async(method, *args):
        calls.append((method, *args))
        return answers[args[0]]

    app = FastAPI()
    app.add_middleware(serve.RequestGuard)
    core = SimpleNamespace(client_index=3, call_utility_all_async=call_utility_all_async)
    agent = SimpleNamespace(scheduler_config=SimpleNamespace(scheduler_cls="qwen4exp.serving.scheduler.AgentScheduler"))
    app.state.engine_client = SimpleNamespace(vllm_config=agent, engine_core=core)
    closed = dict(state="unknown", released=False, released_blocks=0, turns_in_flight=0)
    answers["kept"] = [dict(state="retained", released=True, released_blocks=7, turns_in_flight=0)]
    answers["gone"] = [closed]
    answers["busy"] = [dict(closed, state="active", turns_in_flight=1)]
    answers["a/b c"] = [dict(state="retained", released=True, released_blocks=2, turns_in_flight=0), closed]  # DP=2
    client = TestClient(app)
    r = client.post("/v1/sessions/kept/close")
    assert r.status_code == 200 and r.json() == {"session_id": "kept", "released": True, "released_blocks": 7,
                                                 "previous_state": "retained"}
    assert calls == [(CLOSE_UTILITY, "kept", 3)]
    r = client.post("/v1/sessions/gone/close")
    assert r.status_code == 200 and r.json()["released"] is False and "holds no retained state" in r.json()["message"]
    assert r.json()["previous_state"] == "unknown" and "never seen" in r.json()["message"]
    r = client.post("/v1/sessions/busy/close")
    assert r.status_code == 409 and "1 turn(s) running or waiting" in r.json()["error"]["message"]
    r = client.post("/v1/sessions/a%2Fb%20c/close")
    assert r.status_code == 200 and r.json()["session_id"] == "a/b c" and r.json()["released_blocks"] == 2
    agent.scheduler_config.scheduler_cls = None
    n = len(calls)
    r = client.post("/v1/sessions/kept/close")
    assert r.status_code == 404 and "--scheduler-cls qwen4exp.serving.scheduler.AgentScheduler" in r.json()["error"][
        "message"] and len(calls) == n  # answered without asking the engine


@pytest.mark.vllm
def test_close_endpoint_is_behind_vllms_api_key():
    """vLLM adds its auth middleware before ours (ours is outermost): the route, on the app's router, is reached only
    through it."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    app = FastAPI()
    app.add_middleware(AuthenticationMiddleware, tokens=["k"])
    app.add_middleware(serve.RequestGuard)
    client = TestClient(app)
    assert client.post("/v1/sessions/s/close").status_code == 401
    r = client.post("/v1/sessions/s/close", headers={"Authorization": "Bearer k"})
    assert r.status_code == 404 and "--scheduler-cls" in r.json()["error"]["message"]  # (no engine client here)
