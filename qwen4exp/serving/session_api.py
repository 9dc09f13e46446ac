"""``POST /v1/sessions/{session_id}/close`` on ``qwen4exp-serve``: release an idle agent session's retained state now.

``AgentScheduler`` (``qwen4exp.serving.scheduler``) runs in the engine-core process; this route runs in the API server.
The close travels as a vLLM engine-core *utility call* (``call_utility_all_async``, the channel of
``/reset_prefix_cache``): the engine core runs it in its busy loop between steps, so it never races a step and leaves
running requests alone. Every engine core is asked (several with ``--data-parallel-size``, whose load balancer may
have put a session's turns on any of them); their answers are summed.

Answers (JSON):

* 200 ``{"session_id", "released": true, "released_blocks": N, "previous_state": "retained"}``: the session's pin
  was released (its blocks go back to the pool as plain cached blocks; the next turn is a first turn);
* 200 ``{..., "released": false, "previous_state": "unknown", "message"}``: this server holds nothing for the
  session (never seen, or ended: already closed, or its pin went at TTL or under memory pressure; an ended session's
  record goes, so the two cannot be told apart);
* 409 (vLLM's error shape): the session has a turn running or waiting; nothing is done (put ``X-Session-Close: 1``
  on the last turn, or close after it ends);
* 404: the server does not run ``--scheduler-cls qwen4exp.serving.scheduler.AgentScheduler``;
* 400: the path's session id is no valid one (``qwen4exp.serving.sessions.session_id_problem``: 1 to 256 printable
  ASCII characters, not all spaces; URL-decoded).

The route is added to vLLM's FastAPI app (``install``, once per app) by either of:

* ``SessionClosePlugin``, this package's ``vllm.endpoint_plugins`` entry point (``qwen4exp``): plain ``vllm serve``
  loads it when ``VLLM_PLUGINS`` names it (vLLM 0.32 loads endpoint plugins only on that explicit allowlist, which
  then also applies to the other plugin groups: ``VLLM_PLUGINS=qwen4exp`` keeps the model plugin and the stat logger,
  both named ``qwen4exp`` too); vLLM's ``build_app`` attaches it after its own routers, in every API-server process;
* ``qwen4exp.serve.RequestGuard``, the middleware ``qwen4exp-serve`` installs, at the first request, where the
  plugin did not add it already (so ``qwen4exp-serve`` has the route with or without ``VLLM_PLUGINS``).

Either way it sits behind vLLM's own middleware: ``--api-key`` guards it like any ``/v1/`` route.
"""

import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response

AGENT_SCHEDULER = "qwen4exp.serving.scheduler.AgentScheduler"
CLOSE_PATH = "/v1/sessions/{session_id:path}/close"


def error_body(status: int, message: str, param: str | None, kind: str = "BadRequestError") -> bytes:
    """vLLM's OpenAI error body (``ErrorResponse``); also ``qwen4exp.serve.RequestGuard``'s 400s."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


def _error(status: int, message: str, kind: str) -> Response:
    return Response(error_body(status, message, None, kind), status_code=status, media_type="application/json")


def combine(session_id: str, results: list[dict]) -> tuple[int, dict]:
    """(HTTP status, body) from the engines' ``close_session`` answers (``Sessions.close``)."""
    if not results or any("state" not in r for r in results):
        return 404, {"message": f"no agent sessions on this server: session close needs --scheduler-cls "
                                f"{AGENT_SCHEDULER}", "type": "NotFoundError"}
    released = sum(r["released_blocks"] for r in results)
    in_flight = sum(r["turns_in_flight"] for r in results)
    if in_flight:
        return 409, {"message": f"session {session_id!r} has {in_flight} turn(s) running or waiting; its state is "
                                f"kept for them: send X-Session-Close: 1 on the last turn, or close it after the turn "
                                f"ends" + (f" (retained state released on other engines: {released} blocks)"
                                           if released else ""),
                     "type": "ConflictError"}
    any_released = any(r["released"] for r in results)
    body = {"session_id": session_id, "released": any_released, "released_blocks": released,
            "previous_state": "retained" if any_released else results[0]["state"]}
    if not any_released:
        body["message"] = (f"session {session_id!r} holds no retained state: this server has no record of it (never "
                           f"seen, or ended: already closed, or released at its TTL or under memory pressure)")
    return 200, body


async def close_session(session_id: str, raw_request: Request) -> JSONResponse:
    """The route's handler (module docstring)."""
    from qwen4exp.serving.metrics import uses_agent_scheduler
    from qwen4exp.serving.sessions import SESSION_ID_RULE, session_id_problem

    if (why := session_id_problem(session_id)) is not None:
        return _error(400, f"the session id in the path {why}: {SESSION_ID_RULE}", "BadRequestError")
    engine = getattr(raw_request.app.state, "engine_client", None)
    config = getattr(engine, "vllm_config", None)
    core = getattr(engine, "engine_core", None)
    if core is None or config is None or not uses_agent_scheduler(config):
        status, body = combine(session_id, [])
        return _error(status, body["message"], body["type"])
    from qwen4exp.serving.scheduler import CLOSE_UTILITY as UTILITY

    args = (session_id, getattr(core, "client_index", 0))
    call_all = getattr(core, "call_utility_all_async", None)
    results = await call_all(UTILITY, *args) if call_all else [await core.call_utility_async(UTILITY, *args)]
    status, body = combine(session_id, list(results))
    if status != 200:
        return _error(status, body["message"], body["type"])
    return JSONResponse(body)


def install(app) -> bool:
    """Add the route to vLLM's FastAPI ``app`` once (False if it was there already)."""
    if getattr(app.state, "qwen4exp_session_routes", False):
        return False
    app.add_api_route(CLOSE_PATH, close_session, methods=["POST"], name="qwen4exp_close_session",
                      summary="Release an idle agent session's retained KV blocks and hybrid states now (qwen4exp)")
    app.state.qwen4exp_session_routes = True
    return True


class SessionClosePlugin:
    """The ``vllm.endpoint_plugins`` entry point (vLLM's ``EndpointPlugin`` protocol: a zero-argument factory, then
    ``attach_router`` while vLLM builds the app and ``init_state`` once its state is set up). Loaded only when
    ``VLLM_PLUGINS`` names ``qwen4exp``; only for servers that generate (not vLLM's engine-less render server). The
    engine side is the ``vllm.general_plugins`` entry's ``AgentScheduler``, which installs the utility the route
    calls on the engine core."""

    name = "qwen4exp"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        install(app)

    async def init_state(self, engine_client, state, args) -> None:
        """Nothing to set up: the route reads ``app.state.engine_client`` per request."""
