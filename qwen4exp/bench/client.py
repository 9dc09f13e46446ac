"""Streaming chat-completion client for one benchmark turn, and server probes."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .metrics import parse_prometheus

# Errors that mean "the server is not there any more" (as opposed to one bad request).
CONNECTION_ERRORS = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientPayloadError,
    aiohttp.ClientOSError,
    ConnectionError,
)


@dataclass
class TurnResult:
    ok: bool = False  # the stream completed (it may still be truncated)
    error: str | None = None
    connection_error: bool = False
    timed_out: bool = False
    http_status: int | None = None
    start: float = 0.0  # perf_counter at send
    ttft_s: float | None = None
    latency_s: float | None = None  # send -> last token chunk
    itl_s: list[float] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    chunks: int = 0


def _describe_connection_error(e: BaseException) -> str:
    if isinstance(e, aiohttp.ClientConnectorError):
        what = "cannot connect to the server"
    elif isinstance(e, aiohttp.ServerDisconnectedError):
        what = "the server closed the connection"
    elif isinstance(e, aiohttp.ClientPayloadError):
        what = "the response stream was cut off (connection closed mid-stream)"
    else:
        what = "connection lost"
    return f"{what} [{type(e).__name__}: {e}]"


def _delta_has_token(delta: dict[str, Any]) -> bool:
    return bool(
        delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content") or delta.get("tool_calls")
    )


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    *,
    headers: dict[str, str],
    timeout_s: float,
) -> TurnResult:
    """Send one streaming chat completion and time it.

    TTFT is taken at the first chunk that carries a token (content, reasoning
    or a tool call) or a finish reason; latency at the last such chunk; ITLs
    are the gaps between consecutive such chunks (``vllm bench serve``'s
    definitions, minus empty role-only chunks). Token counts come from the
    final ``usage`` chunk (``stream_options.include_usage``). The whole request,
    including the stream, is bounded by ``timeout_s``.
    """
    res = TurnResult()
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(30.0, timeout_s))
    text_parts: list[str] = []
    reasoning_parts: list[str] = []
    got_done = False
    res.start = time.perf_counter()
    last: float | None = None
    try:
        async with session.post(url, json=payload, headers=headers, timeout=timeout) as resp:
            res.http_status = resp.status
            if resp.status != 200:
                body = (await resp.text())[:500]
                res.error = f"HTTP {resp.status}: {body}"
                return res
            buf = b""
            async for raw in resp.content.iter_any():
                buf += raw
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line or line.startswith(b":") or not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        got_done = True
                        continue
                    now = time.perf_counter()
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        res.error = f"bad SSE payload: {data[:200]!r}"
                        return res
                    if obj.get("error"):
                        err = obj["error"]
                        msg = err.get("message", err) if isinstance(err, dict) else err
                        res.error = f"server error in stream: {msg}"
                        return res
                    token_chunk = False
                    for choice in obj.get("choices") or []:
                        delta = choice.get("delta") or {}
                        if _delta_has_token(delta):
                            token_chunk = True
                            text_parts.append(delta.get("content") or "")
                            reasoning_parts.append(delta.get("reasoning") or delta.get("reasoning_content") or "")
                        if choice.get("finish_reason"):
                            res.finish_reason = choice["finish_reason"]
                            token_chunk = True
                    if token_chunk:
                        res.chunks += 1
                        if last is None:
                            res.ttft_s = now - res.start
                        else:
                            res.itl_s.append(now - last)
                        last = now
                    usage = obj.get("usage")
                    if usage:
                        res.prompt_tokens = usage.get("prompt_tokens")
                        res.completion_tokens = usage.get("completion_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            res.cached_tokens = int(details["cached_tokens"])
    except asyncio.TimeoutError:
        res.timed_out = True
        res.error = f"request timed out after {timeout_s:g} s (--request-timeout)"
        return res
    except CONNECTION_ERRORS as e:
        res.connection_error = True
        res.error = _describe_connection_error(e)
        return res
    except aiohttp.ClientError as e:
        res.error = f"client error: {type(e).__name__}: {e}"
        return res
    res.text = "".join(text_parts)
    res.reasoning = "".join(reasoning_parts)
    if last is not None:
        res.latency_s = last - res.start
    if not got_done:
        res.connection_error = True
        res.error = "stream ended before [DONE] (server closed the connection)"
        return res
    if res.ttft_s is None:
        res.error = "stream carried no token"
        return res
    if res.completion_tokens is None or res.prompt_tokens is None:
        res.error = "stream had no usage chunk (the server must honour stream_options.include_usage)"
        return res
    res.ok = True
    return res


async def scrape_metrics(
    session: aiohttp.ClientSession, url: str | None, headers: dict[str, str], timeout_s: float = 10.0
) -> dict[str, float] | None:
    """GET Prometheus metrics; None when unreachable or not exposed."""
    if not url:
        return None
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return None
            return parse_prometheus(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
        return None


async def list_models(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str], timeout_s: float = 10.0
) -> list[str]:
    """Model ids served at ``{base_url}/models``; raises on connection problems."""
    async with session.get(
        base_url.rstrip("/") + "/models", headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as r:
        if r.status != 200:
            raise RuntimeError(f"GET {base_url}/models returned HTTP {r.status}")
        data = await r.json(content_type=None)
    return [m.get("id") for m in data.get("data", []) if m.get("id")]


async def server_alive(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> bool:
    try:
        await list_models(session, base_url, headers, timeout_s=10.0)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not answering"
        return False
