"""``qwen4exp-serve`` on a tiny checkpoint: OpenAI completions + chat (streaming and not) give the offline engine's
tokens; bad requests get a 4xx with a message and the server keeps serving. One server per module, stopped by PID
(its own process group) in the fixture's teardown."""

import json

import pytest
from served import post as _post
from served import serve

pytestmark = pytest.mark.vllm

MAX_LEN = 256
N_TOK = 8


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    with serve(tiny_ckpt, tmp_path_factory.mktemp("server"), "--max-model-len", str(MAX_LEN), "--enforce-eager",
               "--max-num-seqs", "8") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="none", timeout=120, max_retries=0)


EXTRA = {"return_token_ids": True, "ignore_eos": True}
PROMPT = "the quick brown fox jumps over the lazy dog " * 6


@pytest.fixture(scope="module")
def served(client):
    """Token ids from the server, per endpoint and mode."""
    out = {}
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N_TOK, temperature=0, extra_body=EXTRA)
    out["completion"] = (r.choices[0].prompt_token_ids, r.choices[0].token_ids, r.choices[0].text)
    toks, text, prompt_ids = [], "", None
    for ch in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N_TOK, temperature=0, stream=True,
                                        extra_body=EXTRA):
        c = ch.choices[0]
        prompt_ids = getattr(c, "prompt_token_ids", None) or prompt_ids
        toks += list(getattr(c, "token_ids", None) or [])
        text += c.text or ""
    out["completion_stream"] = (prompt_ids, toks, text)
    msgs = [{"role": "user", "content": "hello what is the blue sky"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=N_TOK, temperature=0, extra_body=EXTRA)
    out["chat"] = (r.prompt_token_ids, r.choices[0].token_ids, r.choices[0].message.content)
    toks, text, prompt_ids = [], "", None
    for ch in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=N_TOK, temperature=0,
                                             stream=True, extra_body=EXTRA):
        prompt_ids = getattr(ch, "prompt_token_ids", None) or prompt_ids
        if ch.choices:
            c = ch.choices[0]
            toks += list(getattr(c, "token_ids", None) or [])
            text += (c.delta.content or "") if c.delta else ""
    out["chat_stream"] = (prompt_ids, toks, text)
    return out


def test_plugin_serves_and_logs(server):
    assert "is served by the qwen4exp plugin" in server["log"].read_text()


def test_chat_prompts_go_through_the_tokenize_cache_exactly(server, client, tiny_ckpt):
    """The served plugin tokenizes chat prompts through ``qwen4exp.serving.tokenize_cache``: a growing conversation's
    prompt ids are the tokenizer's ids of the rendered chat, turn after turn (the earlier messages from the cache)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    msgs = [{"role": "user", "content": "the blue sky over the sea, said the old man to the boy at dawn " * 2}]
    for turn in range(3):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0, extra_body=EXTRA)
        want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert list(r.prompt_token_ids) == list(tok(want, add_special_tokens=False)["input_ids"]), turn
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": f"and then turn {turn}, what did the boy answer the old man?"}]
    assert "qwen4exp tokenize cache on" in server["log"].read_text()


def test_endpoints_match_offline_engine(server, served, tmp_path_factory):
    from vllm_offline import run_offline

    for k, (p, t, text) in served.items():
        print(k, len(p or []), t, repr(text))
        assert len(t) == N_TOK, k
    assert served["completion"][1] == served["completion_stream"][1]
    assert served["completion"][2] == served["completion_stream"][2]
    assert served["chat"][1] == served["chat_stream"][1]
    assert served["chat"][2] == served["chat_stream"][2]
    prompts = [served["completion"][0], served["chat"][0]]
    spec = dict(model=server["ckpt"], prompts=prompts,
                engine=dict(dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=MAX_LEN),
                sampling=dict(temperature=0.0, max_tokens=N_TOK, ignore_eos=True, detokenize=False))
    res = run_offline(spec, str(tmp_path_factory.mktemp("offline_vs_server")))
    assert res["tokens"] == [served["completion"][1], served["chat"][1]]


@pytest.mark.parametrize("body,code", [
    (dict(model="tiny", prompt="hello " * (MAX_LEN + 20), max_tokens=4), 400),  # prompt over max_model_len
    (dict(model="tiny", prompt="", max_tokens=4), 400),  # empty prompt
    (dict(model="no-such-model", prompt="hello", max_tokens=4), 404),  # unknown model
    (dict(model="tiny", prompt=[1, 2, 100000], max_tokens=4), 400),  # token id outside the vocabulary
    (dict(model="tiny", prompt="hello", max_tokens=MAX_LEN * 4), 400),  # cannot fit max_model_len
])
def test_bad_requests_get_4xx_and_server_survives(server, body, code):
    status, payload = _post(server["base"] + "/v1/completions", body)
    assert status == code, payload
    msg = json.dumps(payload)
    assert "message" in msg and len(msg) > 20, payload
    assert server["proc"].poll() is None
    status, ok = _post(server["base"] + "/v1/completions", dict(model="tiny", prompt="hello world", max_tokens=2))
    assert status == 200 and ok["choices"][0]["text"] is not None
