"""Anthropic's Messages API (`POST /v1/messages`) -> the chat request the engine serves.

A Messages body is checked here, field by field (errors name Anthropic's field paths), and
translated into the chat-completions body `protocol.parse_chat_request` takes, so sampling,
limits, tools and the grammar behind `tool_choice` are the chat endpoint's own:

    system (string | text blocks)            -> a system message
    messages[i].content blocks
        text                                 -> text (parts joined, as chat content)
        image (base64 | url source, user)    -> an image_url part (data: URL for base64)
        tool_use (assistant)                 -> the message's tool_calls (input as JSON)
        tool_result (user)                   -> a tool message, before the user's own text
        thinking, redacted_thinking          -> dropped (this server does not think aloud)
    max_tokens, stop_sequences, temperature, top_p, top_k, stream (and the engine's seed)
                                             -> max_tokens, stop, temperature, top_p, top_k
    tools [{name, description, input_schema}] -> function tools
    tool_choice auto | any | tool | none     -> the server's default (calls parsed where it
                                                runs a tool-call parser) | required | named |
                                                none; disable_parallel_tool_use -> one call

    output_config.format {"type": "json_schema", "schema"}
                                             -> response_format json_schema (the grammar)

Unknown fields are a 400, as the chat endpoint's are; what only matters to a hosted
provider (`metadata`, `service_tier`, `cache_control`, `speed`, ...: IGNORED) is accepted and
ignored. Extended thinking (`thinking.type = enabled`) is refused: no reasoning is exposed
through this API. The current `anthropic` client no longer sends temperature / top_p /
top_k; older ones do, and they are honoured. The response side (message and stream events) is shaped in
server/anthropic_serving.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ringllm.server.errors import ApiError
from ringllm.server.limits import ServerLimits
from ringllm.server.protocol import ChatRequest, parse_chat_request

FIELDS = {
    "model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "thinking", "output_config",
    "seed",  # not Anthropic's: the engine's, for reproducible sampling
    # vLLM's sampling extras, as the chat endpoint takes them (benchmarks send ignore_eos)
    "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
    "ignore_eos",
}  # fmt: skip
# accepted and ignored: what the provider does with a request (billing, routing, caching,
# telemetry) that changes nothing in the answer of one self-hosted model
IGNORED = {
    "metadata", "service_tier", "cache_control", "container", "diagnostics", "inference_geo",
    "speed", "user_profile_id", "workspace_id",
}  # fmt: skip
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
# the chat body's names -> this API's, for the `param` of an error parse_chat_request raises
RENAME = {"stop": "stop_sequences", "response_format": "output_config"}


@dataclass
class MessagesRequest:
    chat: ChatRequest
    stop_sequences: list[str]


def parse_messages_request(
    body: Any,
    limits: ServerLimits,
    max_model_len: int | None,
    auto_tool_choice: bool,
    counting: bool = False,
) -> MessagesRequest:
    """`counting`: a /v1/messages/count_tokens body, which has no max_tokens."""
    if counting and isinstance(body, dict) and "max_tokens" not in body:
        body = {**body, "max_tokens": 1}
    chat_body = to_chat_body(body)
    try:
        chat = parse_chat_request(chat_body, limits, max_model_len, auto_tool_choice)
    except ApiError as exc:
        exc.param = RENAME.get(exc.param, exc.param)
        raise
    return MessagesRequest(chat, chat_body.get("stop") or [])


def to_chat_body(body: Any) -> dict[str, Any]:
    """The chat-completions body of a Messages body (see the module docstring)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS - IGNORED)
    if unknown:
        raise ApiError(f"{unknown[0]}: Extra inputs are not permitted", param=unknown[0])
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError("max_tokens: a positive integer is required", param="max_tokens")
    _check_thinking(body.get("thinking"))
    messages = _system(body.get("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError("messages: must be a non-empty list of messages", param="messages")
    for index, message in enumerate(raw):
        messages += _message(message, f"messages[{index}]")
    chat: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
    for name in (
        "model", "temperature", "top_p", "top_k", "stream", "seed", "min_p",
        "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos",
    ):  # fmt: skip
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = _stop_sequences(body["stop_sequences"])
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    chat.update(_tool_choice(body.get("tool_choice")))
    json_schema = _output_format(body.get("output_config"))
    if json_schema is not None:
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": json_schema},
        }
    return chat


def _output_format(config: Any) -> dict | None:
    """output_config.format's JSON schema (None: free text); `effort` is accepted and
    ignored (no reasoning is exposed here)."""
    if config is None:
        return None
    if not isinstance(config, dict) or set(config) - {"effort", "format"}:
        raise ApiError('output_config: must be {"effort"?, "format"?}', param="output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise ApiError(
            'output_config.format: must be {"type": "json_schema", "schema": {...}}',
            param="output_config",
        )
    if not isinstance(fmt.get("schema"), dict):
        raise ApiError(
            "output_config.format.schema: must be a JSON Schema object", param="output_config"
        )
    return fmt["schema"]


def _check_thinking(thinking: Any) -> None:
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
        raise ApiError('thinking: must be {"type": "enabled" | "disabled", ...}', param="thinking")
    if thinking["type"] == "enabled":
        raise ApiError(
            "thinking: extended thinking is not supported by this server; leave it out or "
            'send {"type": "disabled"}',
            param="thinking",
        )


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if not isinstance(system, list):
        raise ApiError("system: must be a string or a list of text blocks", param="system")
    text = "\n".join(_text_of(block, f"system[{i}]") for i, block in enumerate(system))
    return [{"role": "system", "content": text}]


def _text_of(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise ApiError(
            f'{where}: must be a text block {{"type": "text", "text": ...}}', param=where
        )
    text = block.get("text")
    if not isinstance(text, str):
        raise ApiError(f"{where}.text: must be a string", param=where)
    return text


def _message(message: Any, where: str) -> list[dict[str, Any]]:
    """One Messages message as chat messages: a user turn's tool results come first, each
    its own tool message, then its text and images."""
    if not isinstance(message, dict):
        raise ApiError(f"{where}: must be an object with a role and content", param="messages")
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise ApiError(f'{where}.role: {role!r} is not "user" or "assistant"', param="messages")
    extra = sorted(set(message) - {"role", "content"})
    if extra:
        raise ApiError(f"{where}.{extra[0]}: Extra inputs are not permitted", param="messages")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(
            f"{where}.content: must be a string or a list of content blocks", param="messages"
        )
    parts, calls, results = [], [], []
    for index, block in enumerate(content):
        block_where = f"{where}.content[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        allowed = _BLOCKS_OF[role]
        if kind not in allowed:
            raise ApiError(
                f"{block_where}.type: {kind!r} is not a {role} content block here (one of "
                f"{', '.join(allowed)})",
                param="messages",
            )
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(block, block_where)})
        elif kind == "image":
            parts.append(_image_part(block, block_where))
        elif kind == "tool_use":
            calls.append(_tool_call(block, block_where))
        elif kind == "tool_result":
            results.append(_tool_result(block, block_where))
    if role == "assistant":
        text = "".join(p["text"] for p in parts)
        out = {"role": "assistant", "content": text or None}
        if calls:
            out["tool_calls"] = calls
        elif not text:
            out["content"] = ""
        return [out]
    return results + ([{"role": "user", "content": parts}] if parts else [])


_BLOCKS_OF = {
    "user": ("text", "image", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
}


def _image_part(block: dict, where: str) -> dict[str, Any]:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_TYPES:
            raise ApiError(
                f"{where}.source.media_type: {media_type!r} is not one of {', '.join(IMAGE_TYPES)}",
                param="messages",
            )
        if not isinstance(data, str) or not data:
            raise ApiError(f"{where}.source.data: must be base64 text", param="messages")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise ApiError(
        f'{where}.source: must be {{"type": "base64", "media_type", "data"}} or '
        '{"type": "url", "url"}',
        param="messages",
    )


def _tool_call(block: dict, where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise ApiError(f"{where}: a tool_use block needs a string id and name", param="messages")
    if not isinstance(arguments, dict):
        raise ApiError(f"{where}.input: must be an object", param="messages")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _tool_result(block: dict, where: str) -> dict[str, Any]:
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str):
        raise ApiError(f"{where}.tool_use_id: must be a string", param="messages")
    if isinstance(content, list):
        content = "\n".join(_text_of(b, f"{where}.content[{i}]") for i, b in enumerate(content))
    elif not isinstance(content, str):
        raise ApiError(
            f"{where}.content: must be a string or a list of text blocks", param="messages"
        )
    if block.get("is_error") is True:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _stop_sequences(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ApiError(
            "stop_sequences: must be a list of non-empty strings", param="stop_sequences"
        )
    return value


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise ApiError("tools: must be a list of tools", param="tools")
    out = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(
                f"{where}: only client tools ({{name, description, input_schema}}) are "
                f"served here, not {kind!r}",
                param="tools",
            )
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise ApiError(f"{where}.input_schema: must be a JSON Schema object", param="tools")
        function = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    out: dict[str, Any] = {}
    if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    if kind == "auto":
        return out  # the server's default: calls parsed from free text where it can
    if kind == "any":
        return {**out, "tool_choice": "required"}
    if kind == "none":
        return {"tool_choice": "none"}
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {**out, "tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    raise ApiError(
        'tool_choice: must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}',
        param="tool_choice",
    )
