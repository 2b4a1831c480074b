"""Images through `ringllm serve` with the official `openai` client: a tiny LLaVA answers
a chat with base64 images as the offline engine does (and that as transformers does), and
every bad image, source or count is a 400 naming it, after which the server still serves.

Two LLaVA servers: "locked" (the media defaults: data: URLs only; the engine core in a
thread of the server) and "open" (--allowed-local-media-path and --allowed-media-domains
127.0.0.1, the core in its own process). Images fetched over http come from a local
http.server on 127.0.0.1, never the internet.
"""

from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from ringllm.pipeline import LLM, SamplingParams
from ringllm.tools.make_model import ModelShape, make_model
from tests.pipeline.frontend.test_image_inputs import png_declaring
from tests.server.conftest import API_KEY, ENGINE_KWARGS, _flags, launched

MODEL = "tiny-llava"
LIMIT = 2
MAX_PIXELS = 1 << 16  # 256 x 256
FETCH_TIMEOUT_S = 1.0
NUM_NEW = 16
GREEDY = {"temperature": 0, "max_tokens": NUM_NEW, "extra_body": {"ignore_eos": True}}


def picture(seed: int, size=(48, 40)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png_of(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


FIRST, SECOND = picture(1), picture(2, size=(30, 64))
FIRST_PNG = png_of(FIRST)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(*images: str, text: str = "What is in the picture?") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [*(image_part(u) for u in images), {"type": "text", "text": text}],
        }
    ]


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llava_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llava") / "llava", ModelShape(arch="llava"))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """(the allowed folder, a folder beside it), each holding FIRST as first.png."""
    root = tmp_path_factory.mktemp("media")
    for name in ("allowed", "outside"):
        (root / name).mkdir()
        (root / name / "first.png").write_bytes(FIRST_PNG)
    return root / "allowed", root / "outside"


class _ImageHost(BaseHTTPRequestHandler):
    stop = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/slow.png":  # headers later than the server's fetch timeout
            self.stop.wait(3 * FETCH_TIMEOUT_S)
            self.close_connection = True
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(FIRST_PNG)))
        self.end_headers()
        self.wfile.write(FIRST_PNG)


@pytest.fixture(scope="module")
def image_host():
    """The port of a local server answering /first.png (FIRST) and /slow.png (too late)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHost)
    httpd.daemon_threads = True
    _ImageHost.stop.clear()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    _ImageHost.stop.set()
    httpd.shutdown()
    httpd.server_close()


def _serve(model, log_dir, *flags):
    args = [
        str(model), "--port", "0", "--api-key", API_KEY, "--served-model-name", MODEL,
        "--limit-mm-per-prompt", json.dumps({"image": LIMIT}),
        "--max-image-pixels", str(MAX_PIXELS), *flags, *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    return launched(args, log_dir)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def locked(llava_model, tmp_path_factory):
    with _serve(llava_model, tmp_path_factory.mktemp("locked"), "--no-engine-process") as (
        _,
        url,
        _log,
    ):
        with _client(url) as client:
            yield client


@pytest.fixture(scope="module")
def opened(llava_model, media, tmp_path_factory):
    allowed, _ = media
    flags = [
        "--engine-process", "--allowed-local-media-path", str(allowed),
        "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout-s", str(FETCH_TIMEOUT_S),
    ]  # fmt: skip
    with _serve(llava_model, tmp_path_factory.mktemp("open"), *flags) as (_, url, _log):
        with _client(url) as client:
            yield client


@pytest.fixture(scope="module")
def offline(llava_model):
    llm = LLM(llava_model, **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


def chat_text(client, messages, stream=False) -> tuple[str, object]:
    """The greedy answer's text and usage (streamed: the deltas joined)."""
    if not stream:
        resp = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
        return resp.choices[0].message.content, resp.usage
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    text, usage = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    return text, usage


def refused(client, messages, match: str, endpoint: str = "chat", starts: str = "") -> None:
    """A 400 in OpenAI's error shape whose message holds `match` (and starts with `starts`)."""
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        else:
            client.completions.create(model=MODEL, prompt=messages, max_tokens=2)
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error", error
    assert error["param"] in ("messages", "prompt"), error
    assert match in error["message"] and error["message"].startswith(starts), error["message"]


def still_serves(client) -> None:
    text, usage = chat_text(client, ask(data_url(FIRST_PNG)))
    assert usage.completion_tokens == NUM_NEW and text


# -- answers ------------------------------------------------------------------------------


def test_a_base64_image_chat_equals_offline_and_transformers(locked, offline, llava_model):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    messages = ask(data_url(FIRST_PNG), text="Describe it.")
    served, usage = chat_text(locked, messages)
    streamed, stream_usage = chat_text(locked, messages, stream=True)
    pil_messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": FIRST},
                {"type": "text", "text": "Describe it."},
            ],
        }
    ]
    (out,) = offline.chat(
        pil_messages,
        SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True),
        use_tqdm=False,
    )
    assert served == streamed == out.outputs[0].text
    assert usage.prompt_tokens == stream_usage.prompt_tokens == len(out.prompt_token_ids)

    processor = AutoProcessor.from_pretrained(llava_model)
    hf = LlavaForConditionalGeneration.from_pretrained(llava_model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}
    ]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(FIRST_PNG))], return_tensors="pt")
    with torch.no_grad():
        tokens = hf.generate(**inputs, max_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0)
    assert out.prompt_token_ids == inputs.input_ids[0].tolist()
    assert out.outputs[0].token_ids == tokens[0, inputs.input_ids.shape[1] :].tolist()


def test_two_images_and_their_order(locked, offline):
    first, second = data_url(FIRST_PNG), data_url(png_of(SECOND))
    both, usage = chat_text(locked, ask(first, second))
    swapped, _ = chat_text(locked, ask(second, first))
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    (out,) = offline.chat(ask(first, second), params, use_tqdm=False)
    assert both == out.outputs[0].text and usage.prompt_tokens == len(out.prompt_token_ids)
    assert swapped != both  # the images are not interchangeable: their order reaches the model


def tokenize(client, messages) -> tuple[int, dict]:
    """vLLM's /tokenize (not in the openai client) on the client's server."""
    url = str(client.base_url).removesuffix("v1/") + "tokenize"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    resp = httpx.post(url, json={"model": MODEL, "messages": messages}, headers=headers)
    return resp.status_code, resp.json()


def test_tokenize_counts_the_image_positions(locked, offline):
    messages = ask(data_url(FIRST_PNG), data_url(png_of(SECOND)))
    status, body = tokenize(locked, messages)
    (out,) = offline.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    assert status == 200
    assert body["tokens"] == out.prompt_token_ids and body["count"] == len(out.prompt_token_ids)
    status, body = tokenize(locked, ask(*[data_url(FIRST_PNG)] * (LIMIT + 1)))
    assert status == 400 and "3 images; at most 2 per prompt" in body["error"]["message"]


# -- refusals ------------------------------------------------------------------------------


def test_bad_images_are_400s_and_the_server_goes_on(locked):
    corrupt = bytearray(FIRST_PNG)
    corrupt[60:90] = b"\0" * 30
    cases = [
        (data_url(b"hello, this is text, not an image"), "not an image in a supported format"),
        (data_url(FIRST_PNG[:-200]), "truncated or corrupt"),
        (data_url(bytes(corrupt)), "truncated or corrupt"),
        (data_url(png_declaring(300, 300)), f"past the limit of {MAX_PIXELS} pixels"),
        ("data:text/plain;base64,aGk=", "not an image type"),
        ("file:///etc/passwd", "local files are not allowed on this server"),
        ("http://127.0.0.1:9/first.png", "http URLs are not allowed on this server"),
        ("ftp://127.0.0.1/first.png", "scheme 'ftp' is not supported"),
    ]
    for url, why in cases:
        refused(locked, ask(url), why, starts="messages[0].content[0].image_url: ")
    still_serves(locked)


def test_counts_and_shapes_are_400s(locked):
    image = data_url(FIRST_PNG)
    refused(
        locked,
        ask(*[image] * (LIMIT + 1)),
        "messages: 3 images; at most 2 per prompt (--limit-mm-per-prompt)",
    )
    refused(
        locked,
        ask(image, text="and <image> too"),
        "holds 2 image token(s) ('<image>') for 1 image(s)",
    )
    bad_shapes = [
        ({"type": "image_url", "image_url": 5}, "content[0].image_url: must be an object"),
        ({"type": "image_url", "image_url": {"uri": image}}, "unknown field(s) ['uri']"),
        (
            {"type": "image_url", "image_url": {"url": ""}},
            "content[0].image_url.url: must be a non-empty",
        ),
        (
            {"type": "image_url", "image_url": {"url": image, "detail": "max"}},
            "detail: must be one of auto, low, high",
        ),
        ({"type": "image_pil", "image_pil": image}, "content[0].image_pil: expected a PIL image"),
        (
            {"type": "input_audio", "input_audio": {}},
            "content part type 'input_audio' is not supported",
        ),
    ]
    for part, why in bad_shapes:
        refused(locked, [{"role": "user", "content": [part]}], why)
    # vLLM's short form (the URL as a string) and OpenAI's detail are accepted
    for part in (
        {"type": "image_url", "image_url": image},
        {"type": "image_url", "image_url": {"url": image, "detail": "low"}},
    ):
        resp = locked.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [part]}], max_tokens=2
        )
        assert resp.choices[0].finish_reason == "length"
    # /v1/completions takes no images (as vLLM): a placeholder in its text has no image
    refused(locked, "<image> what is it?", "prompt: holds 1 image token(s)", endpoint="completions")
    with pytest.raises(openai.BadRequestError, match="multi_modal_data"):
        locked.completions.create(
            model=MODEL,
            prompt="hi",
            max_tokens=2,
            extra_body={"multi_modal_data": {"image": image}},
        )
    still_serves(locked)


def test_local_files_only_under_the_allowed_folder(opened, media):
    allowed, outside = media
    by_data, _ = chat_text(opened, ask(data_url(FIRST_PNG)))
    by_file, _ = chat_text(opened, ask((allowed / "first.png").as_uri()))
    assert by_file == by_data
    refused(
        opened,
        ask((outside / "first.png").as_uri()),
        "is outside the folder --allowed-local-media-path allows",
    )
    refused(
        opened, ask((allowed / ".." / "outside" / "first.png").as_uri()), "is outside the folder"
    )
    refused(opened, ask((allowed / "missing.png").as_uri()), "cannot open")
    still_serves(opened)


def test_http_only_from_the_allowed_domains(opened, image_host):
    by_data, _ = chat_text(opened, ask(data_url(FIRST_PNG)))
    by_http, _ = chat_text(opened, ask(f"http://127.0.0.1:{image_host}/first.png"))
    assert by_http == by_data
    refused(
        opened,
        ask(f"http://localhost:{image_host}/first.png"),
        "host 'localhost' is not one this server fetches images from (--allowed-media-domains)",
    )
    refused(
        opened,
        ask(f"http://127.0.0.1:{image_host}/slow.png"),
        f"took longer than {FETCH_TIMEOUT_S} s",
    )
    still_serves(opened)


def test_an_image_to_a_text_only_model_is_a_400(server):
    with openai.OpenAI(
        base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=60
    ) as client:
        messages = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "look"}, image_part(data_url(FIRST_PNG))],
            }
        ]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=2)
        assert (
            "messages[0].content[1]: content part type 'image_url' is not supported; this model does not take images"
            in info.value.body["message"]
        )
        resp = client.chat.completions.create(
            model=server.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert resp.choices[0].finish_reason == "length"
