"""Seeded synthetic agent conversations shaped like SWE-Smith traces.

Shape (the field's SWE-Smith replay, EvalScope ``build_swe_smith_dataset.py`` with
``--first-turn-length 50000 --subsequent-turn-length 800 --min-turns 10
--max-turns 15`` and ``--max-tokens 500 --extra-args '{"ignore_eos": true}'``):

* turn 1 is one user message (a code base being read) whose chat prompt is
  exactly ``first_turn_tokens`` tokens, chat template included;
* every later turn appends the model's real reply of the previous turn as an
  assistant message plus one user message (tool output) that adds exactly
  ``turn_tokens`` new tokens after the conversation so far::

      prompt[k] = history[k] + turn_tokens
      history[k] = tokens of (turns 1..k-1 + reply k-1) as the chat template
                   renders them, without a generation prompt

  so "+800 new tokens per turn" counts the tool output with its template
  tokens and the generation prompt, and everything before it is the reusable
  prefix (the previous prompt, the reply, the end-of-message tokens). When a
  reply re-tokenizes to as many tokens as the server generated (the normal
  case for a trained model), ``history[k] = prompt[k-1] + completion[k-1] +
  reply_close`` (``reply_close`` = the template's end-of-assistant-message
  tokens); a reply that re-tokenizes differently (possible with random
  weights) changes ``history[k]``, never the new tokens;
* the number of turns of a conversation is drawn uniformly from
  ``[min_turns, max_turns]``.

Counts are exact for the served model's tokenizer: turn 1 is fitted when the
workload is planned; later turns are fitted just before they are sent (outside
the request's timing), because the reply is only known then. Every
conversation has its own random text from the first tokens on, so conversations
never share a cached prefix beyond the chat template's preamble; a per-run
nonce at the start keeps repeated runs from reusing each other's cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from .tokenizer import Tokenizer, TokenizerError

_WORDS = (
    "get set value config parse request response handler user item index count buffer token cache "
    "state node tree path file data result error logger client server queue batch model layer weight "
    "shape size offset limit key name type field schema record entry session context manager factory "
    "builder reader writer stream event task job worker pool lock timer retry policy option flag mode "
    "level format encode decode load save update delete create build check validate resolve render "
    "apply merge split filter map reduce sort find match scan fetch send recv open close init reset "
    "start stop run step commit rollback payload header route table column row query cursor engine "
    "plugin module package registry version patch diff hunk line block chunk frame page slot window"
).split()
_ERRORS = ("ValueError", "KeyError", "TypeError", "RuntimeError", "IndexError", "AssertionError", "OSError")
_BASES = ("object", "Base", "Mixin", "Protocol", "Exception", "dict", "NamedTuple")


class CodeText:
    """Deterministic source of code-like text (pseudo Python, shell, test logs)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def _w(self) -> str:
        return self.rng.choice(_WORDS)

    def _ident(self) -> str:
        n = self.rng.choice((1, 2, 2, 3))
        return "_".join(self._w() for _ in range(n))

    def _cls(self) -> str:
        return "".join(self._w().capitalize() for _ in range(self.rng.choice((1, 2, 3))))

    def _num(self) -> str:
        return str(self.rng.choice((0, 1, 2, 3, 8, 16, 32, 64, 100, 256, 1024, self.rng.randint(0, 99999))))

    def _path(self) -> str:
        return f"src/{self._w()}/{self._ident()}.py"

    def _code_line(self, indent: int) -> str:
        pad = "    " * indent
        r = self.rng.random()
        a, b, c = self._ident(), self._ident(), self._ident()
        if r < 0.22:
            return f"{pad}{a} = {b}.{self._w()}({c}, {self._num()})"
        if r < 0.32:
            return f"{pad}if {a} is None or {b} > {self._num()}:"
        if r < 0.40:
            return f"{pad}for {a} in {b}.{self._w()}s():"
        if r < 0.48:
            return f'{pad}raise {self.rng.choice(_ERRORS)}(f"{self._w()} {self._w()}: {{{a}!r}}")'
        if r < 0.56:
            return f"{pad}return {a}"
        if r < 0.63:
            return f"{pad}{a}[{self._num()}] = {b}.{c} + {self._num()}"
        if r < 0.70:
            return f"{pad}# {self._w()} the {self._w()} {self._w()} before {self._w()}ing"
        if r < 0.78:
            return f"{pad}self.{a} = {b}"
        if r < 0.85:
            return f"{pad}logger.{self.rng.choice(('debug', 'info', 'warning'))}(\"{self._w()} %s\", {a})"
        return f"{pad}{a} = [{b} for {c} in {self._ident()} if {c}]"

    def code_file(self, lines: int) -> str:
        out = [f"### {self._path()}", f"import {self._w()}", f"from {self._w()}.{self._w()} import {self._cls()}", ""]
        while len(out) < lines:
            if self.rng.random() < 0.3:
                out.append(f"class {self._cls()}({self.rng.choice(_BASES)}):")
                out.append(f'    """{self._w().capitalize()} the {self._w()} {self._w()} for {self._w()}."""')
                indent = 1
            else:
                indent = 0
            out.append(f"{'    ' * indent}def {self._ident()}(self, {self._ident()}, {self._ident()}={self._num()}):")
            for _ in range(self.rng.randint(3, 12)):
                out.append(self._code_line(indent + 1 + (1 if self.rng.random() < 0.3 else 0)))
            out.append("")
        return "\n".join(out) + "\n"

    def tool_output(self, lines: int) -> str:
        r = self.rng.random()
        out: list[str] = []
        if r < 0.35:
            out.append(f"$ python -m pytest tests/test_{self._ident()}.py -x -q")
            out.append(f"F.{'.' * self.rng.randint(0, 20)}")
            out.append(f"___ test_{self._ident()} ___")
            while len(out) < lines:
                out.append(f"{self._path()}:{self.rng.randint(1, 900)}: in {self._ident()}")
                out.append(self._code_line(1))
                if self.rng.random() < 0.2:
                    out.append(f"E   {self.rng.choice(_ERRORS)}: {self._w()} {self._w()} {self._num()}")
        elif r < 0.65:
            out.append(f"$ grep -rn {self._ident()} src/")
            while len(out) < lines:
                out.append(f"{self._path()}:{self.rng.randint(1, 900)}:{self._code_line(self.rng.randint(0, 2))}")
        else:
            out.append(f"$ cat {self._path()}")
            out.append(self.code_file(lines))
        return "\n".join(out) + "\n"

    def chunk(self, chars: int, kind: str) -> str:
        parts: list[str] = []
        n = 0
        while n < chars:
            if kind == "code":
                s = self.code_file(self.rng.randint(20, 80))
            else:
                s = self.tool_output(self.rng.randint(10, 40))
            parts.append(s)
            n += len(s)
        return "".join(parts)


@dataclass
class WorkloadSpec:
    first_turn_tokens: int = 50000
    turn_tokens: int = 800
    min_turns: int = 10
    max_turns: int = 15
    max_output_tokens: int = 500
    seed: int = 42
    # Written at the start of every conversation. A fresh nonce per run keeps a second run
    # against the same server from hitting the prefix cache the first run filled.
    nonce: str = ""

    def max_prompt_tokens(self) -> int:
        """Largest prompt the workload can produce (last turn of the longest conversation)."""
        return self.first_turn_tokens + (self.max_turns - 1) * (self.turn_tokens + self.max_output_tokens)


@dataclass
class ConversationPlan:
    conv_id: str
    num_turns: int
    first_text: str
    first_tokens: int  # counted chat-prompt tokens of turn 1 (== spec.first_turn_tokens when exact)
    tool_ids: list[list[int]] = field(default_factory=list)  # source token ids, one list per later turn
    tool_texts: list[str] = field(default_factory=list)  # planned text per later turn (no runtime fit)
    tool_n: list[int] = field(default_factory=list)  # tokens of each planned text


def _clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


async def source_ids(tok: Tokenizer, gen: CodeText, n_tokens: int, kind: str, header: str = "") -> list[int]:
    """At least ``n_tokens`` token ids of fresh text (encoded chunk by chunk)."""
    ids: list[int] = []
    text = header
    while True:
        need = n_tokens - len(ids)
        text += gen.chunk(max(256, int(need * 4.5)), kind)
        ids.extend(await tok.encode(text))
        text = ""
        if len(ids) >= n_tokens:
            return ids


async def fit_chat(
    tok: Tokenizer,
    prefix: list[dict[str, Any]],
    ids: list[int],
    target: int,
    n_guess: int,
    max_iter: int = 10,
    guess_text: str | None = None,
) -> tuple[str, int, int]:
    """Choose ``n`` so that ``prefix + [user: decode(ids[:n])]`` is exactly ``target`` chat tokens.

    Returns ``(text, counted_tokens, n)``. When no prefix of ``ids`` fits exactly (the count jumps over the target
    where BPE merges), the closest shorter prefix is padded with a few filler characters to the target;
    ``counted_tokens != target`` only when that fails too (the caller records the mismatch).
    ``guess_text``, when given, is ``decode(ids[:n_guess])`` (saves a call).
    """
    lo, hi = 1, len(ids)
    n = _clamp(n_guess, lo, hi)
    seen: dict[int, int] = {}
    best: tuple[str, int, int] | None = None
    for _ in range(max_iter):
        text = guess_text if (guess_text is not None and n == n_guess) else await tok.decode(ids[:n])
        c = await tok.count_chat(prefix + [{"role": "user", "content": text}])
        seen[n] = c
        if best is None or abs(c - target) < abs(best[1] - target):
            best = (text, c, n)
        if c == target:
            return text, c, n
        nxt = _clamp(n + (target - c), lo, hi)
        if nxt in seen:
            for cand in (n + 1, n - 1, n + 2, n - 2, n + 3, n - 3):
                if lo <= cand <= hi and cand not in seen:
                    nxt = cand
                    break
            else:
                break
        n = nxt
    assert best is not None
    if best[1] != target:  # no prefix of ids fits (the count jumps over the target): pad the closest one below
        below = [(c, k) for k, c in seen.items() if c < target]
        if below:
            c, k = max(below)
            text = best[0] if best[2] == k else await tok.decode(ids[:k])
            padded = await _pad_to(tok, prefix, text, c, target)
            if padded is not None:
                return padded[0], padded[1], k
    return best


# Short suffixes that usually add one token (or a few) to a text; ``_pad_to`` climbs to the target with them.
_FILLERS = (" x", " .", "\n", " #", " 0", ";", " y", " z")


async def _pad_to(tok: Tokenizer, prefix: list[dict[str, Any]], text: str, count: int, target: int,
                  budget: int = 24) -> tuple[str, int] | None:
    """Append fillers to ``text`` (``count`` chat tokens < ``target``) until the chat is exactly ``target`` tokens;
    None when ``budget`` counts do not get there."""
    while count < target and budget > 0:
        step = None
        for f in _FILLERS:
            budget -= 1
            c = await tok.count_chat(prefix + [{"role": "user", "content": text + f}])
            if c == target:
                return text + f, c
            if count < c < target and step is None:
                step = (text + f, c)
            if budget <= 0:
                break
        if step is None:
            return None
        text, count = step
    return (text, count) if count == target else None


PROXY_USER = {"role": "user", "content": "ok"}


@dataclass
class TemplateOverhead:
    """Chat-template token counts of the served model, measured with a probe.

    ``first``: tokens of ``[user: ""]`` with the generation prompt (system
    preamble, user header/footer, generation prompt).
    ``user_block``: tokens a later user message adds besides its content (user
    header/footer and the next generation prompt).
    ``reply_close``: tokens the template adds after a reply's own tokens when
    it becomes history (end-of-message markers).
    ``proxy_base``: tokens of ``[PROXY_USER]`` without a generation prompt, or
    None when the template rejects two consecutive user messages. With it, the
    tokens a user message ``c`` adds in a conversation are measured as
    ``count([PROXY_USER, user c]) - proxy_base``: a short conversation with no
    assistant message in it, so templates that render the last assistant
    message specially (Qwen3-style think blocks) do not leak into the count.
    """

    first: int
    user_block: int
    reply_close: int
    proxy_base: int | None = None


async def template_overhead(tok: Tokenizer) -> TemplateOverhead:
    probe_user = "alpha beta gamma"
    probe_reply = "delta epsilon"
    probe_tool = "zeta eta theta"
    u = {"role": "user", "content": probe_user}
    a = {"role": "assistant", "content": probe_reply}
    t = {"role": "user", "content": probe_tool}
    first = await tok.count_chat([{"role": "user", "content": ""}])
    prompt1 = await tok.count_chat([u])
    history = await tok.count_chat([u, a], add_generation_prompt=False)
    prompt2 = await tok.count_chat([u, a, t])
    reply = len(await tok.encode(probe_reply))
    tool = len(await tok.encode(probe_tool))
    proxy_base: int | None
    try:
        proxy_base = await tok.count_chat([PROXY_USER], add_generation_prompt=False)
        user_block = await tok.count_chat([PROXY_USER, t]) - proxy_base - tool
    except TokenizerError:  # e.g. a template that insists on alternating roles
        proxy_base = None
        user_block = prompt2 - history - tool
    return TemplateOverhead(
        first=first,
        user_block=max(0, user_block),
        reply_close=max(0, history - prompt1 - reply),
        proxy_base=proxy_base,
    )


async def plan_conversation(
    tok: Tokenizer,
    spec: WorkloadSpec,
    conv_key: str,
    overhead: TemplateOverhead,
) -> ConversationPlan:
    """Plan one conversation: turn count, exact first turn, tool-output sources."""
    rng = random.Random(f"{spec.seed}:{conv_key}")
    num_turns = rng.randint(spec.min_turns, spec.max_turns)
    gen = CodeText(rng)
    n0 = max(1, spec.first_turn_tokens - overhead.first)
    session = f"[session {spec.nonce}] " if spec.nonce else ""
    header = (
        f"{session}Repository {rng.getrandbits(64):016x}-{gen._ident()}: read the code base below, "
        f"then find and fix the bug that makes the test suite fail.\n\n"
    )
    ids = await source_ids(tok, gen, n0 + 64, "code", header)
    first_text, first_tokens, _ = await fit_chat(tok, [], ids, spec.first_turn_tokens, n0)

    plan = ConversationPlan(conv_id=conv_key, num_turns=num_turns, first_text=first_text, first_tokens=first_tokens)
    n_plan = max(1, spec.turn_tokens - overhead.user_block)
    margin = 64 + spec.turn_tokens // 4
    for k in range(1, num_turns):
        tids = await source_ids(tok, gen, n_plan + margin, "tool", f"[tool output {k}]\n")
        plan.tool_ids.append(tids)
        plan.tool_n.append(n_plan)
        plan.tool_texts.append(await tok.decode(tids[:n_plan]))
    return plan
