"""Token counting with the served model's tokenizer.

Two backends, same interface (all methods are coroutines):

* :class:`ServerTokenizer` uses the server's ``POST /tokenize`` and
  ``POST /detokenize`` routes (vLLM serves both). Chat prompts are counted by
  sending the messages, so the count includes the chat template exactly as the
  server renders it for ``/v1/chat/completions``.
* :class:`HFTokenizer` loads the tokenizer from a model directory
  (``--tokenizer DIR``) with transformers and renders the chat template locally
  the way vLLM does (template to text, then encode without special tokens).
  This keeps the counting off the server while the benchmark runs.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

import aiohttp


class TokenizerError(RuntimeError):
    """Counting tokens failed (route missing, server gone, bad tokenizer)."""


class Tokenizer(Protocol):
    name: str
    max_model_len: int | None

    async def encode(self, text: str) -> list[int]: ...

    async def decode(self, ids: list[int]) -> str: ...

    async def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int: ...


class ServerTokenizer:
    """Counts with the server's ``/tokenize`` routes (``root`` is the URL without ``/v1``)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        root: str,
        model: str,
        *,
        headers: dict[str, str] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.name = f"server {root}/tokenize"
        self.session = session
        self.root = root.rstrip("/")
        self.model = model
        self.headers = headers or {}
        self.chat_template_kwargs = chat_template_kwargs
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_model_len: int | None = None

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = self.root + path
        try:
            async with self.session.post(url, json=body, headers=self.headers, timeout=self.timeout) as r:
                text = await r.text()
                if r.status != 200:
                    raise TokenizerError(f"POST {path} returned HTTP {r.status}: {text[:300]}")
                data = json.loads(text)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise TokenizerError(f"POST {path} failed: {type(e).__name__}: {e}") from e
        if isinstance(data, dict) and data.get("max_model_len"):
            self.max_model_len = int(data["max_model_len"])
        return data

    async def encode(self, text: str) -> list[int]:
        data = await self._post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        return list(data["tokens"])

    async def decode(self, ids: list[int]) -> str:
        data = await self._post("/detokenize", {"model": self.model, "tokens": list(ids)})
        return str(data["prompt"])

    async def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        data = await self._post("/tokenize", body)
        return int(data["count"]) if "count" in data else len(data["tokens"])


class HFTokenizer:
    """Counts with a local transformers tokenizer (``--tokenizer DIR``)."""

    def __init__(
        self,
        path: str,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - transformers is a dependency
            raise TokenizerError("--tokenizer needs the transformers package") from e
        try:
            self.tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as e:  # noqa: BLE001 - surface any loader error with the path
            raise TokenizerError(f"cannot load a tokenizer from {path!r}: {e}") from e
        self.name = f"local tokenizer {path}"
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.max_model_len = None

    def _encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def _count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> int:
        text = self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.chat_template_kwargs
        )
        return len(self._encode(text))

    async def encode(self, text: str) -> list[int]:
        if len(text) < 20000:
            return self._encode(text)
        return await asyncio.to_thread(self._encode, text)

    async def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids))

    async def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int:
        try:
            return await asyncio.to_thread(self._count_chat, messages, add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - template errors (jinja) and the like
            raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from e
