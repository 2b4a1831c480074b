"""The Responses API's parts without a server: bodies -> the chat body the engine serves
(server/responses_protocol.py), output items and their events (server/responses_serving.py)
and the store's bounds (server/responses_store.py). The endpoint itself is tested with the
official client in test_responses_api.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from ringllm.server.chat_outputs import OutputParsing
from ringllm.server.errors import ApiError
from ringllm.server.limits import ServerLimits
from ringllm.server.responses_protocol import parse_responses_request, to_chat_body, to_messages
from ringllm.server.responses_serving import _OutputItems, input_items_page, with_ids
from ringllm.server.responses_store import ResponseStore, StoredResponse
from ringllm.server.structured_request import parse_tools

LIMITS = ServerLimits()
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}


def parse(body, **kwargs):
    return parse_responses_request(body, LIMITS, 2048, auto_tool_choice=True, **kwargs)


def test_items_become_chat_messages_in_order():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "input_text", "text": "Look:"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
        ]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "10:00"}]},
        {"type": "function_call", "call_id": "call_3", "name": "get_time", "arguments": "{}"},
    ]  # fmt: skip
    messages = to_messages(items)
    assert [m["role"] for m in messages] == [
        "system", "user", "assistant", "tool", "tool", "assistant",
    ]  # fmt: skip
    assert messages[1]["content"][1] == {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"},
    }  # fmt: skip
    # the calls join the assistant message they follow (reasoning between is dropped)
    assert messages[2]["content"] == "Checking."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[4] == {"role": "tool", "tool_call_id": "call_2", "content": "10:00"}
    # a call after a tool output opens a new assistant turn (content null, as clients send)
    assert messages[5]["content"] is None and messages[5]["tool_calls"][0]["id"] == "call_3"


def test_fields_map_to_the_chat_body():
    body = {
        "input": "hi", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.5,
        "top_p": 0.9, "seed": 3, "tools": [WEATHER], "tool_choice": "required",
        "parallel_tool_calls": False, "top_logprobs": 2,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
    }  # fmt: skip
    chat = to_chat_body(body, [{"type": "message", "role": "user", "content": "hi"}])
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["max_completion_tokens"] == 9 and chat["seed"] == 3
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}}}]  # fmt: skip
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2
    # calls are forced: there is no text for the format to shape
    assert "response_format" not in chat
    free = to_chat_body({**body, "tool_choice": "auto"}, [{"role": "user", "content": "hi"}])
    assert free["response_format"]["json_schema"] == {"name": "w", "schema": {"type": "object"}}


@pytest.mark.parametrize(
    "mode, names, want",
    [
        ("required", ["get_time"], {"type": "function", "function": {"name": "get_time"}}),
        ("required", ["get_time", "get_weather"], "required"),
        ("auto", ["get_weather"], "auto"),
    ],
)
def test_allowed_tools_cut_the_tools(mode, names, want):
    choice = {"type": "allowed_tools", "mode": mode,
              "tools": [{"type": "function", "name": n} for n in names]}  # fmt: skip
    req = parse({"input": "hi", "tools": [WEATHER, TIME], "tool_choice": choice})
    assert sorted(req.chat.tools.schemas) == sorted(names)
    chat = to_chat_body(
        {"input": "hi", "tools": [WEATHER, TIME], "tool_choice": choice},
        [{"role": "user", "content": "hi"}],
    )
    assert chat["tool_choice"] == want
    assert parse_tools(chat, True).mode == {"required": "required", "auto": "auto"}.get(
        want if isinstance(want, str) else "", "named"
    )


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {
            "type": "allowed_tools", "mode": "required",
            "tools": [{"type": "function", "name": "nope"}]}}, "tool_choice", "'nope'"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {
            "type": "allowed_tools", "mode": "sometimes", "tools": []}}, "tool_choice", "mode"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
         "input", "arguments"),
        ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input", "not a system content part"),
        ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens", "max_output_tokens"),
        ({"input": "hi", "stream_options": {}}, "stream_options", "stream: true"),
        ({"input": "hi", "reasoning": {"budget": 3}}, "reasoning", "reasoning"),
        ({"input": "hi", "include": "all"}, "include", "list of strings"),
        ({"input": "hi", "truncation": "sometimes"}, "truncation", "truncation"),
        ({"input": []}, "input", "empty"),
    ],
)  # fmt: skip
def test_mistakes_name_the_responses_field(body, param, words):
    with pytest.raises(ApiError) as caught:
        parse(body)
    assert caught.value.param == param and words in caught.value.message, caught.value.message


def test_history_and_references():
    stored = with_ids([{"role": "user", "content": "first"}])
    assert stored[0]["id"].startswith("msg_") and stored[0]["content"] == [
        {"type": "input_text", "text": "first"}
    ]
    answer = {"id": "msg_a", "type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "ok", "annotations": []}]}  # fmt: skip
    req = parse(
        {"input": [{"type": "item_reference", "id": "msg_a"}, {"role": "user", "content": "more"}]},
        history=stored,
        references={"msg_a": answer},
    )
    assert [(m["role"], m["content"]) for m in req.chat.messages] == [
        ("user", [{"type": "text", "text": "first"}]),
        ("assistant", "ok"),
        ("user", "more"),
    ]


def _texts(items: _OutputItems, pieces, finish="stop"):
    events = []
    for piece in pieces:
        events += items.take(piece)
    return events + items.finish(finish)


def test_output_items_of_thinking_text_and_a_call():
    """The reasoning, the text and the tool call each get their item, in order, each closed
    before the next opens; the deltas add up to the items."""
    parsing = OutputParsing(tool_parser="hermes", reasoning_parser="qwen3", auto_tool_choice=True)
    tools = parse_tools(
        {"tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}]}, True
    )
    items = _OutputItems(parsing.choice(tools))
    text = ('<think>Add them.</think>Sure.<tool_call>\n{"name": "add", "arguments": '
            '{"a": 1}}\n</tool_call>')  # fmt: skip
    events = _texts(items, [text[i : i + 5] for i in range(0, len(text), 5)])
    assert [i["type"] for i in items.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = items.output
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Add them."}]
    assert message["content"][0]["text"].strip() == "Sure."
    assert call["name"] == "add" and json.loads(call["arguments"]) == {"a": 1}
    assert all(item["status"] == "completed" for item in items.output)
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2]
    # item i is done before item i+1 is added
    order = [(e["type"], e.get("output_index")) for e in events if "output_item" in e["type"]]
    assert order == [
        ("response.output_item.added", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.output_item.done", 2),
    ]  # fmt: skip
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "Add them." and items.reasoning_text == thought
    args = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    assert args == call["arguments"]


def test_an_item_cut_by_the_budget_is_incomplete():
    items = _OutputItems(OutputParsing().choice(None))
    events = _texts(items, ["Hello", " wor"], finish="length")
    (message,) = items.output
    assert message["status"] == "incomplete" and message["content"][0]["text"] == "Hello wor"
    assert events[-1]["item"]["status"] == "incomplete"


def _stored(n: int, text: str = "x") -> StoredResponse:
    response = {"id": f"resp_{n}", "output": [], "status": "completed"}
    return StoredResponse(response, [], with_ids([{"role": "user", "content": text}]))


def test_the_store_keeps_its_bounds_least_recently_used_out():
    store = ResponseStore(max_responses=3, max_bytes=1 << 20)
    for n in range(3):
        store.put(_stored(n))
    assert store.get("resp_0") is not None  # used: now the most recent
    store.put(_stored(3))
    assert store.get("resp_1") is None and len(store) == 3
    assert store.get("resp_0") is not None
    by_bytes = ResponseStore(max_responses=100, max_bytes=2000)
    for n in range(5):
        by_bytes.put(_stored(n, "y" * 600))
    assert by_bytes.nbytes <= 2000 and len(by_bytes) < 5 and by_bytes.get("resp_4")
    # item references go with their response
    item_id = by_bytes.get("resp_4").input_items[0]["id"]
    assert by_bytes.items[item_id]["content"][0]["text"] == "y" * 600
    by_bytes.delete("resp_4")
    assert item_id not in by_bytes.items


def test_a_running_background_response_is_never_evicted():
    async def scenario():
        store = ResponseStore(max_responses=1, max_bytes=1 << 20)
        running = _stored(0)
        running.task = asyncio.get_running_loop().create_task(asyncio.sleep(10))
        store.put(running)
        store.put(_stored(1))
        kept = store.get("resp_0") is running
        running.task.cancel()
        return kept, len(store)

    assert asyncio.run(scenario()) == (True, 2)


def test_input_items_pages():
    stored = _stored(0)
    stored.input_items = with_ids([{"role": "user", "content": str(i)} for i in range(5)])
    first = input_items_page(stored, {"order": "asc", "limit": "2"})
    assert [i["content"][0]["text"] for i in first["data"]] == ["0", "1"] and first["has_more"]
    rest = input_items_page(stored, {"order": "asc", "after": first["last_id"]})
    assert [i["content"][0]["text"] for i in rest["data"]] == ["2", "3", "4"]
    assert not rest["has_more"]
    newest = input_items_page(stored, {})
    assert newest["data"][0]["content"][0]["text"] == "4"  # desc by default, as OpenAI's
    for query in ({"limit": "0"}, {"order": "up"}, {"after": "msg_nope"}):
        with pytest.raises(ApiError):
            input_items_page(stored, query)


def test_dropping_the_oldest_turn_keeps_system_and_calls_whole():
    from ringllm.server.responses_serving import drop_oldest_turn

    messages = [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
        {"role": "tool", "tool_call_id": "c", "content": "r"},
        {"role": "user", "content": "u"},
    ]
    once = drop_oldest_turn(messages)
    assert [m["role"] for m in once] == ["system", "user"]  # the call with its result
    assert drop_oldest_turn(once) is None  # the last turn stays
