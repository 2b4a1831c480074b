"""Property test: whatever JSON a client sends to any endpoint, the server answers it
without a 5xx, every refusal in the OpenAI error shape (Anthropic's under /v1/messages),
a Responses stream in its events' order,
and stays healthy.

The bodies come from hypothesis: arbitrary JSON, and objects made of each endpoint's own
field names with values of any JSON type (so the field checks, not only the top-level
shape check, are reached), including messages and content parts of any shape. Derandomized:
the same examples every run (CI never meets a new one by luck).
"""

from __future__ import annotations

import http.client
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringllm.server.anthropic_protocol import FIELDS as MESSAGES_FIELDS
from ringllm.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS, FIELD_TYPES
from ringllm.server.responses_protocol import FIELDS as RESPONSES_FIELDS
from tests.server.conftest import ENGINE_KWARGS, _flags, launched

API_KEY = "fuzz-key"
# Small asks: a random body that passes every check generates at most this many tokens.
MAX_REQUEST_TOKENS = 48

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
small_ints = st.integers(min_value=-3, max_value=40)
plausible = json_scalars | small_ints | st.lists(small_ints | st.text(max_size=8), max_size=4)
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "bogus"]) | json_scalars},
    optional={"text": json_values, "image_url": json_values},
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"])},
    optional={
        "content": st.none() | st.text(max_size=60) | st.lists(part | json_values, max_size=3),
        "name": json_scalars,
        "tool_calls": json_values,
    },
)


def bodies(fields: set[str], extra: dict):
    """Objects of the endpoint's field names (each value any JSON, or a plausible one)."""
    names = sorted((fields | set(FIELD_TYPES)) - set(extra))
    return st.dictionaries(st.sampled_from(names), plausible | json_values, max_size=6).flatmap(
        lambda d: st.fixed_dictionaries({k: st.just(v) for k, v in d.items()}, optional=extra)
    )


# Output constraints and tools of plausible shapes (and any JSON inside them), so the
# checks past the first type test are reached too.
response_format = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"]) | json_scalars},
    optional={
        "json_schema": json_values
        | st.fixed_dictionaries(
            {"name": json_scalars}, optional={"schema": json_values, "strict": json_scalars}
        )
    },
)
structured = st.dictionaries(
    st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "x"]),
    plausible | json_values,
    max_size=2,
)
tool = st.fixed_dictionaries(
    {"type": st.just("function") | json_scalars},
    optional={
        "function": json_values
        | st.fixed_dictionaries(
            {"name": st.text(max_size=6) | json_scalars}, optional={"parameters": json_values}
        )
    },
)
CONSTRAINTS = {
    "response_format": response_format | json_values,
    "structured_outputs": structured | json_values,
    "guided_json": json_values,
    "guided_regex": st.text(max_size=12) | json_scalars,
    "guided_choice": st.lists(st.text(max_size=6), max_size=3) | json_values,
}
COMPLETION_BODIES = bodies(
    COMPLETION_FIELDS,
    {
        "prompt": st.text(max_size=40) | st.lists(small_ints, max_size=5) | json_values,
        **CONSTRAINTS,
    },
)
CHAT_BODIES = bodies(
    CHAT_FIELDS,
    {
        "messages": st.lists(message, max_size=3) | json_values,
        "tools": st.lists(tool, max_size=2) | json_values,
        "tool_choice": st.sampled_from(["none", "auto", "required"]) | json_values,
        **CONSTRAINTS,
    },
)
TOKENIZE_BODIES = bodies(
    {"model", "prompt", "messages", "add_special_tokens", "tokens"},
    {"prompt": st.text(max_size=40), "tokens": st.lists(small_ints, max_size=5)},
)
# Anthropic's Messages API: content blocks and tools of plausible shapes
block = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "x"])
        | json_scalars
    },
    optional={
        "text": json_values,
        "source": json_values
        | st.fixed_dictionaries(
            {"type": st.sampled_from(["base64", "url"]) | json_scalars},
            optional={"media_type": json_scalars, "data": json_scalars, "url": json_scalars},
        ),
        "id": json_scalars,
        "name": json_scalars,
        "input": json_values,
        "tool_use_id": json_scalars,
        "content": json_values,
        "is_error": json_scalars,
    },
)
anthropic_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "x"])},
    optional={
        "content": st.none() | st.text(max_size=40) | st.lists(block | json_values, max_size=3)
    },
)
anthropic_tool = st.fixed_dictionaries(
    {"name": st.text(max_size=6) | json_scalars},
    optional={"input_schema": json_values, "type": json_scalars, "description": json_scalars},
)
MESSAGES_BODIES = bodies(
    MESSAGES_FIELDS,
    {
        "messages": st.lists(anthropic_message, max_size=3) | json_values,
        "max_tokens": small_ints | json_scalars,
        "system": st.text(max_size=20) | st.lists(block, max_size=2) | json_values,
        "tools": st.lists(anthropic_tool, max_size=2) | json_values,
        "tool_choice": json_values
        | st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
            optional={"name": json_scalars, "disable_parallel_tool_use": json_scalars},
        ),
        "output_config": json_values,
    },
)
# OpenAI's Responses API: input items, content parts and tools of plausible shapes
input_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "input_image", "output_text", "input_file", "x"])},
    optional={"text": json_values, "image_url": json_values, "refusal": json_values},
)
input_item = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["message", "function_call", "function_call_output", "reasoning", "item_reference"]
        )
        | json_scalars
    },
    optional={
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
        "content": st.text(max_size=30) | st.lists(input_part | json_values, max_size=3),
        "call_id": json_scalars,
        "name": json_scalars,
        "arguments": json_scalars,
        "output": json_values,
        "id": json_scalars,
    },
)
responses_tool = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "web_search", "x"]) | json_scalars},
    optional={"name": st.text(max_size=6) | json_scalars, "parameters": json_values},
)
RESPONSES_BODIES = bodies(
    RESPONSES_FIELDS,
    {
        "input": st.text(max_size=40) | st.lists(input_item | json_values, max_size=3),
        "max_output_tokens": small_ints | json_scalars,
        "tools": st.lists(responses_tool, max_size=2) | json_values,
        "tool_choice": st.sampled_from(["none", "auto", "required"]) | json_values,
        "text": json_values
        | st.fixed_dictionaries(
            {"format": json_values | st.fixed_dictionaries({"type": json_scalars})}
        ),
        "previous_response_id": st.text(max_size=12) | json_scalars,
    },
)
ENDPOINTS = {
    "/v1/completions": COMPLETION_BODIES,
    "/v1/responses": RESPONSES_BODIES,
    "/v1/messages": MESSAGES_BODIES,
    "/v1/messages/count_tokens": MESSAGES_BODIES,
    "/v1/chat/completions": CHAT_BODIES,
    "/tokenize": TOKENIZE_BODIES,
    "/detokenize": TOKENIZE_BODIES,
}


@pytest.fixture(scope="module")
def fuzz_server(server_model, tmp_path_factory):
    args = [
        str(server_model), "--port", "0", "--api-key", API_KEY, "--no-engine-process",
        "--max-request-tokens", str(MAX_REQUEST_TOKENS), *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    with launched(args, tmp_path_factory.mktemp("fuzz")) as (_, url, log_path):
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port), log_path


def post(server, path: str, data: bytes) -> tuple[int, str, bytes]:
    host, port, _ = server
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        conn.request("POST", path, body=data, headers=headers)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


def check_answer(status: int, content_type: str, raw: bytes, path: str = "") -> None:
    assert status < 500, raw[:500]
    if path.startswith("/v1/messages"):
        return check_anthropic_answer(status, content_type, raw)
    if path.startswith("/v1/responses") and content_type.startswith("text/event-stream"):
        return check_responses_stream(status, raw)
    if content_type.startswith("text/event-stream"):
        assert status == 200
        events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", raw[-300:]
        for event in events[:-1]:
            chunk = json.loads(event)
            if "error" in chunk:  # reported in-band after the 200: never the server's fault
                assert chunk["error"]["type"] != "server_error", chunk
        return
    body = json.loads(raw)
    if status != 200:
        assert set(body) == {"error"}, body
        assert {"message", "type", "param", "code"} <= set(body["error"])
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def check_anthropic_answer(status: int, content_type: str, raw: bytes) -> None:
    if content_type.startswith("text/event-stream"):
        assert status == 200
        names = [line[7:] for line in raw.split(b"\n") if line.startswith(b"event: ")]
        assert names and names[0] == b"message_start", raw[:300]
        assert names[-1] in (b"message_stop", b"error"), raw[-300:]
        for line in raw.split(b"\n"):
            if line.startswith(b"data: ") and b'"type":"error"' in line:
                assert json.loads(line[6:])["error"]["type"] != "api_error", line
        return
    body = json.loads(raw)
    if status != 200:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def check_responses_stream(status: int, raw: bytes) -> None:
    assert status == 200
    names = [line[7:] for line in raw.split(b"\n") if line.startswith(b"event: ")]
    assert names and names[0] == b"response.created", raw[:300]
    ends = (b"response.completed", b"response.incomplete", b"response.failed")
    assert names[-1] in ends, raw[-300:]
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line.startswith(b'data: {"type":"error"'):
            assert json.loads(line[6:])["code"] != "server_error", line


FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_any_json_body_gets_an_answer_not_a_5xx(fuzz_server, path):
    @FUZZ
    @given(body=ENDPOINTS[path] | json_values)
    def check(body):
        check_answer(*post(fuzz_server, path, json.dumps(body).encode()), path)

    check()


@FUZZ
@given(data=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_any_bytes_get_an_answer_not_a_5xx(fuzz_server, data):
    check_answer(*post(fuzz_server, "/v1/completions", data))


def test_after_the_fuzzing_the_server_is_healthy_and_logged_no_traceback(fuzz_server):
    host, port, log_path = fuzz_server
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    assert "Traceback" not in log_path.read_text(errors="replace")
