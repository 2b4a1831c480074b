"""`ringllm bench serve --dataset random-mm` against a tiny LLaVA `ringllm serve`, over
HTTP (chat, base64 PNG parts) and IPC (multi_modal_data); the text-only run of the same
prompt length; the refusals. Behaviour only, never timings."""

from __future__ import annotations

import argparse
import base64
import json
import sys

import pytest

from ringllm.tools.bench.datasets.request import SampleRequest
from ringllm.tools.bench.serve_backends import HttpBackend, image_positions
from ringllm.tools.make_model import ModelShape, make_model
from tests.tools.bench.test_serve import run_cli, serve_until_done

API_KEY = "bench-key-93a1"  # the one Served.http sends
NUM_IMAGE_TOKENS = 16
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def served_llava(tmp_path_factory):
    model_path = make_model(tmp_path_factory.mktemp("llava"), ModelShape(arch="llava"))
    log_path = tmp_path_factory.mktemp("bench_serve_images") / "server.log"
    command = [
        sys.executable, "-m", "ringllm.server.cli", str(model_path), "--port", "0",
        "--engine-process", "--api-key", API_KEY, "--dtype", "float32", "--max-model-len=512",
        "--max-num-seqs", "8", "--num-gpu-blocks-override", "512",
    ]  # fmt: skip
    yield from serve_until_done(command, model_path, log_path)


def workload(num_images: int, text_len: int) -> list[str]:
    return [
        "--dataset", "random-mm", "--num-prompts", "6", "--random-input-len", str(text_len),
        "--random-mm-num-images", str(num_images), "--random-mm-image-size", "40x30",
        "--output-len", "3", "--ignore-eos", "--max-concurrency", "3",
    ]  # fmt: skip


def run(served, tmp_path, transport: list[str], num_images: int, text_len: int) -> dict:
    out = tmp_path / f"{num_images}.json"
    assert run_cli([*transport, *workload(num_images, text_len), "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["output_lens"] == [3] * 6
    return result


def test_chat_with_images_and_text_of_the_same_length(served_llava, tmp_path, capsys):
    http = [*served_llava.http, "--endpoint", CHAT]
    images = run(served_llava, tmp_path, http, 1, 10)
    assert "Total input images:" in capsys.readouterr().out
    assert images["total_input_images"] == 6
    text = run(served_llava, tmp_path, http, 0, 10 + NUM_IMAGE_TOKENS)
    assert text["total_input_images"] == 0
    # the server's usage: the chat template's tokens + 10 + 16 image positions, each side
    assert set(images["input_lens"]) == set(text["input_lens"])
    assert len(set(images["input_lens"])) == 1 and images["input_lens"][0] > 10 + 16


def test_ipc_carries_the_images(served_llava, tmp_path):
    result = run(served_llava, tmp_path, ["--ipc", served_llava.instance], 2, 7)
    assert result["total_input_images"] == 12
    assert result["input_lens"] == [7 + 2 * NUM_IMAGE_TOKENS] * 6  # no template over IPC


def test_images_to_the_completions_endpoint_fail_before_connecting(served_llava):
    with pytest.raises(ValueError, match=f"takes no images.*--endpoint {CHAT}"):
        run_cli([*served_llava.http, *workload(1, 4)])


def test_chat_body_has_the_text_then_each_image_as_a_data_url(served_llava):
    args = argparse.Namespace(
        endpoint=CHAT, base_url="http://x", model="m", tokenizer=None, api_key=None,
        temperature=0.0, ignore_eos=True, request_timeout=1.0,
    )  # fmt: skip
    backend = HttpBackend(args)
    request = SampleRequest("hello", 5, 3, (b"\x89PNG-one", b"\x89PNG-two"))
    (message,) = backend.body(request)["messages"]
    text, *parts = message["content"]
    assert text == {"type": "text", "text": "hello"}
    urls = [part["image_url"]["url"] for part in parts]
    assert [p["type"] for p in parts] == ["image_url", "image_url"]
    prefix = "data:image/png;base64,"
    assert all(u.startswith(prefix) for u in urls)
    assert [base64.b64decode(u[len(prefix) :]) for u in urls] == list(request.images)
    assert backend.body(SampleRequest("hi", 2, 3))["messages"][0]["content"] == "hi"
    assert image_positions(str(served_llava.model_path)) == NUM_IMAGE_TOKENS
    assert image_positions("/nonexistent") == 0
