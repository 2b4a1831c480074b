"""Anthropic Messages bodies -> the chat body the engine serves (server/anthropic_protocol.py),
field by field; the endpoint itself is tested with the official client in
test_anthropic_api.py."""

from __future__ import annotations

import json

import pytest

from ringllm.server.anthropic_protocol import parse_messages_request, to_chat_body
from ringllm.server.errors import ApiError
from ringllm.server.limits import ServerLimits

CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


def test_blocks_become_chat_messages_in_order():
    body = {
        "max_tokens": 16,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            ]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, CALL]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": True},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
        "stop_sequences": ["\n\n"],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
    }  # fmt: skip
    chat = to_chat_body(body)
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]
    assert chat["messages"][0]["content"] == "Be brief.\nBe kind."
    image = chat["messages"][1]["content"][1]
    assert image == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assistant = chat["messages"][2]
    assert assistant["content"] is None  # the thinking block is dropped
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"}
    assert chat["messages"][4]["content"] == "Error: down"
    assert chat["stop"] == ["\n\n"] and chat["tool_choice"] == "required"
    assert chat["parallel_tool_calls"] is False
    assert chat["tools"][0]["function"] == {"name": "get_weather", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    "choice, want",
    [
        ({"type": "auto"}, {}),
        ({"type": "none"}, {"tool_choice": "none"}),
        ({"type": "tool", "name": "f"}, {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ],
)  # fmt: skip
def test_tool_choice(choice, want):
    chat = to_chat_body(
        {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": choice}
    )
    assert {k: v for k, v in chat.items() if k in ("tool_choice", "parallel_tool_calls")} == want


def test_count_tokens_needs_no_max_tokens_and_errors_name_anthropic_fields():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    req = parse_messages_request(body, ServerLimits(), 2048, False, counting=True)
    assert req.chat.messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(ApiError) as caught:
        parse_messages_request(
            {**body, "max_tokens": 4, "stop_sequences": ["x"] * 100}, ServerLimits(), 2048, False
        )
    assert caught.value.param == "stop_sequences"
