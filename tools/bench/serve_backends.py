"""The two ways `ringllm bench serve` reaches an engine, and what it records per request.

    HttpBackend  an OpenAI-compatible server: POST with `"stream": true` and
                 `stream_options.include_usage`, SSE read line by line with aiohttp;
                 a request's images go as chat content parts (base64 PNG data URLs)
                 after its text, as vLLM's benchmark sends them (chat endpoint only).
                 The same load goes to OpenAI's Responses API (`/v1/responses`: a
                 token per output_text delta, usage from response.completed) or
                 Anthropic's Messages API (`/v1/messages`: per text_delta, usage from
                 message_start and message_delta), to compare the APIs on one engine
    IpcBackend   ringllm's shared-memory `Client` (one per engine instance, round-robin),
                 `RequestOutputKind.DELTA` so each output carries only its new tokens;
                 images as `multi_modal_data` after one image token each before the text
                 (decoded and preprocessed by the client's front end, as a server would)

Both expose `tokenizer` (what the datasets draw prompts from), `num_image_tokens` (the
positions one image fills; 0: a text-only model) and
`async send(request, clock) -> RequestResult`, which never raises: a failure of any kind
(HTTP status, an error event in the stream, a refused prompt, a dead engine) comes back
as the result's `error`, so the benchmark counts it instead of losing it.
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from ringllm.tools.bench.datasets.request import SampleRequest

COMPLETIONS_ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"
RESPONSES_ENDPOINT = "/v1/responses"
MESSAGES_ENDPOINT = "/v1/messages"
ENDPOINTS = (COMPLETIONS_ENDPOINT, CHAT_ENDPOINT, RESPONSES_ENDPOINT, MESSAGES_ENDPOINT)
DEFAULT_REQUEST_TIMEOUT_S = 600.0
MAX_ERROR_CHARS = 300


class RequestFailed(Exception):
    """A failure this module describes itself (status, error event, cut stream): its
    message is shown as it is, where other exceptions are prefixed with their type."""


@dataclass
class RequestResult:
    """One request as the client saw it; every time is seconds since the benchmark began."""

    prompt_len: int  # tokens: the server's usage count when it gave one, else the dataset's
    expected_output_len: int  # tokens asked for (max_tokens)
    start_s: float = 0.0  # sent (after its arrival time and a concurrency slot)
    end_s: float = 0.0  # stream finished, or the request failed
    output_len: int = 0  # tokens received
    num_images: int = 0  # images sent with the prompt
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk (HTTP: 1 each)
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else 0.0

    @property
    def itls_s(self) -> list[float]:
        return np.diff(self.chunk_times_s).tolist()

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Decode time per token after the first; undefined for a single-token output."""
        if self.output_len < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_len - 1)

    def add_chunk(self, now_s: float, num_tokens: int) -> None:
        self.chunk_times_s.append(now_s)
        self.chunk_tokens.append(num_tokens)


class Clock:
    """Seconds since the benchmark began (perf_counter: monotonic, high resolution)."""

    def __init__(self) -> None:
        self.origin_s = time.perf_counter()

    def now_s(self) -> float:
        return time.perf_counter() - self.origin_s


# ---- backends ------------------------------------------------------------------------


class HttpBackend:
    """Streams each request from an OpenAI-compatible server over SSE (aiohttp)."""

    def __init__(self, args: argparse.Namespace) -> None:
        if args.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint: {args.endpoint!r} is not one of {', '.join(ENDPOINTS)}")
        self.base_url = args.base_url.rstrip("/")
        self.url = self.base_url + args.endpoint
        self.endpoint = args.endpoint
        self.chat = args.endpoint == CHAT_ENDPOINT
        self.model: str | None = args.model
        self.tokenizer_path: str | None = args.tokenizer
        self.tokenizer = None
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.sampling = {"temperature": args.temperature}
        if args.ignore_eos:
            self.sampling["ignore_eos"] = True
        self.timeout_s = args.request_timeout
        self.session = None
        self.num_image_tokens = 0

    async def __aenter__(self) -> HttpBackend:
        # limit=0: no connection cap of aiohttp's own; --max-concurrency is the only cap.
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            # NOTE: a fresh connection per request: llama-server closes kept-alive ones, and a
            # request written into a closing connection fails ("Can not write request body")
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
        )
        try:
            if self.model is None:
                self.model = await self._first_served_model()
            self.tokenizer = load_tokenizer(self.tokenizer_path or self.model)
            self.num_image_tokens = image_positions(self.tokenizer_path or self.model)
        except BaseException:
            await self.session.close()
            raise
        return self

    async def _first_served_model(self) -> str:
        url = self.base_url + "/v1/models"
        async with self.session.get(url, headers=self.headers) as response:
            text = await response.text()
            if response.status != 200:
                raise ValueError(
                    f"base_url: GET {url} answered {response.status} ({error_message(text)}); "
                    "check the URL and --api-key, or pass --model"
                )
        models = json.loads(text).get("data") or []
        if not models:
            raise ValueError(f"base_url: GET {url} lists no model; pass --model")
        return models[0]["id"]

    async def __aexit__(self, *exc_info) -> None:
        await self.session.close()

    def body(self, request: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True}
        if self.endpoint in (RESPONSES_ENDPOINT, MESSAGES_ENDPOINT):
            if request.images:
                raise ValueError(f"endpoint: this benchmark sends images to {CHAT_ENDPOINT} only")
            prompt = request.prompt
            if not isinstance(prompt, str):
                prompt = self.tokenizer.decode(prompt)
            if self.endpoint == RESPONSES_ENDPOINT:
                body |= {"input": prompt, "max_output_tokens": request.expected_output_len}
            else:
                body["messages"] = [{"role": "user", "content": prompt}]
                body["max_tokens"] = request.expected_output_len
            return body | self.sampling
        body["stream_options"] = {"include_usage": True}
        if self.chat:
            # NOTE: chat takes text; a token-id prompt is decoded, and the server's usage
            # then counts the prompt as the chat template renders it.
            prompt = request.prompt
            if not isinstance(prompt, str):
                prompt = self.tokenizer.decode(prompt)
            content: str | list[dict[str, Any]] = prompt
            if request.images:
                content = [{"type": "text", "text": prompt}] + [
                    {"type": "image_url", "image_url": {"url": png_data_url(png)}}
                    for png in request.images
                ]
            body["messages"] = [{"role": "user", "content": content}]
            body["max_completion_tokens"] = request.expected_output_len
        else:
            if request.images:
                raise ValueError(
                    f"endpoint: {COMPLETIONS_ENDPOINT} takes no images; send the image "
                    f"dataset with --endpoint {CHAT_ENDPOINT}"
                )
            body["prompt"] = request.prompt
            body["max_tokens"] = request.expected_output_len
        return body | self.sampling

    async def send(self, request: SampleRequest, clock: Clock) -> RequestResult:
        result = RequestResult(request.prompt_len, request.expected_output_len)
        result.num_images = len(request.images)
        result.start_s = clock.now_s()
        try:
            async with self.session.post(
                self.url, json=self.body(request), headers=self.headers
            ) as response:
                if response.status != 200:
                    text = await response.text()
                    raise RequestFailed(f"HTTP {response.status}: {error_message(text)}")
                await self._read_stream(response, result, clock)
        except Exception as exc:  # counted and shown, never dropped
            result.error = describe_error(exc)
        result.end_s = clock.now_s()
        return result

    async def _read_stream(self, response, result: RequestResult, clock: Clock) -> None:
        if self.endpoint in (RESPONSES_ENDPOINT, MESSAGES_ENDPOINT):
            return await self._read_events(response, result, clock)
        usage = None
        async for raw_line in response.content:
            line = raw_line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, SSE comments
            payload = line[len(b"data:") :].strip()
            if payload == b"[DONE]":
                break
            now_s = clock.now_s()
            data = json.loads(payload)
            if "error" in data:
                raise RequestFailed(f"error in stream: {error_message(data)}")
            if self._carries_output(data.get("choices")):
                result.add_chunk(now_s, 1)
            usage = data.get("usage") or usage
        else:
            raise RequestFailed(
                f"the stream ended without [DONE] after {len(result.chunk_times_s)} chunks"
            )
        result.output_len = sum(result.chunk_tokens)
        if usage:
            result.output_len = usage.get("completion_tokens", result.output_len)
            result.prompt_len = usage.get("prompt_tokens", result.prompt_len)

    async def _read_events(self, response, result: RequestResult, clock: Clock) -> None:
        """A Responses or Messages stream: typed events, no [DONE]; the last event says
        the stream is whole."""
        responses = self.endpoint == RESPONSES_ENDPOINT
        ends = {"response.completed", "response.incomplete"} if responses else {"message_stop"}
        ended = False
        async for raw_line in response.content:
            line = raw_line.strip()
            if not line.startswith(b"data:"):
                continue  # event names, blank separators
            now_s = clock.now_s()
            data = json.loads(line[len(b"data:") :].strip())
            kind = data.get("type")
            if kind in ("error", "response.failed"):
                raise RequestFailed(f"error in stream: {error_message(json.dumps(data))}")
            if kind == "response.output_text.delta" or (
                kind == "content_block_delta" and data["delta"].get("type") == "text_delta"
            ):
                result.add_chunk(now_s, 1)
            elif kind in ends and responses:
                usage = data["response"].get("usage") or {}
                result.output_len = usage.get("output_tokens", sum(result.chunk_tokens))
                result.prompt_len = usage.get("input_tokens", result.prompt_len)
            elif kind == "message_start":
                usage = data["message"].get("usage") or {}
                result.prompt_len = usage.get("input_tokens", result.prompt_len)
            elif kind == "message_delta":
                result.output_len = data.get("usage", {}).get("output_tokens", 0)
            ended = ended or kind in ends
        if not ended:
            raise RequestFailed(
                f"the stream ended before its last event after {len(result.chunk_times_s)} chunks"
            )

    def _carries_output(self, choices: list | None) -> bool:
        """Completions: every chunk with a choice is a token (as vLLM counts them); chat:
        only chunks with content (the first chunk carries just the role)."""
        if not choices:
            return False
        if not self.chat:
            return True
        return bool(choices[0].get("delta", {}).get("content"))


class IpcBackend:
    """Sends each request through ringllm's IPC client; several instances round-robin."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.instance_names = [n.strip() for n in args.ipc.split(",") if n.strip()]
        if not self.instance_names:
            raise ValueError(f"ipc: {args.ipc!r} names no engine instance")
        self.ignore_eos = args.ignore_eos
        self.temperature = args.temperature
        self.clients: list = []
        self._turns = itertools.count()

    def connect(self) -> None:
        from ringllm.pipeline.frontend.client import Client

        try:
            for name in self.instance_names:
                self.clients.append(Client.connect(name))
        except BaseException:
            self.close()  # the clients already made own output rings: release them
            raise

    @property
    def tokenizer(self):
        return self.clients[0].tokenizer

    @property
    def model(self) -> str:
        """The model folder the (first) engine serves."""
        return str(self.clients[0].core.info.model_path)

    @property
    def num_image_tokens(self) -> int:
        return self.clients[0].core.info.num_image_tokens

    def prompt_of(self, request: SampleRequest) -> Any:
        """What the client takes: the prompt itself, or with images one image token per
        image before the text (vLLM's placeholders-before-text form) and the images."""
        if not request.images:
            return request.prompt
        info = self.clients[0].core.info
        if not info.takes_images:
            raise ValueError(
                f"dataset: {info.model_path} takes no images; send a text dataset, or "
                "--random-mm-num-images 0"
            )
        if not isinstance(request.prompt, str):
            raise ValueError("prompt: images go with a text prompt here")
        from PIL import Image

        (image_text,) = self.tokenizer.convert_ids_to_tokens([info.image_token_id])
        # Image.open only reads the header: the client's front end decodes on its pool
        images = [Image.open(io.BytesIO(png)) for png in request.images]
        return {
            "prompt": image_text * len(images) + request.prompt,
            "multi_modal_data": {"image": images},
        }

    async def __aenter__(self) -> IpcBackend:
        self.connect()
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.clients = []

    async def send(self, request: SampleRequest, clock: Clock) -> RequestResult:
        from ringllm.pipeline.sampling_params import RequestOutputKind, SamplingParams

        result = RequestResult(request.prompt_len, request.expected_output_len)
        result.num_images = len(request.images)
        client = self.clients[next(self._turns) % len(self.clients)]
        result.start_s = clock.now_s()
        try:
            prompt = self.prompt_of(request)
            params = SamplingParams(
                max_tokens=request.expected_output_len,
                ignore_eos=self.ignore_eos,
                temperature=self.temperature,
                output_kind=RequestOutputKind.DELTA,
            )
            async for out in client.agenerate(prompt, params):
                num_tokens = sum(len(c.token_ids) for c in out.outputs)
                if num_tokens:
                    result.add_chunk(clock.now_s(), num_tokens)
                result.prompt_len = len(out.prompt_token_ids)
        except Exception as exc:  # counted and shown, never dropped
            result.error = describe_error(exc)
        result.output_len = sum(result.chunk_tokens)
        result.end_s = clock.now_s()
        return result


def error_message(text: str | dict) -> str:
    """The message of an OpenAI error body, else the text itself (shortened)."""
    data = text
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except ValueError:
            return text[:MAX_ERROR_CHARS]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(data)[:MAX_ERROR_CHARS]


def describe_error(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, RequestFailed):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def png_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def image_positions(name: str) -> int:
    """The positions one image fills in the prompts of the model folder `name` (its
    config.json, as the engine reads it); 0 for a text-only model or no folder here."""
    from ringllm.pipeline.models.hf_config import load_arch_config
    from ringllm.pipeline.worker.worker import image_fields

    folder = Path(name).expanduser()
    if not (folder / "config.json").is_file():
        return 0
    try:
        return image_fields(load_arch_config(folder))[1]
    except ValueError:  # a model ringllm cannot load (another server's): unknown
        return 0


def load_tokenizer(name: str):
    """The tokenizer of an HF model folder; the served name works when it is one here (a
    server started with --served-model-name PATH) or when it is the demo model's name.
    ringllm names a model by its folder's name, not its path, so pass --tokenizer."""
    from ringllm.pipeline.frontend.tokenizer import Tokenizer
    from ringllm.pipeline.models.demo_model import DEMO_MODEL_NAME, demo_model_path

    folder = Path(name).expanduser()
    if not folder.is_dir() and name == DEMO_MODEL_NAME:
        folder = demo_model_path(fetch=False)
    if not folder.is_dir():
        raise ValueError(
            f"tokenizer: {name!r} is not a model folder here; pass --tokenizer with the "
            "served model's HF folder (the datasets need its vocabulary)"
        )
    return Tokenizer.from_folder(folder)
