"""The third hostile round, the HTTP server's part (issue 30): long tool lists that must not
stall the event loop, client mistakes that must be 400s (never 500s) wherever they hide,
header bytes that must not flood the log, and slow bodies that must not lock anyone out.

One server of its own (`hostile`): a concurrency limit of 4 and a body deadline of 2 s, so
that a handful of slow sockets is past the limit and the deadline comes quickly.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import aiohttp
import openai
import pytest

from ringllm.pipeline.structured import grammar
from tests.server.conftest import API_KEY, ENGINE_KWARGS, MODEL_NAME, _flags, launched

MAX_CONCURRENT = 4
BODY_TIMEOUT_S = 2
USER = [{"role": "user", "content": "hi"}]


class Hostile:
    def __init__(self, url: str, log_path) -> None:
        self.url, self.log_path = url, log_path
        self.host, self.port = "127.0.0.1", int(url.rsplit(":", 1)[1])

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def raw(self, request: bytes, timeout_s: float = 10.0) -> bytes:
        """Sends `request` as it is; returns what the server answered until it closed."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(request)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), timeout_s)
        finally:
            writer.close()


@pytest.fixture(scope="module")
def hostile(server_model, tmp_path_factory):
    args = [
        str(server_model), "--port", "0", "--api-key", API_KEY, "--served-model-name", MODEL_NAME,
        "--chat-template", "hermes",
        "--max-concurrent-requests", str(MAX_CONCURRENT),
        "--body-read-timeout-s", str(BODY_TIMEOUT_S), *_flags(ENGINE_KWARGS),
        "--max-tools", "200",  # the long tool lists below are past the default 128
    ]  # fmt: skip
    with launched(args, tmp_path_factory.mktemp("hostile3")) as (_, url, log_path):
        yield Hostile(url, log_path)


def post_bytes(path: str, body: bytes, authorization: bytes = b"Bearer " + API_KEY.encode()):
    return (
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Authorization: " + authorization + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    ) + body


def tool_list(num_tools: int, num_params: int) -> list[dict]:
    """Distinct tools (a fresh word in every description: no cache has seen them)."""
    fresh = uuid.uuid4().hex
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"tool {i}",
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"p{j}": {"type": "string", "description": f"{fresh} {j} of tool {i}"}
                        for j in range(num_params)
                    },
                    "required": ["p0"],
                },
            },
        }
        for i in range(num_tools)
    ]


def nested_object_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def assert_400(caught, param: str | None, words: str) -> None:
    error = caught.value.body
    assert caught.value.status_code == 400
    assert error["type"] == "invalid_request_error", error
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param, error


# ---- tool lists ----------------------------------------------------------------------


def test_health_answers_while_a_long_tool_list_is_checked(hostile):
    """150 tools of 50 parameters: seconds of meta-validation (2-16 ms a schema), which
    once ran on the event loop and froze /health for all of it."""
    tools = tool_list(150, 50)

    async def run():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            body = {"messages": USER, "max_tokens": 1, "tools": tools, "tool_choice": "none"}
            chat = asyncio.ensure_future(http.post(hostile.url + "/v1/chat/completions", json=body))
            latencies = []
            while not chat.done():
                start = time.monotonic()
                async with http.get(hostile.url + "/health") as r:
                    assert r.status == 200
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(0.05)
            response = await chat
            return response.status, await response.json(), latencies

    status, body, latencies = asyncio.run(run())
    # the tools' JSON is far past the tiny model's context: a 400 once they are checked
    assert status == 400 and body["error"]["param"] == "messages", body
    assert max(latencies) < 1.0, f"/health took {max(latencies):.2f} s while tools were checked"
    assert len(latencies) >= 3, "the request ended before /health was asked"


def test_required_over_a_long_tool_list_is_a_400(hostile):
    """The grammar that enforces "required" holds every tool's schema: past the 256 KiB a
    spec may have, a 400 naming tool_choice, at once (before any schema is checked)."""
    with pytest.raises(openai.BadRequestError) as caught:
        hostile.client(timeout=30).chat.completions.create(
            model=MODEL_NAME, messages=USER, max_tokens=4, tools=tool_list(150, 50),
            tool_choice="required",
        )  # fmt: skip
    assert_400(caught, "tool_choice", "more than the 262144")


def test_each_distinct_schema_is_checked_once():
    schema = nested_object_schema(3) | {"description": uuid.uuid4().hex}
    before = grammar._schema_problem.cache_info()
    grammar.check_json_schema(schema, "tools[0].function.parameters")
    grammar.check_json_schema(json.loads(json.dumps(schema)), "tools[7].function.parameters")
    after = grammar._schema_problem.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)


# ---- deep nesting and bad text: 400s -------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested_object_schema(150)}}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": nested_object_schema(150)}}]},
        {"structured_outputs": {"json": nested_object_schema(150)}},
        {"logit_bias": {"1": json.loads("[" * 150 + "]" * 150)}},
        {"metadata": json.loads("[" * 150 + "]" * 150)},
    ],
    ids=["response_format", "tool-parameters", "structured_outputs", "logit_bias", "other-field"],
)  # fmt: skip
def test_deep_nesting_anywhere_is_a_400(hostile, extra):
    with pytest.raises(openai.BadRequestError) as caught:
        hostile.client().chat.completions.create(
            model=MODEL_NAME, messages=USER, max_tokens=4, extra_body=extra
        )
    assert_400(caught, None, "too deeply")


def test_deep_content_parts_are_a_400(hostile):
    deep = json.loads("[" * 150 + '"hi"' + "]" * 150)
    with pytest.raises(openai.BadRequestError) as caught:
        hostile.client().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": [{"type": "text", "text": deep}]}],
            max_tokens=4,
        )  # fmt: skip
    assert_400(caught, None, "too deeply")


def test_schema_check_past_pythons_recursion_is_a_value_error():
    """Offline callers (LLM with structured outputs) have no body limit in front of the
    check: a schema too deep for jsonschema's meta-check is a ValueError, as any bad one."""
    deep: dict = {"type": "string"}
    for _ in range(400):
        deep = {"not": deep}
    with pytest.raises(ValueError, match="nests too deeply"):
        grammar.check_json_schema(deep, "structured_outputs.json")


def history_with_arguments(arguments: str) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]


@pytest.mark.parametrize(
    "arguments, words",
    [
        ("[" * 100_000 + "]" * 100_000, "too deeply"),
        ('{"city": "\\ud800"}', "lone UTF-16 surrogate"),
        ('{"n": NaN}', "not valid JSON"),
    ],
    ids=["nested-100000", "lone-surrogate", "nan"],
)
def test_bad_tool_call_arguments_are_a_400(hostile, arguments, words):
    with pytest.raises(openai.BadRequestError) as caught:
        hostile.client().chat.completions.create(
            model=MODEL_NAME, messages=history_with_arguments(arguments), max_tokens=4
        )
    assert_400(caught, "messages", words)
    assert "messages[1].tool_calls[0].function.arguments" in caught.value.body["message"]


@pytest.mark.parametrize("arguments", ["[" * 100_000 + "]" * 100_000, '{"city": "\\ud800"}'])
def test_bad_tool_call_arguments_are_a_400_for_tokenize_too(hostile, arguments):
    body = json.dumps({"messages": history_with_arguments(arguments)}).encode()
    answer = asyncio.run(hostile.raw(post_bytes("/tokenize", body)))
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["param"] == "messages" and "arguments" in error["message"], error


def test_lone_surrogates_are_refused_alike_in_arguments_and_content(hostile):
    # JSON's escape, as no client library sends it (they refuse to encode a lone surrogate)
    body = b'{"messages": [{"role": "user", "content": "a \\ud800 b"}], "max_tokens": 4}'
    answer = asyncio.run(hostile.raw(post_bytes("/v1/chat/completions", body)))
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert "lone UTF-16 surrogate" in error["message"], error


def test_good_tool_call_arguments_still_render(hostile):
    out = hostile.client().chat.completions.create(
        model=MODEL_NAME, messages=history_with_arguments('{"city": "Zürich"}'), max_tokens=2
    )
    assert out.choices[0].finish_reason in ("length", "stop")


# ---- bytes a client may send: never a traceback --------------------------------------


def test_authorization_that_is_not_utf8_is_a_401_without_a_traceback(hostile):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    log_lines = len(hostile.log().splitlines())

    async def run():
        return [
            await hostile.raw(post_bytes("/v1/completions", body, b"Bearer \xff\xfe" + bytes([i])))
            for i in range(0x80, 0x94)
        ]

    for answer in asyncio.run(run()):
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_api_key"
    new = hostile.log().splitlines()[log_lines:]
    assert "Traceback" not in "\n".join(new)
    assert len(new) <= 20, new  # the access log's line each, nothing more


def test_a_malformed_request_line_is_logged_in_one_line(hostile):
    log_lines = len(hostile.log().splitlines())
    answer = asyncio.run(hostile.raw(b"GET /health?x=\xff HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
    assert answer.split(b"\r\n")[0].endswith(b"400 Bad Request")
    time.sleep(0.2)  # the log line is written after the answer
    new = hostile.log().splitlines()[log_lines:]
    assert "Traceback" not in "\n".join(new)
    assert len(new) <= 2 and any("malformed HTTP request" in line for line in new), new


# ---- slow bodies ---------------------------------------------------------------------


def test_slow_bodies_do_not_lock_anyone_out(hostile):
    """Twice the concurrency limit of clients that send a few bytes of their body and
    then nothing: a normal request is served at once, and each slow one gets its 408 at
    the deadline, its connection closed."""

    async def run():
        slow = []
        for _ in range(2 * MAX_CONCURRENT):
            reader, writer = await asyncio.open_connection(hostile.host, hostile.port)
            head = post_bytes("/v1/completions", b"x" * 1000).split(b"\r\n\r\n")[0]
            writer.write(head + b'\r\n\r\n{"pro')
            await writer.drain()
            slow.append((reader, writer))
        opened = time.monotonic()
        await asyncio.sleep(0.3)  # every slow one's headers are in
        async with openai.AsyncOpenAI(
            base_url=hostile.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30
        ) as client:
            out = await client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        served_s = time.monotonic() - opened
        answers = []
        for reader, writer in slow:
            answers.append(await asyncio.wait_for(reader.read(), BODY_TIMEOUT_S + 10))
            writer.close()
        return out, served_s, answers, time.monotonic() - opened

    out, served_s, answers, all_closed_s = asyncio.run(run())
    assert out.choices[0].text is not None
    assert served_s < BODY_TIMEOUT_S, f"a normal request waited {served_s:.2f} s"
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"
    assert all_closed_s < BODY_TIMEOUT_S + 5


def test_a_body_sent_in_pieces_within_the_deadline_is_served(hostile):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()

    async def run():
        reader, writer = await asyncio.open_connection(hostile.host, hostile.port)
        request = post_bytes("/v1/completions", body)
        for start in range(0, len(request), len(request) // 3 + 1):
            writer.write(request[start : start + len(request) // 3 + 1])
            await writer.drain()
            await asyncio.sleep(BODY_TIMEOUT_S / 5)
        answer = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        return answer

    answer = asyncio.run(run())
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
