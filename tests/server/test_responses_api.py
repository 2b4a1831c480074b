"""OpenAI's Responses API through the official `openai` client against `ringllm serve`,
with the offline engine (the same model and flags, in this process) as the oracle."""

from __future__ import annotations

import json
import time
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from ringllm.pipeline import SamplingParams

INSTRUCTIONS = "You write Python."
USER = "Sort a list"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city",
    "parameters": WEATHER_SCHEMA, "strict": True,
}  # fmt: skip
FORCE_WEATHER = {"type": "function", "name": "get_weather"}


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)


# The engine's placement (thread or process) is the chat endpoint's concern, tested there.
pytestmark = pytest.mark.parametrize("server", ["--no-engine-process"], indirect=True)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=120) as c:
        yield c


def offline_chat(llm, messages, **params):
    return llm.chat(messages, SamplingParams(temperature=0.0, **params), use_tqdm=False)[0]


def test_a_response_equals_the_offline_engine(client, server, offline_llm):
    r = client.responses.create(
        model=server.model_name, instructions=INSTRUCTIONS, input=USER, max_output_tokens=12,
        temperature=0,
    )  # fmt: skip
    want = offline_chat(
        offline_llm,
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": USER}],
        max_tokens=12,
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == server.model_name
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.output_text == want.outputs[0].text
    assert r.usage.input_tokens == len(want.prompt_token_ids)
    assert r.usage.output_tokens == len(want.outputs[0].token_ids) == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    # the budget ran out: incomplete, as OpenAI reports it
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == INSTRUCTIONS and r.max_output_tokens == 12 and r.temperature == 0


def test_stream_events_in_order_add_up_to_the_response(client, server):
    args = dict(model=server.model_name, input=USER, max_output_tokens=10, temperature=0)
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 10
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_the_clients_stream_helper_parses_a_text_format(client, server):
    """responses.stream: the client's own accumulator; a JSON schema's grammar ends the
    text by itself (the tiny model never would), so the response completes."""
    args = dict(model=server.model_name, input="Weather in Oslo, as JSON", temperature=0,
                max_output_tokens=60)  # fmt: skip
    with client.responses.stream(**args, text_format=Weather) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, Weather)
    assert "".join(texts) == final.output_text
    whole = client.responses.parse(**args, text_format=Weather)
    assert whole.output_parsed == final.output_parsed and whole.text.format.type == "json_schema"


def test_previous_response_id_carries_the_conversation(client, server, offline_llm):
    first = client.responses.create(
        model=server.model_name, instructions=INSTRUCTIONS, input=USER, max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    second = client.responses.create(
        model=server.model_name, previous_response_id=first.id, input="Now reverse it",
        max_output_tokens=6, temperature=0,
    )  # fmt: skip
    # OpenAI's rule: the previous response's instructions are not carried over
    want = offline_chat(
        offline_llm,
        [
            {"role": "user", "content": USER},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Now reverse it"},
        ],
        max_tokens=6,
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == len(want.prompt_token_ids)
    assert second.output_text == want.outputs[0].text
    listed = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in listed.data] == [
        ("message", "user", "Now reverse it")
    ]


def test_a_function_call_loop(client, server, offline_llm):
    """A forced (grammar-enforced) function call, its output sent back as an item: the
    history the model sees is the chat endpoint's tool history."""
    first = client.responses.create(
        model=server.model_name, input="Weather in Paris for 3 days?", tools=[WEATHER],
        tool_choice=FORCE_WEATHER, max_output_tokens=60, temperature=0,
    )  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert first.status == "completed"
    streamed = list(
        client.responses.create(
            model=server.model_name, input="Weather in Paris for 3 days?", tools=[WEATHER],
            tool_choice=FORCE_WEATHER, max_output_tokens=60, temperature=0, stream=True,
        )
    )  # fmt: skip
    pieces = "".join(
        e.delta for e in streamed if e.type == "response.function_call_arguments.delta"
    )
    (done,) = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert pieces == done.arguments == call.arguments
    # the whole history as items (no stored state), then chained by id: the same prompt
    items = [
        {"role": "user", "content": "Weather in Paris for 3 days?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
    ]  # fmt: skip
    stateless = client.responses.create(
        model=server.model_name, input=items, tools=[WEATHER], max_output_tokens=8,
        temperature=0, store=False,
    )  # fmt: skip
    chained = client.responses.create(
        model=server.model_name, previous_response_id=first.id, input=items[2:],
        tools=[WEATHER], max_output_tokens=8, temperature=0,
    )  # fmt: skip
    want = offline_llm.chat(
        [
            {"role": "user", "content": "Weather in Paris for 3 days?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.call_id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"},
        ],
        SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False,
        tools=[{"type": "function", "function": {
            k: WEATHER[k] for k in ("name", "description", "parameters")}}],
    )[0]  # fmt: skip
    assert stateless.usage.input_tokens == chained.usage.input_tokens
    assert stateless.usage.input_tokens == len(want.prompt_token_ids)
    assert stateless.output_text == chained.output_text == want.outputs[0].text


def test_logprobs_for_each_output_token(client, server):
    r = client.responses.create(
        model=server.model_name, input=USER, max_output_tokens=5, temperature=0,
        top_logprobs=2, include=["message.output_text.logprobs"],
    )  # fmt: skip
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens == 5
    assert "".join(lp.token for lp in logprobs) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)


def test_the_store(client, server):
    r = client.responses.create(
        model=server.model_name, input=[
            {"role": "developer", "content": "Be short."},
            {"role": "user", "content": [{"type": "input_text", "text": USER}]},
        ], max_output_tokens=4, temperature=0,
    )  # fmt: skip
    got = client.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.status == r.status
    page = client.responses.input_items.list(r.id, order="asc", limit=1)
    assert [i.role for i in page.data] == ["developer"] and page.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=page.data[0].id)
    assert [i.role for i in rest.data] == ["user"] and not rest.has_more
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(
        model=server.model_name, input=USER, max_output_tokens=2, store=False
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=server.model_name, input=USER, previous_response_id=unstored.id
        )
    assert caught.value.body["param"] == "previous_response_id"


def _wait_done(client, response_id: str, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = client.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress"):
            return got
        time.sleep(0.1)
    raise AssertionError(f"{response_id} still {got.status}")


def test_background_responses(client, server):
    args = dict(model=server.model_name, input=USER, max_output_tokens=12, temperature=0)
    foreground = client.responses.create(**args)
    started = client.responses.create(**args, background=True)
    assert started.background and started.status in ("queued", "in_progress")
    done = _wait_done(client, started.id)
    assert done.output_text == foreground.output_text and done.usage.output_tokens == 12
    # streamed in the background: the events replay from any point, to the end
    events = list(client.responses.create(**args, background=True, stream=True))
    response_id = events[0].response.id
    assert events[-1].type == "response.incomplete"
    replay = list(
        client.responses.retrieve(
            response_id, stream=True, starting_after=events[3].sequence_number
        )
    )
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in events[4:]]
    # cancelled: its engine request is aborted (the server's gauge of running requests
    # goes back to zero) and its status stays cancelled
    long = client.responses.create(**{**args, "max_output_tokens": 1500}, background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"  # idempotent
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(foreground.id)  # not a background response
    deadline = time.monotonic() + 10
    while server.metrics().get("ringllm:num_requests_running", 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metrics().get("ringllm:num_requests_running", 0) == 0


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({}, "input", "input: is required"),
        ({"input": [{"type": "computer_call"}]}, "input", "input[0].type: 'computer_call'"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input", "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input", "input[0].content[0].type: 'input_file'"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input",
         "input[0].call_id"),
        ({"input": [{"type": "item_reference", "id": "msg_nope"}]}, "input", "not stored"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text", "text.format"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation", "Conversations API"),
        ({"input": "hi", "top_q": 1}, "top_q", "unrecognized"),
        ({"input": "hi", "background": True, "store": False}, "background", "stored"),
        ({"input": "hi", "metadata": {"k": 1}}, "metadata", "metadata"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)  # fmt: skip
def test_mistakes_are_openai_shaped_errors(server, body, param, words):
    status, answer, _ = server.call("POST", "/v1/responses", body, headers=server.auth)
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer


def test_auto_tool_choice_needs_the_servers_flag(client, server):
    """This server runs no tool-call parser: "auto" is a 400 saying what to start it with,
    on the chat endpoint as here ("none", "required" and a named tool work without)."""
    for call in (
        lambda: client.responses.create(
            model=server.model_name, input=USER, tools=[WEATHER], tool_choice="auto"
        ),
        lambda: client.chat.completions.create(
            model=server.model_name, messages=[{"role": "user", "content": USER}],
            tools=[{"type": "function", "function": {"name": "get_weather",
                                                     "parameters": WEATHER_SCHEMA}}],
            tool_choice="auto",
        ),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            call()


def test_unknown_responses_are_404s(server):
    for method, path in [
        ("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
        ("POST", "/v1/responses/resp_nope/cancel"), ("GET", "/v1/responses/resp_nope/input_items"),
    ]:  # fmt: skip
        status, answer, _ = server.call(method, path, headers=server.auth)
        assert status == 404 and answer["error"]["code"] == "response_not_found", (path, answer)


def test_truncation_auto_drops_the_oldest_turns(client, server):
    long = "word " * 100  # ~300 tokens a turn: eight of them are over the context
    items = []
    for i in range(8):
        items += [{"role": "user", "content": f"{i} {long}"},
                  {"role": "assistant", "content": "ok"}]  # fmt: skip
    items.append({"role": "user", "content": "Summarise."})
    args = dict(model=server.model_name, instructions=INSTRUCTIONS, input=items,
                max_output_tokens=8, temperature=0)  # fmt: skip
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**args)
    assert "max_model_len" in caught.value.body["message"]
    cut = client.responses.create(**args, truncation="auto")
    assert cut.usage.input_tokens + 8 <= server.max_model_len
    assert cut.usage.input_tokens > server.max_model_len // 2  # only what had to go went
    assert cut.truncation == "auto" and cut.usage.output_tokens == 8
