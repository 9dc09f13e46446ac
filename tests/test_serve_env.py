"""``qwen4exp-serve``'s CPU defaults (``qwen4exp.serve.cpu_env``): what it fills in, and what it leaves to the user."""

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
