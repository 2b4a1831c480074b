"""Anthropic's Messages API through the official `anthropic` client against `ringllm serve`,
with the offline engine (the same model and flags, in this process) as the oracle."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from ringllm.pipeline import SamplingParams

SYSTEM = "You write Python."
USER = "Sort a list"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
FORCE_WEATHER = {"type": "tool", "name": "get_weather"}
# the current client has no temperature argument (older ones send it; the server takes it)
GREEDY = {"temperature": 0.0}


# The engine's placement (thread or process) is the chat endpoint's concern, tested there:
# this API runs on one of them.
pytestmark = pytest.mark.parametrize("server", ["--no-engine-process"], indirect=True)


@pytest.fixture(scope="module")
def client(server):
    # the client sends its key as `x-api-key`, not as a Bearer token
    with anthropic.Anthropic(
        base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=120
    ) as c:
        yield c


def offline_chat(llm, messages, **params):
    return llm.chat(messages, SamplingParams(temperature=0.0, **params), use_tqdm=False)[0]


def test_message_equals_the_offline_engine(client, server, offline_llm):
    msg = client.messages.create(
        model=server.model_name, system=SYSTEM, max_tokens=12, extra_body=GREEDY,
        messages=[{"role": "user", "content": [{"type": "text", "text": USER}]}],
    )  # fmt: skip
    want = offline_chat(
        offline_llm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        max_tokens=12,
    )  # fmt: skip
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == server.model_name
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == want.outputs[0].text
    assert msg.usage.input_tokens == len(want.prompt_token_ids)
    assert msg.usage.output_tokens == len(want.outputs[0].token_ids) == 12
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    count = client.messages.count_tokens(
        model=server.model_name, system=SYSTEM, messages=[{"role": "user", "content": USER}]
    )
    assert count.input_tokens == msg.usage.input_tokens


def test_stream_events_in_order_add_up_to_the_message(client, server):
    args = dict(model=server.model_name, max_tokens=10, extra_body=GREEDY,
                messages=[{"role": "user", "content": USER}])  # fmt: skip
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_message()
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[2:-3]) <= {"content_block_delta", "text"}
    assert final.content[0].text == whole.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    assert final.stop_reason == "max_tokens"


def test_a_stop_sequence_is_named(client, server):
    # seeded sampling: the same text twice, more varied than the tiny model's greedy one
    # (sixteen newlines); the first seed whose text has some visible characters after its
    # first (the tiny model's likeliest token is still a newline, so some seeds' are not)
    for seed in range(1, 30):
        args = dict(model=server.model_name, max_tokens=16,
                    extra_body={"temperature": 1.0, "seed": seed},
                    messages=[{"role": "user", "content": USER}])  # fmt: skip
        text = client.messages.create(**args).content[0].text
        visible = [i for i in range(1, len(text)) if text[i].strip()]
        if len(visible) >= 2:
            break
    # a stop two characters long from the middle of the visible ones (not the text's first:
    # the answer before it must not be empty)
    at = visible[len(visible) // 2]
    stop = text[at : at + 2]
    assert text.index(stop) > 0, text
    msg = client.messages.create(**args, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]


def test_a_tool_loop_with_the_tool_forced_then_answered(client, server):
    """tool_choice names the tool (grammar-enforced, as the model alone would not call):
    a tool_use block whose input fits the schema, stop_reason tool_use; its result sent
    back as a tool_result block gets an answer. Streamed, the input arrives as
    input_json_delta pieces the client puts together."""
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    first = client.messages.create(
        model=server.model_name, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
        tool_choice=FORCE_WEATHER, messages=messages,
    )  # fmt: skip
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert first.stop_reason == "tool_use"
    with client.messages.stream(
        model=server.model_name, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
        tool_choice=FORCE_WEATHER, messages=messages,
    ) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert streamed.content[0].input == call.input and streamed.stop_reason == "tool_use"
    answer = client.messages.create(
        model=server.model_name, max_tokens=8, extra_body=GREEDY, tools=[WEATHER],
        messages=[
            *messages,
            {"role": "assistant", "content": [c.model_dump() for c in first.content]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"},
                {"type": "text", "text": "Thanks. Summarise."},
            ]},
        ],
    )  # fmt: skip
    assert answer.content[0].type == "text" and answer.usage.output_tokens == 8


@pytest.mark.parametrize(
    "body, status, kind, words",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
        ({"max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}, 400,
         "invalid_request_error", "messages[0].role"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400,
         "invalid_request_error", "messages[0].content[0].type: 'video'"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]}, 400,
         "invalid_request_error", "not a user content block"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "top_q": 1}, 400,
         "invalid_request_error", "top_q: Extra inputs"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
          "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error",
         "extended thinking"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
         400, "invalid_request_error", "temperature"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "model": "claude"},
         404, "not_found_error", "does not exist"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [
            {"type": "web_search_20250305", "name": "web_search"}]}, 400,
         "invalid_request_error", "only client tools"),
    ],
)  # fmt: skip
def test_mistakes_are_anthropic_shaped_errors(server, body, status, kind, words):
    headers = {"x-api-key": server.api_key, "anthropic-version": "2023-06-01"}
    got, answer, _ = server.call("POST", "/v1/messages", body, headers=headers)
    assert got == status, answer
    assert answer["type"] == "error" and answer["error"]["type"] == kind
    assert words in answer["error"]["message"]


def test_a_wrong_key_is_an_authentication_error(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="nope", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            bad.messages.create(
                model=server.model_name, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
    assert caught.value.body["error"]["type"] == "authentication_error"
    status, answer, _ = server.call("GET", "/v1/models", headers={"x-api-key": server.api_key})
    assert status == 200 and json.dumps(answer)  # the x-api-key header opens every route


def test_output_config_format_enforces_a_json_schema(client, server):
    schema = WEATHER["input_schema"]
    msg = client.messages.create(
        model=server.model_name, max_tokens=60, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=[{"role": "user", "content": "Weather in Oslo, as JSON"}],
    )  # fmt: skip
    jsonschema.validate(json.loads(msg.content[0].text), schema)
    assert msg.stop_reason == "end_turn"
