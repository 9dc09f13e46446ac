"""Errors a person can act on, in one line (issue item): each case as a user meets it.

* ``qwen4exp-serve /no/such/dir`` (and ``make serve MODEL=...``): exit status 1 within seconds, one line on stderr
  naming the path, before vLLM is imported (was: a 76-line "Repo id must be in the form" traceback after 9.5 s);
* ``Qwen4ExpForCausalLM.from_pretrained("no/such/dir")`` (and the composite class): a one-line
  ``FileNotFoundError`` naming the path;
* against one served tiny-coder (multiprocess ``qwen4exp-serve``): a malformed JSON body, a body nested 10,000 deep
  (was: HTTP 500), an empty or 20 kB ``X-Session-ID`` (was: accepted) and a header that disagrees with the body's
  ``session_id`` (was: the body won silently) each get a 400 with one line naming the body or the header; a normal
  chat request (plain and streamed) right after it gets 200.
"""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from qwen4exp import serve
from qwen4exp.demo import ASSET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSING = "/no/such/dir"
CHAT = "/v1/chat/completions"
OK_CHAT = dict(model="tiny-coder", messages=[{"role": "user", "content": "Write a Python function."}], max_tokens=3,
               temperature=0)


# -- a checkpoint path that does not exist ----------------------------------------------------------------------------
def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def _run(cmd, **kw):
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, **kw)
    return p, time.monotonic() - t0


def test_serve_missing_path_exits_with_one_line():
    exe = os.path.join(os.path.dirname(sys.executable), "qwen4exp-serve")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "qwen4exp.serve"]
    p, dt = _run([*cmd, MISSING, "--port", "8123"])
    assert p.returncode == 1 and not p.stdout, (p.returncode, p.stdout)
    line = _one_line(p.stderr)
    assert line.startswith("qwen4exp-serve: no checkpoint directory at '/no/such/dir'") and len(line) < 200, line
    assert dt < 10, dt
    # --model, a relative path: the same, and nothing of vLLM (or torch) was imported on the way
    code = ("import sys\nfrom qwen4exp.serve import main\ntry:\n    main(sys.argv[1:])\nfinally:\n"
            "    assert not {'vllm', 'torch'} & set(sys.modules), 'imported'\n")
    p, dt = _run([sys.executable, "-c", code, "--model", "./no-such-ckpt"])
    assert p.returncode == 1, p.stderr
    assert "no checkpoint directory at './no-such-ckpt' (resolved: " in _one_line(p.stderr), p.stderr


def test_serve_missing_path_rule():
    """What counts as missing: a path that cannot be a Hub id; ``org/name`` and ``name`` go on to vLLM."""
    from qwen4exp.checkpoint import missing_checkpoint

    for path in (MISSING, "./x", "../x", "~/no-such-qwen4exp", "no/such/dir", "a--b/c", "with space/x"):
        assert missing_checkpoint(path, hub=True) is not None, path
    for path in ("Qwen/Some-Model-1.5B", "gpt2", ASSET, os.path.join(ASSET, "config.json")):
        assert missing_checkpoint(path, hub=True) is None, path


def test_make_serve_missing_model_one_line():
    p, dt = _run(["make", "-s", "-o", ".venv/.stamp", "serve", f"VPY={sys.executable}", f"MODEL={MISSING}"])
    assert p.returncode != 0 and dt < 10, (p.returncode, dt)
    ours = [line for line in p.stderr.splitlines() if not line.startswith("make")]  # (and make's "Error 1")
    assert len(ours) == 1 and ours[0].startswith("qwen4exp.demo: no checkpoint directory at '/no/such/dir'"), p.stderr
    assert "Traceback" not in p.stderr + p.stdout


@pytest.mark.parametrize("cls", ["Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"])
def test_hf_loader_missing_path(cls):
    import qwen4exp
    from qwen4exp.checkpoint import CheckpointError

    model_cls = getattr(qwen4exp, cls)
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError) as e:
        model_cls.from_pretrained("no/such/dir")
    assert time.monotonic() - t0 < 2
    assert isinstance(e.value, CheckpointError)  # (and a ValueError, as every checkpoint error)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("qwen4exp: no checkpoint directory at 'no/such/dir'"), msg
    with pytest.raises(FileNotFoundError, match=r"download it first \(hf download Qwen/Foo --local-dir DIR\)"):
        model_cls.from_pretrained("Qwen/Foo")  # a Hub id: from_pretrained reads local directories only


# -- the request checks, on their own ---------------------------------------------------------------------------------
def nested(depth: int) -> bytes:
    return ('{"model": "tiny-coder", "x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}").encode()


def test_json_body_checks():
    J = [(b"content-type", b"application/json")]
    bad, data = serve.check_json_body(J, b'{"model": "m", "messages": [')
    assert bad[1] == "body" and "JSON decode error at line 1, column 29" in bad[0]
    assert serve.check_json_body(J, nested(serve.MAX_JSON_DEPTH))[0] is None  # the bound itself passes
    for depth in (serve.MAX_JSON_DEPTH + 1, 10_000):
        bad, _ = serve.check_json_body(J, nested(depth))
        assert bad[1] == "body" and f"nested more than {serve.MAX_JSON_DEPTH} levels" in bad[0], depth
    assert serve.check_json_body([(b"content-type", b"multipart/form-data; boundary=x")], b"{")[0] is None
    assert serve.check_json_body([], b'{"a": 1}') == (None, {"a": 1})  # no content type: JSON, as FastAPI reads it
    assert serve.check_request_body(CHAT, b"  ") == ("request body is empty: send the request as a JSON object", "body")


def test_session_id_checks():
    def check(headers=(), body=None, path=CHAT):
        return serve.check_session_ids(path, [(k.encode(), v.encode("latin-1")) for k, v in headers], body or {})

    H = "X-Session-ID"
    assert check([(H, "a" * 256)], {"session_id": "a" * 256}) is None
    assert check([(H, "conv 7/turn:1")]) is None and check(body={"vllm_xargs": {"session_id": "s"}}) is None
    for value, why in (("", "is empty"), ("   ", "all spaces"), ("a" * 257, "257 characters long"),
                       ("caf\xe9", "holds 'é' at position 3")):
        msg, field = check([(H, value)])
        assert field == H and why in msg and "1 to 256 printable ASCII" in msg, msg
    msg, field = check(body={"session_id": ""})
    assert field == "session_id" and "is empty" in msg
    msg, field = check(body={"vllm_xargs": {"session_id": 5}})
    assert field == "vllm_xargs.session_id" and "not a string" in msg
    msg, field = check([(H, "a")], {"session_id": "b"})
    assert field == H and "X-Session-ID header 'a' and the body's session_id 'b' disagree" in msg, msg
    msg, field = check(body={"session_id": "a", "vllm_xargs": {"session_id": "b"}})
    assert field == "session_id" and "disagree" in msg
    msg, field = check([(H, "a"), (H, "b")])
    assert field == H and "given 2 times" in msg
    assert check([(H, "")], path="/v1/embeddings") is None  # (no session on that route)


# -- against a served tiny-coder --------------------------------------------------------------------------------------
def send(base, path, body, headers=None, timeout=120):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from served import serve as served

    with served(ASSET, tmp_path_factory.mktemp("user_errors"), "--max-model-len", "256", "--enforce-eager",
                "--dtype", "bfloat16", "--max-num-seqs", "4", name="tiny-coder") as s:
        yield s


BAD = {  # name: (body, headers, the field the error names, text in the message)
    "malformed_json": (b'{"model": "tiny-coder", "messages": [', {}, "body",
                       "request body is not valid JSON (JSON decode error at line 1, column 38: expecting value)"),
    "nested_10000_deep": (b'{"model": "tiny-coder", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", {}, "body",
                          "request body is JSON nested more than 128 levels deep"),
    "empty_session_header": (OK_CHAT, {"X-Session-ID": ""}, "X-Session-ID", "X-Session-ID header is empty: a session "
                             "id is 1 to 256 printable ASCII characters"),
    "20kB_session_header": (OK_CHAT, {"X-Session-ID": "s" * 20_000}, "X-Session-ID",
                            "X-Session-ID header is 20000 characters long"),
    "header_and_body_disagree": (dict(OK_CHAT, session_id="body-id"), {"X-Session-ID": "header-id"}, "X-Session-ID",
                                 "the X-Session-ID header 'header-id' and the body's session_id 'body-id' disagree"),
}


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_one_line_then_serving_on(server, case):
    body, headers, field, text = BAD[case]
    base = server["base"]
    status, raw = send(base, CHAT, body, headers)
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["param"] == field, err
    assert text in err["message"] and "\n" not in err["message"] and len(err["message"]) < 300, err
    assert server["proc"].poll() is None
    status, raw = send(base, CHAT, OK_CHAT)
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3, raw


@pytest.mark.vllm
def test_session_requests_still_served(server):
    """A valid X-Session-ID, the same id in the body, and a streamed chat with the header: served."""
    base = server["base"]
    status, raw = send(base, CHAT, dict(OK_CHAT, session_id="conv-1"), {"X-Session-ID": "conv-1"})
    assert status == 200, raw
    status, raw = send(base, CHAT, dict(OK_CHAT, stream=True), {"X-Session-ID": "conv 2/turn:1"})
    chunks = [json.loads(x[5:]) for x in raw.splitlines() if x.startswith("data:") and x.strip() != "data: [DONE]"]
    assert status == 200 and raw.rstrip().endswith("data: [DONE]"), raw
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Traceback" not in server["log"].read_text()
