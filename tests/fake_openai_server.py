#!/usr/bin/env python3
"""A small OpenAI-compatible streaming server for the benchmark's tests.

Standard library only (plus ``tokenizers`` when ``--tokenizer-json`` is given).
It serves what ``qwen4exp-bench`` talks to, the way vLLM serves it:

* ``GET /v1/models``, ``GET /health``;
* ``POST /v1/chat/completions`` with ``stream: true``: SSE chunks (a role
  chunk, one chunk per decode step, a finish chunk, a usage chunk when
  ``stream_options.include_usage``, ``data: [DONE]``), honouring
  ``max_tokens`` / ``max_completion_tokens`` and ``ignore_eos``;
* ``POST /tokenize`` (``prompt`` or ``messages``) and ``POST /detokenize``;
* ``GET /metrics``: Prometheus text with ``vllm:prefix_cache_queries_total`` /
  ``vllm:prefix_cache_hits_total`` from a simulated block prefix cache, and the
  spec-decode counters with ``--mtp K``.

Tokenizer: one token per character (ids = code points) with ChatML special
tokens, so counts are trivially exact; or, with ``--tokenizer-json FILE``, a
real BPE ``tokenizer.json`` with the same ChatML template rendered in Python.

Failure injection: ``--die-after N`` kills the process in the middle of the
N-th chat stream (later connections are refused); ``--stall-after N`` makes the
N-th chat stream stop sending without closing; ``--truncate-after K`` ends every
reply after K tokens regardless of ``ignore_eos``.

Sessions: ``--request-log FILE`` appends one JSON line per chat request (its
``X-Session-ID`` header, body ``session_id`` and ``vllm_xargs``, arrival time);
``/metrics`` also has ``vllm:num_preemptions_total`` (0) and the histogram sum
``vllm:request_prefill_kv_computed_tokens_sum`` (prompt tokens not served from
the cache). ``--start-delay S`` waits S seconds before listening (a slow
start-up for the A/B mode's tests).

Run: ``python tests/fake_openai_server.py --port 0``; it prints ``READY <port>``
on stdout once it listens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
_ALPHABET = "abcdefghijklmnopqrstuvwxyz     .,_()=:\n"


class CharTokenizer:
    """One token per character; ChatML specials get ids above the Unicode range."""

    SPECIAL = {IM_START: 0x110001, IM_END: 0x110002, "system": 0x110003, "user": 0x110004, "assistant": 0x110005}
    SPECIAL_INV = {v: k for k, v in SPECIAL.items()}

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.SPECIAL_INV.get(i) or chr(i) for i in ids)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        # ChatML with the role name as one token, like a BPE vocabulary would have it:
        # 5 template tokens per message, 3 for the generation prompt.
        nl = ord("\n")
        ids: list[int] = []
        for m in messages:
            ids += [self.SPECIAL[IM_START], self.SPECIAL[m["role"]], nl] + self.encode(_content(m))
            ids += [self.SPECIAL[IM_END], nl]
        if add_generation_prompt:
            ids += [self.SPECIAL[IM_START], self.SPECIAL["assistant"], nl]
        return ids

    def sample(self, rng: random.Random) -> int:
        return ord(rng.choice(_ALPHABET))


class JsonTokenizer:
    """A ``tokenizers`` tokenizer.json with the ChatML template."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path)
        specials = {self.tok.token_to_id(IM_START), self.tok.token_to_id(IM_END)}
        self.sampleable = [
            i
            for tok, i in self.tok.get_vocab().items()
            if i not in specials and not tok.startswith("<|") and self.tok.decode([i])
        ]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        text = "".join(f"{IM_START}{m['role']}\n{_content(m)}{IM_END}\n" for m in messages)
        if add_generation_prompt:
            text += f"{IM_START}assistant\n"
        return self.encode(text)

    def sample(self, rng: random.Random) -> int:
        return rng.choice(self.sampleable)


def _content(m: dict[str, Any]) -> str:
    c = m.get("content") or ""
    if isinstance(c, list):
        c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
    return str(c)


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tok = JsonTokenizer(args.tokenizer_json) if args.tokenizer_json else CharTokenizer()
        self.lock = threading.Lock()
        self.chat_requests = 0
        self.blocks: set[int] = set()
        self.counters = {
            "vllm:prefix_cache_queries": 0,
            "vllm:prefix_cache_hits": 0,
            "vllm:prompt_tokens": 0,
            "vllm:generation_tokens": 0,
            "vllm:spec_decode_num_drafts": 0,
            "vllm:spec_decode_num_draft_tokens": 0,
            "vllm:spec_decode_num_accepted_tokens": 0,
            "vllm:num_preemptions": 0,
        }
        self.kv_computed_sum = 0
        self.kv_computed_count = 0
        self.times = {"vllm:time_to_first_token_seconds": 0.0, "vllm:request_queue_time_seconds": 0.0,
                      "vllm:request_prefill_time_seconds": 0.0}  # seconds histograms' sums (count: timed)
        self.timed = 0

    def time_request(self, prefill_s: float) -> None:
        """A request's server-side times as vLLM observes them: no queue, its prefill sleep, TTFT the sum and a
        fixed 1 ms of rendering."""
        with self.lock:
            self.times["vllm:time_to_first_token_seconds"] += prefill_s + 0.001
            self.times["vllm:request_prefill_time_seconds"] += prefill_s
            self.timed += 1

    def block_hashes(self, ids: list[int]) -> list[int]:
        bs = self.args.block_size
        out, h = [], 0
        for i in range(0, len(ids) - bs + 1, bs):
            h = hash((h, tuple(ids[i : i + bs])))
            out.append(h)
        return out

    def prefill(self, ids: list[int]) -> int:
        """Count the query, return cached tokens (full blocks, at least one token computed)."""
        hashes = self.block_hashes(ids)
        with self.lock:
            n = 0
            for h in hashes:
                if h not in self.blocks:
                    break
                n += 1
            hits = min(n * self.args.block_size, ((len(ids) - 1) // self.args.block_size) * self.args.block_size)
            self.counters["vllm:prefix_cache_queries"] += len(ids)
            self.counters["vllm:prefix_cache_hits"] += hits
            self.counters["vllm:prompt_tokens"] += len(ids)
            self.kv_computed_sum += len(ids) - hits
            self.kv_computed_count += 1
            self.blocks.update(hashes)
        return hits

    def cache(self, ids: list[int]) -> None:
        with self.lock:
            self.blocks.update(self.block_hashes(ids))

    def metrics_text(self) -> str:
        labels = f'{{engine="0",model_name="{self.args.model}"}}'
        lines = []
        with self.lock:
            for name, value in self.counters.items():
                if name.startswith("vllm:spec_decode") and not self.args.mtp:
                    continue
                lines.append(f"# HELP {name} fake counter")
                lines.append(f"# TYPE {name} counter")
                lines.append(f"{name}_total{labels} {float(value)}")
                lines.append(f"{name}_created{labels} 1.7e9")
            name = "vllm:request_prefill_kv_computed_tokens"
            lines.append(f"# HELP {name} fake histogram")
            lines.append(f"# TYPE {name} histogram")
            lines.append(f'{name}_bucket{{engine="0",le="+Inf",model_name="{self.args.model}"}} '
                         f"{float(self.kv_computed_count)}")
            lines.append(f"{name}_count{labels} {float(self.kv_computed_count)}")
            lines.append(f"{name}_sum{labels} {float(self.kv_computed_sum)}")
            for name, total in self.times.items():
                lines.append(f"# TYPE {name} histogram")
                lines.append(f'{name}_bucket{{engine="0",le="+Inf",model_name="{self.args.model}"}} {float(self.timed)}')
                lines.append(f"{name}_count{labels} {float(self.timed)}")
                lines.append(f"{name}_sum{labels} {total}")
        lines.append("# HELP vllm:num_requests_running fake gauge")
        lines.append("# TYPE vllm:num_requests_running gauge")
        lines.append(f"vllm:num_requests_running{labels} 0.0")
        return "\n".join(lines) + "\n"


def make_handler(state: State):
    args = state.args

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Small SSE writes must leave at once (no Nagle batching), as from a real server.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, *a: Any) -> None:  # quiet
            pass

        # -------------------------------------------------------------- helpers
        def _json(self, code: int, obj: Any) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _text(self, code: int, text: str) -> None:
            body = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, code: int, msg: str) -> None:
            self._json(code, {"error": {"message": msg, "type": "BadRequestError", "code": code}})

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _sse(self, obj: Any) -> None:
            self._chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

        def _body(self) -> dict[str, Any]:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}")

        # -------------------------------------------------------------- routes
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/v1/models":
                self._json(
                    200,
                    {
                        "object": "list",
                        "data": [{"id": args.model, "object": "model", "max_model_len": args.max_model_len}],
                    },
                )
            elif self.path == "/health":
                self._json(200, {})
            elif self.path == "/metrics":
                self._text(200, state.metrics_text())
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:  # noqa: N802
            try:
                body = self._body()
            except json.JSONDecodeError:
                return self._error(400, "bad JSON")
            if self.path == "/v1/chat/completions":
                return self.chat(body)
            if self.path in ("/tokenize", "/detokenize") and args.no_tokenize:
                return self._error(404, "Not Found")
            if self.path == "/tokenize":
                if body.get("model") not in (None, args.model):
                    return self._error(404, f"The model `{body.get('model')}` does not exist.")
                if "messages" in body and (err := self.check_roles(body["messages"])):
                    return self._error(400, err)
                if "messages" in body:
                    ids = state.tok.encode_chat(body["messages"], body.get("add_generation_prompt", True))
                else:
                    ids = state.tok.encode(body.get("prompt", ""))
                return self._json(200, {"count": len(ids), "max_model_len": args.max_model_len, "tokens": ids})
            if self.path == "/detokenize":
                return self._json(200, {"prompt": state.tok.decode(body.get("tokens", []))})
            return self._error(404, f"no route {self.path}")

        def check_roles(self, messages: list[dict[str, Any]]) -> str | None:
            if args.strict_alternation:
                roles = [m.get("role") for m in messages]
                if any(a == b for a, b in zip(roles, roles[1:])):
                    return "Conversation roles must alternate user/assistant/user/assistant/..."
            return None

        def chat(self, body: dict[str, Any]) -> None:
            if body.get("model") != args.model:
                return self._error(404, f"The model `{body.get('model')}` does not exist.")
            if err := self.check_roles(body.get("messages", [])):
                return self._error(400, err)
            with state.lock:
                state.chat_requests += 1
                nreq = state.chat_requests
                if args.request_log:
                    entry = {
                        "n": nreq,
                        "t": time.time(),
                        "x_session_id": self.headers.get("X-Session-ID"),
                        "session_id": body.get("session_id"),
                        "vllm_xargs": body.get("vllm_xargs"),
                        "messages": len(body.get("messages", [])),
                    }
                    with open(args.request_log, "a") as f:
                        f.write(json.dumps(entry) + "\n")
            prompt = state.tok.encode_chat(body.get("messages", []), True)
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
            if len(prompt) + max_tokens > args.max_model_len:
                return self._error(400, f"prompt ({len(prompt)}) + max_tokens > max_model_len {args.max_model_len}")
            n_out = max_tokens
            if args.truncate_after:
                n_out = min(n_out, args.truncate_after)
            elif not body.get("ignore_eos"):
                n_out = min(n_out, args.eos_after or n_out)

            cached = state.prefill(prompt)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            # "prefill": time for the uncached part
            prefill_s = args.ttft + (len(prompt) - cached) / args.prefill_rate
            time.sleep(prefill_s)
            state.time_request(prefill_s)
            rid = f"chatcmpl-{nreq}"
            base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": args.model}
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            self._sse({**base, "choices": [role]})
            rng = random.Random(nreq * 7919 + len(prompt))
            out: list[int] = []
            steps = 0
            while len(out) < n_out:
                if steps and args.die_after and nreq == args.die_after and steps >= 2:
                    os._exit(3)  # the server process dies mid-stream
                if steps and args.stall_after and nreq == args.stall_after and steps >= 2:
                    time.sleep(3600)  # stalls without closing the connection
                k = 1
                if args.mtp:
                    acc = rng.randint(0, args.mtp)
                    k = acc + 1
                    with state.lock:
                        state.counters["vllm:spec_decode_num_drafts"] += 1
                        state.counters["vllm:spec_decode_num_draft_tokens"] += args.mtp
                        state.counters["vllm:spec_decode_num_accepted_tokens"] += acc
                ids = [state.tok.sample(rng) for _ in range(min(k, n_out - len(out)))]
                out += ids
                steps += 1
                time.sleep(args.token_delay)
                finish = None
                if len(out) >= n_out:
                    finish = "length" if body.get("ignore_eos") or len(out) >= max_tokens else "stop"
                text = "".join(state.tok.decode([i]) for i in ids)
                self._sse({**base, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})
            with state.lock:
                state.counters["vllm:generation_tokens"] += len(out)
            state.cache(prompt + out)
            so = body.get("stream_options") or {}
            if so.get("include_usage") and not args.no_usage:
                usage = {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(out),
                    "total_tokens": len(prompt) + len(out),
                }
                if args.usage_details:
                    usage["prompt_tokens_details"] = {"cached_tokens": cached}
                self._sse({**base, "choices": [], "usage": usage})
            self._sse(b"[DONE]")
            self._chunk(b"")

    return Handler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed as READY <port>)")
    p.add_argument("--model", default="fake-model")
    p.add_argument("--max-model-len", type=int, default=100000)
    p.add_argument("--tokenizer-json", default=None, help="use this tokenizer.json (BPE) instead of characters")
    p.add_argument("--ttft", type=float, default=0.005, help="fixed prefill seconds")
    p.add_argument("--prefill-rate", type=float, default=200000.0, help="uncached prompt tokens per second")
    p.add_argument("--token-delay", type=float, default=0.002, help="seconds per decode step")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mtp", type=int, default=0, help="simulate speculative decoding with K draft tokens")
    p.add_argument("--usage-details", action="store_true", help="send usage.prompt_tokens_details.cached_tokens")
    p.add_argument("--no-usage", action="store_true", help="never send a usage chunk")
    p.add_argument("--no-tokenize", action="store_true", help="no /tokenize and /detokenize routes")
    p.add_argument("--die-after", type=int, default=0, help="exit in the middle of the N-th chat stream")
    p.add_argument("--stall-after", type=int, default=0, help="stall the N-th chat stream forever")
    p.add_argument("--truncate-after", type=int, default=0, help="end every reply after K tokens")
    p.add_argument("--strict-alternation", action="store_true", help="reject consecutive messages of one role")
    p.add_argument("--eos-after", type=int, default=0, help="without ignore_eos, stop after K tokens")
    p.add_argument("--request-log", default=None, help="append one JSON line per chat request (session fields)")
    p.add_argument("--start-delay", type=float, default=0.0, help="seconds to wait before listening")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    state = State(args)
    if args.start_delay:
        time.sleep(args.start_delay)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    server.daemon_threads = True
    for k in sorted(k for k in os.environ if k.startswith("QWEN4EXP_")):  # (what an --ab config's env set; on
        print(f"ENV {k}={os.environ[k]}", file=sys.stderr, flush=True)  # stderr: stdout's first line is READY)
    print(f"READY {server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
