"""``qwen4exp-serve`` with images: OpenAI chat messages with ``image_url`` content parts carrying base64 data URLs get
the HF reference's greedy tokens (fp32, a tiny random composite checkpoint made by upstream transformers, images made
here); remote and file URLs (no connection made), undecodable data URLs, an image over ``max_model_len``, more images
than ``--limit-mm-per-prompt`` and an image sent to the text-only tiny-coder get a 400 naming the problem, each
followed by a normal request that gets 200; a composite checkpoint without ``preprocessor_config.json`` is refused at
start with one line and serves text with ``--language-model-only``; docs/images.md's curl image request runs as written.
One server per checkpoint (ports 18650-18652; 18653: a listener that must see no connection; 18654: an HTTP
server for the connector test)."""

import base64
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from served import post, serve

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
TINY_CODER = str(ROOT / "qwen4exp" / "assets" / "tiny-coder")
MAX_LEN = 192
GEN = 8
PORT_VL, PORT_TEXT, PORT_NOPP, PORT_LISTENER = 18650, 18651, 18652, 18653
# the server's image processor takes up to 128 x 128 pixels (256 image tokens): such an image does not fit MAX_LEN
MAX_PIXELS = 128 * 128


def png_data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def chat(base: str, messages, max_tokens: int = GEN):
    return post(base + "/v1/chat/completions",
                dict(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                     return_token_ids=True))


def assert_still_serving(base: str) -> None:
    status, body = chat(base, [{"role": "user", "content": "hello what is the blue sky"}])
    assert status == 200, body
    assert len(body["choices"][0]["token_ids"]) == GEN


def _build(d: str, preprocessor: bool = True) -> str:
    from vision_checkpoint import build_vision_checkpoint, write_image_processor_config

    from qwen4exp import presets

    build_vision_checkpoint(d, seed=11, dtype=torch.float32, indexer_n_heads=16)
    write_image_processor_config(d, presets.tiny(indexer_n_heads=16), max_pixels=MAX_PIXELS)
    if not preprocessor:
        os.remove(os.path.join(d, "preprocessor_config.json"))
    return d


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    return _build(str(tmp_path_factory.mktemp("vl_ckpt")))


@pytest.fixture(scope="class")
def vl_server(vl_ckpt, tmp_path_factory):
    """The composite checkpoint's server, for the tests of ``TestCompositeServer`` (stopped before the next server
    starts: two cores)."""
    with serve(vl_ckpt, tmp_path_factory.mktemp("vl_server"), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", str(MAX_LEN), "--max-num-seqs", "4", "--limit-mm-per-prompt", '{"image": 2}',
               port=PORT_VL) as s:
        yield s


# (images as (width, height, seed), messages with "IMG" where each image goes)
PARITY = {
    "one_image": [{"role": "user", "content": ["IMG", text_part("what is in the image")]}],
    "two_images": [{"role": "user", "content": [text_part("the first"), "IMG", text_part("and the second"), "IMG",
                                                text_part("which one is red")]}],
    "multi_turn": [{"role": "user", "content": "hello there"},
                   {"role": "assistant", "content": "the sky is blue"},
                   {"role": "user", "content": ["IMG", text_part("and this one")]}],
}
PARITY_IMAGES = {"one_image": [(40, 24, 1)], "two_images": [(30, 50, 2), (64, 64, 3)], "multi_turn": [(48, 32, 4)]}


def _fill(messages, fill):
    """``messages`` with each "IMG" replaced by ``fill(i)`` for the i-th image."""
    out, i = [], 0
    for m in messages:
        if isinstance(m["content"], str):
            out.append(m)
            continue
        parts = []
        for p in m["content"]:
            if p == "IMG":
                parts.append(fill(i))
                i += 1
            else:
                parts.append(p)
        out.append(dict(m, content=parts))
    return out


def _hf_reference(ckpt, messages, images):
    """Our HF reference (fp32) through AutoProcessor and its chat template: (prompt ids, greedy tokens)."""
    from transformers import AutoProcessor

    from qwen4exp import Qwen4ExpForConditionalGeneration

    proc = AutoProcessor.from_pretrained(ckpt)
    model = Qwen4ExpForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    msgs = _fill(messages, lambda i: {"type": "image", "image": images[i]})
    inp = proc.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True,
                                   return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inp, max_new_tokens=GEN, do_sample=False, eos_token_id=None, pad_token_id=0)
    n = inp["input_ids"].shape[1]
    return inp["input_ids"][0].tolist(), out[0, n:].tolist()


@pytest.fixture(scope="module")
def listener():
    """A TCP listener on PORT_LISTENER: a fetch of an http URL naming it would connect here."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", PORT_LISTENER))
    s.listen(8)
    s.setblocking(False)
    yield s
    s.close()


def _not_an_image():
    return "data:image/png;base64," + base64.b64encode(b"this text is not an image at all").decode()


# case -> (content parts, substrings the 400's message must hold)
BAD = {
    "http_url": (lambda: [image_part(f"http://127.0.0.1:{PORT_LISTENER}/cat.png"), text_part("what is it")],
                 ["image_url", "remote URLs", "not fetched by this server", "no network", "data URL"]),
    "https_url": (lambda: [image_part("https://images.example.com/cat.png")],
                  ["image_url", "remote URLs (https://images.example.com/...)", "not fetched", "data URL"]),
    "file_url": (lambda: [image_part("file:///etc/hostname")],
                 ["image_url", "file URLs are not read", "--allowed-local-media-path"]),
    "bad_base64": (lambda: [image_part("data:image/png;base64,@@not*base64!!"), text_part("what is it")],
                   ["image_url", "not valid base64"]),
    "not_an_image": (lambda: [image_part(_not_an_image())], ["image_url", "does not hold an image"]),
    "data_url_not_base64": (lambda: [image_part("data:image/png,rawbytes")], ["image_url", "only base64 data URLs"]),
    "data_url_without_data": (lambda: [image_part("data:image/png;base64")], ["image_url", "not a valid data URL"]),
    "image_over_max_model_len": (lambda: [image_part(png_data_url(_test_image(128, 128, 5)))],
                                 ["image_url", f"too large for max_model_len {MAX_LEN}", "1 image(s) take 256 tokens",
                                  f"at most {MAX_PIXELS} pixels", "--max-model-len"]),
    "images_over_max_model_len": (lambda: [image_part(png_data_url(_test_image(96, 96, 6))),
                                           image_part(png_data_url(_test_image(64, 64, 7)))],
                                  ["image_url", "2 image(s) take 208 tokens (144, 64)"]),
    "too_many_images": (lambda: [image_part(png_data_url(_test_image(24, 24, i))) for i in range(3)],
                        ["At most 2 image(s)"]),
}


def _test_image(*a):
    from vision_checkpoint import test_image

    return test_image(*a)


class TestCompositeServer:
    """The composite checkpoint's server: fp32, ``--max-model-len 192``, at most 2 images a prompt."""

    @pytest.mark.parametrize("case", list(PARITY))
    def test_data_url_images_match_hf_reference(self, vl_server, case):
        """Same prompt ids (the images' placeholder tokens included) and the same greedy tokens as the HF reference
        for the same PNG images and chat."""
        from vision_checkpoint import test_image

        images = [test_image(*im) for im in PARITY_IMAGES[case]]
        urls = [png_data_url(im) for im in images]
        status, body = chat(vl_server["base"], _fill(PARITY[case], lambda i: image_part(urls[i])))
        assert status == 200, body
        ids, ref = _hf_reference(vl_server["ckpt"], PARITY[case], images)
        assert body["prompt_token_ids"] == ids
        assert body["choices"][0]["token_ids"] == ref

    @pytest.mark.parametrize("case", list(BAD))
    def test_bad_images_get_4xx_and_server_keeps_serving(self, vl_server, listener, case):
        """A 400 whose message names the problem (and ``param`` the content part), then a normal request gets
        200."""
        parts, want = BAD[case]
        status, body = chat(vl_server["base"], [{"role": "user", "content": parts()}])
        msg = body.get("error", {}).get("message", "")
        print(case, status, msg)
        assert status == 400, body
        for w in want:
            assert w in msg, (case, w, msg)
        if "image_url" in want:
            assert body["error"]["param"] == "image_url", body
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected: the http URL was refused without a fetch
        assert_still_serving(vl_server["base"])

    def test_streamed_chat_with_images(self, vl_server):
        """``stream: true``: a data URL image streams the tokens of the same request unstreamed; a refused URL gets
        the 400 before any stream starts."""
        from vision_checkpoint import test_image

        msgs = [{"role": "user", "content": [image_part(png_data_url(test_image(40, 24, 1))), text_part("what")]}]
        status, body = chat(vl_server["base"], msgs)
        assert status == 200, body
        req = urllib.request.Request(vl_server["base"] + "/v1/chat/completions", headers={
            "Content-Type": "application/json"}, data=json.dumps(dict(
                model="tiny", messages=msgs, max_tokens=GEN, temperature=0, ignore_eos=True, stream=True,
                return_token_ids=True)).encode())
        toks = []
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for c in json.loads(line[6:])["choices"]:
                        toks += c.get("token_ids") or []
        assert len(toks) == GEN and toks == body["choices"][0]["token_ids"]
        bad = [{"role": "user", "content": [image_part("https://images.example.com/cat.png")]}]
        status, body = post(vl_server["base"] + "/v1/chat/completions",
                            dict(model="tiny", messages=bad, max_tokens=GEN, stream=True))
        assert status == 400 and "not fetched" in body["error"]["message"], body
        assert_still_serving(vl_server["base"])

    def test_readme_image_request_runs(self, vl_server, tmp_path):
        """docs/images.md's curl image chat request against this server, as written but for the address and the
        model name (the image file: ``.cache/tiny-vl/example.png`` under the directory it runs in). The README's
        own image quick start: tests/test_readme_commands.py."""
        from vision_checkpoint import test_image

        blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "docs" / "images.md").read_text(), flags=re.S | re.M)
        block = next(b for b in blocks if "image_url" in b and "curl" in b)
        assert block.startswith("python3 -c ") and '"model": "tiny-vl"' in block, block
        photo = tmp_path / ".cache" / "tiny-vl" / "example.png"
        photo.parent.mkdir(parents=True)
        test_image(40, 24, 1).save(photo)
        script = block.replace("http://127.0.0.1:8000", vl_server["base"]).replace('"tiny-vl"', '"tiny"')
        assert shutil.which("curl"), "the README's example uses curl"
        env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert out["choices"][0]["message"]["content"], out


def test_image_to_text_only_checkpoint_gets_4xx(tmp_path_factory):
    """tiny-coder (``Qwen4ExpForCausalLM``, no vision tower): an image gets a 400 saying so, never a 500."""
    from vision_checkpoint import test_image

    with serve(TINY_CODER, tmp_path_factory.mktemp("text_server"), "--enforce-eager", "--max-model-len", "512",
               "--max-num-seqs", "4", port=PORT_TEXT) as s:
        for url in (png_data_url(test_image(40, 24, 1)), "https://images.example.com/cat.png"):
            status, body = chat(s["base"], [{"role": "user", "content": [image_part(url), text_part("what is it")]}])
            assert status == 400, body
            assert "is not a multimodal model" in body["error"]["message"], body
            assert_still_serving(s["base"])


@pytest.fixture(scope="module")
def nopp_ckpt(tmp_path_factory):
    """The composite checkpoint without preprocessor_config.json."""
    return _build(str(tmp_path_factory.mktemp("nopp_ckpt")), preprocessor=False)


def test_plugin_refuses_composite_without_preprocessor_config(nopp_ckpt, tmp_path):
    """Plain vLLM (``LLM`` here; ``vllm serve`` takes the same config hook) with the plugin: refused while vLLM
    builds its config, naming the file, instead of transformers' traceback from the processor."""
    from vllm_offline import run_offline

    spec = dict(model=nopp_ckpt, prompts=[[2, 3]], engine=dict(dtype="float32", enforce_eager=True, max_model_len=128),
                sampling=dict(max_tokens=1))
    with pytest.raises(RuntimeError) as e:
        run_offline(spec, str(tmp_path / "run"))
    assert "CheckpointRejected" in str(e.value) and "without preprocessor_config.json" in str(e.value), str(e.value)


def test_composite_without_preprocessor_config(nopp_ckpt, tmp_path_factory):
    """``qwen4exp-serve`` refuses it at start (exit 1, one line naming the file and --language-model-only, before
    vLLM starts); with ``--language-model-only`` it serves text, and an image then gets a 400."""
    from vision_checkpoint import test_image

    d = nopp_ckpt
    work = tmp_path_factory.mktemp("nopp_server")
    env = dict(os.environ, QWEN4EXP_CACHE_DIR=str(work / "cache"), TMPDIR=str(work))
    p = subprocess.run([sys.executable, "-m", "qwen4exp.serve", d, "--port", str(PORT_NOPP)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwen4exp-serve: bad checkpoint:"), p.stderr[-3000:]
    assert "preprocessor_config.json" in lines[0] and "--language-model-only" in lines[0], lines[0]
    with serve(d, work, "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_LEN), "--max-num-seqs",
               "4", "--language-model-only", port=PORT_NOPP) as s:
        assert_still_serving(s["base"])
        status, body = chat(s["base"], [{"role": "user", "content": [image_part(png_data_url(test_image(40, 24, 1))),
                                                                    text_part("what is it")]}])
        assert status == 400, body
        assert "At most 0 image(s)" in body["error"]["message"], body
        assert_still_serving(s["base"])


@pytest.fixture()
def png_host(tmp_path):
    """An HTTP server on 127.0.0.1:18654 serving one PNG at /cat.png; yields (url, image, list of paths requested)."""
    import http.server
    import threading

    from vision_checkpoint import test_image

    img = test_image(20, 12, 7)
    data = io.BytesIO()
    img.save(data, "PNG")
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(data.getvalue())))
            self.end_headers()
            self.wfile.write(data.getvalue())

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 18654), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield "http://127.0.0.1:18654/cat.png", img, seen
    httpd.shutdown()
    httpd.server_close()


def test_connector_fetches_only_where_allowed(png_host, tmp_path):
    """The ``qwen4exp`` media connector: an http URL is refused without a request unless ``--allowed-media-domains``
    names its host (then vLLM's connector fetches it); a file URL is read only under ``--allowed-local-media-path``;
    data URLs decode."""
    from vision_checkpoint import test_image
    from vllm.exceptions import VLLMValidationError

    from qwen4exp.serving.media import LocalMediaConnector

    url, img, seen = png_host
    with pytest.raises(VLLMValidationError, match="remote URLs .* are not fetched by this server"):
        LocalMediaConnector().fetch_image(url)
    assert seen == []
    got = LocalMediaConnector(allowed_media_domains=["127.0.0.1"]).fetch_image(url)
    assert seen == ["/cat.png"] and got.size == img.size and got.tobytes() == img.tobytes()
    path = tmp_path / "dog.png"
    test_image(8, 8, 1).save(path)
    with pytest.raises(VLLMValidationError, match="file URLs are not read"):
        LocalMediaConnector().fetch_image(path.as_uri())
    assert LocalMediaConnector(allowed_local_media_path=str(tmp_path)).fetch_image(path.as_uri()).size == (8, 8)
    assert LocalMediaConnector().fetch_image(png_data_url(img)).size == img.size


def test_image_processor_config_check(tmp_path):
    """``check_image_processor_config``: a composite config needs preprocessor_config.json or a processor_config.json
    with an ``image_processor`` entry; a text-only config needs neither."""
    from qwen4exp import presets
    from qwen4exp.checkpoint import CheckpointError, check_image_processor_config

    cfg = presets.tiny()
    with pytest.raises(CheckpointError, match="without preprocessor_config.json.*--language-model-only"):
        check_image_processor_config(tmp_path, cfg)
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen4ExpProcessor"}))
    with pytest.raises(CheckpointError, match="preprocessor_config.json"):
        check_image_processor_config(tmp_path, cfg)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"patch_size": 4}}))
    check_image_processor_config(tmp_path, cfg)
    check_image_processor_config(tmp_path / "nowhere", presets.tiny_text())
