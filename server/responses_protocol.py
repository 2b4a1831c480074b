"""OpenAI's Responses API (`POST /v1/responses`) -> the chat request the engine serves.

A Responses body is checked here, field by field (errors name the Responses field), and
its conversation is translated into the chat-completions body `protocol.parse_chat_request`
takes, so sampling, limits, tools, the grammar behind `tool_choice` and the chat template
are the chat endpoint's own:

    instructions                             -> a system message, first
    input "text"                             -> one user message
    input items
        message (user | system | developer)  -> that message; input_text parts as text,
                                                input_image (image_url) as an image_url part
        message (assistant)                  -> an assistant message (output_text parts)
        function_call                        -> a tool call of the assistant message it follows
                                                (a new one when none is open)
        function_call_output                 -> a tool message (tool_call_id = call_id)
        reasoning                            -> dropped (a template renders no past thinking)
        item_reference                       -> the stored item it names
    previous_response_id                     -> the stored conversation of that response (its
                                                input and output items) before `input`; its
                                                instructions are not carried over (OpenAI's rule)
    max_output_tokens, temperature, top_p, seed and vLLM's sampling extras (top_k,
    min_p, repetition_penalty, ignore_eos, ...: ENGINE_EXTRAS)
                                             -> the chat body's
    tools [{"type": "function", name, description, parameters, strict}]
                                             -> function tools
    tool_choice "auto" | "none" | "required" | {"type": "function", "name"}
                                             -> the chat endpoint's
    tool_choice {"type": "allowed_tools", "mode", "tools"}
                                             -> tools cut to those named; mode "auto" or
                                                "required" (one tool required: that one)
    parallel_tool_calls                      -> parallel_tool_calls
    text.format json_schema | json_object    -> response_format (the grammar); dropped when
                                                tool_choice forces calls (no text to shape)
    top_logprobs, include "message.output_text.logprobs"
                                             -> logprobs, top_logprobs

Unknown fields are a 400; what only matters to a hosted service (`include`'s other values,
`prompt_cache_key`, `service_tier`, `safety_identifier`, `user`, `metadata` (echoed back),
`truncation` "disabled") is accepted. Tools the server does not run itself (web search,
file search, MCP, ...) are refused, as are `conversation` (the Conversations API) and
`prompt` (stored prompt templates), which this server does not have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringllm.server.errors import ApiError
from ringllm.server.limits import ServerLimits
from ringllm.server.protocol import ChatRequest, parse_chat_request

FIELDS = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
    "tool_choice", "parallel_tool_calls", "text", "reasoning", "stream", "store", "background",
    "previous_response_id", "metadata", "top_logprobs", "include", "truncation", "user",
    "stream_options", "max_tool_calls",
    "seed",  # not OpenAI's: the engine's, for reproducible sampling
}  # fmt: skip
# vLLM's sampling extras, as the chat endpoint takes them (benchmarks send ignore_eos)
ENGINE_EXTRAS = {
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "min_tokens", "ignore_eos", "skip_special_tokens",
}  # fmt: skip
FIELDS |= ENGINE_EXTRAS
# accepted and ignored: how a hosted service bills, routes, caches or traces a request
IGNORED = {
    "service_tier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
    "safety_identifier",
}  # fmt: skip
REFUSED = {
    "conversation": "the Conversations API is not served here; chain responses with "
    "previous_response_id",
    "prompt": "stored prompt templates are not served here; send instructions and input",
    "context_management": "server-side context compaction is not supported",
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INPUT_ROLES = ("user", "system", "developer", "assistant")
# the chat body's names -> this API's, for the `param` of an error parse_chat_request raises
RENAME = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "logprobs": "top_logprobs",
}


@dataclass
class ResponsesRequest:
    chat: ChatRequest
    body: dict[str, Any]  # the fields a response echoes (instructions, tools, text, ...)
    input_items: list[dict[str, Any]]  # this request's input, as items with ids
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    want_logprobs: bool = False


def parse_responses_request(
    body: Any,
    limits: ServerLimits,
    max_model_len: int | None,
    auto_tool_choice: bool,
    history: list[dict[str, Any]] | None = None,
    references: dict[str, dict[str, Any]] | None = None,
) -> ResponsesRequest:
    """`history`: the items of the previous response's conversation (input and output);
    `references`: stored items by id, for `item_reference` input items."""
    body = check_body(body)
    items = input_items(body.get("input"), references or {})
    chat_body = to_chat_body(body, [*(history or []), *items])
    try:
        chat = parse_chat_request(chat_body, limits, max_model_len, auto_tool_choice)
    except ApiError as exc:
        exc.param = RENAME.get(exc.param, exc.param)
        exc.message = _renamed(exc.message)
        raise
    store = body.get("store", True)
    background = body.get("background", False)
    if background and not store:
        raise ApiError(
            "background: a background response must be stored (store: true), to be fetched",
            param="background",
        )
    return ResponsesRequest(
        chat=chat,
        body=body,
        input_items=items,
        store=store,
        background=background,
        previous_response_id=body.get("previous_response_id"),
        want_logprobs="logprobs" in chat_body,
    )


def _renamed(message: str) -> str:
    for old, new in (("max_completion_tokens", "max_output_tokens"), ("messages", "input")):
        if message.startswith(old):
            return new + message[len(old) :]
    return message


def check_body(body: Any) -> dict[str, Any]:
    """The body's top-level fields checked (null fields dropped, as OpenAI's API reads them)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    body = {key: value for key, value in body.items() if value is not None}
    for key in body:
        if key in REFUSED:
            raise ApiError(f"{key}: {REFUSED[key]}", param=key)
        if key not in FIELDS and key not in IGNORED:
            raise ApiError(f"unrecognized request argument supplied: {key}", param=key)
    for name in ("store", "background", "stream", "parallel_tool_calls"):
        if name in body and not isinstance(body[name], bool):
            raise ApiError(f"{name}: must be true or false", param=name)
    for name in ("instructions", "previous_response_id", "user"):
        if name in body and not isinstance(body[name], str):
            raise ApiError(f"{name}: must be a string", param=name)
    if "input" not in body:
        raise ApiError("input: is required (a string or a list of input items)", param="input")
    _check_metadata(body.get("metadata"))
    _check_strings(body.get("include"), "include")
    if body.get("truncation", "disabled") not in ("disabled", "auto"):
        raise ApiError('truncation: must be "auto" or "disabled"', param="truncation")
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 0):
        raise ApiError("top_logprobs: must be an integer from 0 to 20", param="top_logprobs")
    limit = body.get("max_tool_calls")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ApiError("max_tool_calls: must be a positive integer", param="max_tool_calls")
    _check_reasoning(body.get("reasoning"))
    if body.get("stream_options") is not None and not body.get("stream"):
        raise ApiError("stream_options: only with stream: true", param="stream_options")
    return body


def _check_metadata(metadata: Any) -> None:
    """OpenAI's rule: at most 16 string pairs, keys up to 64 characters, values 512."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise ApiError("metadata: must be an object of at most 16 pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise ApiError(
                f"metadata.{key[:64]}: keys are strings of up to 64 characters, values strings "
                "of up to 512",
                param="metadata",
            )


def _check_strings(value: Any, name: str) -> None:
    if value is not None and not (
        isinstance(value, list) and all(isinstance(v, str) for v in value)
    ):
        raise ApiError(f"{name}: must be a list of strings", param=name)


def _check_reasoning(reasoning: Any) -> None:
    """{"effort", "summary"}: accepted; a model thinks as its template makes it, and its
    thinking is reported (a reasoning item) where the server runs a reasoning parser."""
    if reasoning is None:
        return
    if not isinstance(reasoning, dict) or set(reasoning) - {
        "effort",
        "summary",
        "generate_summary",
    }:
        raise ApiError('reasoning: must be {"effort"?, "summary"?}', param="reasoning")


# ---- input items ---------------------------------------------------------------------


def input_items(raw: Any, references: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as a list of checked items (a string is one user message)."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise ApiError("input: must be a string or a list of input items", param="input")
    items = []
    for index, item in enumerate(raw):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise ApiError(f"{where}: must be an object (an input item)", param="input")
        kind = item.get("type", "message")
        if kind == "item_reference":
            items.append(_referenced(item, where, references))
            continue
        check = _ITEM_CHECKS.get(kind)
        if check is None:
            raise ApiError(
                f"{where}.type: {kind!r} is not an input item this server takes (one of "
                f"{', '.join([*_ITEM_CHECKS, 'item_reference'])})",
                param="input",
            )
        items.append(check(item, where))
    return items


def _message_item(item: dict, where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise ApiError(
            f"{where}.role: {role!r} is not one of {', '.join(INPUT_ROLES)}", param="input"
        )
    content = item.get("content")
    if isinstance(content, str):
        return {**item, "type": "message"}
    if not isinstance(content, list):
        raise ApiError(
            f"{where}.content: must be a string or a list of content parts", param="input"
        )
    allowed = _PARTS_OF_ROLE[role]
    for index, part in enumerate(content):
        part_where = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise ApiError(
                f"{part_where}.type: {kind!r} is not a {role} content part here (one of "
                f"{', '.join(allowed)})",
                param="input",
            )
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise ApiError(
                    f"{part_where}.image_url: a URL (data:, file: or http(s):) is required; "
                    "file_id inputs are not supported",
                    param="input",
                )
        elif not isinstance(part.get("refusal" if kind == "refusal" else "text"), str):
            raise ApiError(f"{part_where}.text: must be a string", param="input")
    return {**item, "type": "message"}


_PARTS_OF_ROLE = {
    "user": ("input_text", "input_image"),
    "system": ("input_text",),
    "developer": ("input_text",),
    "assistant": ("output_text", "refusal", "input_text"),
}


def _function_call_item(item: dict, where: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise ApiError(f"{where}.{name}: must be a string", param="input")
    return item


def _function_call_output_item(item: dict, where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise ApiError(f"{where}.call_id: must be a string", param="input")
    output = item.get("output")
    if isinstance(output, list):
        for index, part in enumerate(output):
            if not (
                isinstance(part, dict)
                and part.get("type") == "input_text"
                and isinstance(part.get("text"), str)
            ):
                raise ApiError(
                    f"{where}.output[{index}]: only input_text parts are taken in a function "
                    "call's output",
                    param="input",
                )
    elif not isinstance(output, str):
        raise ApiError(
            f"{where}.output: must be a string or a list of input_text parts", param="input"
        )
    return item


def _reasoning_item(item: dict, where: str) -> dict[str, Any]:
    return item


def _referenced(item: dict, where: str, references: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ref = item.get("id")
    found = references.get(ref) if isinstance(ref, str) else None
    if found is None:
        raise ApiError(
            f"{where}.id: item {ref!r} is not stored here (a stored response's input or output "
            "item)",
            param="input",
        )
    return found


_ITEM_CHECKS = {
    "message": _message_item,
    "function_call": _function_call_item,
    "function_call_output": _function_call_output_item,
    "reasoning": _reasoning_item,
}


# ---- the chat body -------------------------------------------------------------------


def to_chat_body(body: dict[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body of a checked Responses body and its conversation items."""
    messages = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    messages += to_messages(items)
    if not messages:
        raise ApiError("input: the conversation is empty", param="input")
    chat: dict[str, Any] = {"messages": messages}
    for name in ("model", "temperature", "top_p", "stream", "seed", "parallel_tool_calls"):
        if name in body:
            chat[name] = body[name]
    for name in ENGINE_EXTRAS & set(body):
        chat[name] = body[name]
    if "max_output_tokens" in body:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if "tools" in body:
        chat["tools"] = _tools(body["tools"])
    if "tool_choice" in body:
        chat["tool_choice"], allowed = _tool_choice(body["tool_choice"])
        if allowed is not None:
            chat["tools"] = _allowed(chat.get("tools") or [], allowed)
    response_format = _text_format(body.get("text"))
    if response_format is not None and not _forces_calls(chat.get("tool_choice")):
        # OpenAI's reading: text.format shapes the text of a response, and one whose tool
        # choice forces calls has none (an agent keeps its output type on every turn)
        chat["response_format"] = response_format
    top = body.get("top_logprobs")
    if LOGPROBS_INCLUDE in body.get("include", ()) or top:
        chat["logprobs"] = True
        if top:
            chat["top_logprobs"] = top
    return chat


def to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conversation items as chat messages: function calls join the assistant message
    they follow; each function output is a tool message."""
    messages: list[dict[str, Any]] = []
    open_turn: dict[str, Any] | None = None  # the assistant message calls may still join
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            message = {"role": item["role"], "content": _content(item)}
            if item["role"] == "developer":
                message["role"] = "system"  # what chat templates know
            messages.append(message)
            open_turn = message if item["role"] == "assistant" else None
        elif kind == "function_call":
            if open_turn is None:
                open_turn = {"role": "assistant", "content": None}
                messages.append(open_turn)
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            open_turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item["output"]
            if isinstance(output, list):
                output = "".join(part["text"] for part in output)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            open_turn = None
        # reasoning items: dropped; they neither open nor close an assistant turn
    return messages


def _content(item: dict[str, Any]) -> Any:
    content = item["content"]
    if isinstance(content, str):
        return content
    if item["role"] != "user":
        return "".join(part.get("text") or part.get("refusal") or "" for part in content)
    parts = []
    for part in content:
        if part["type"] == "input_image":
            image = {"url": part["image_url"]}
            if part.get("detail") in ("low", "high", "auto"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": part["text"]})
    return parts


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise ApiError("tools: must be a list of tools", param="tools")
    out = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ApiError(
                f"tools[{index}].type: only function tools are served here (the caller runs "
                f"them), not {kind!r}",
                param="tools",
            )
        function = {"name": tool.get("name")}
        for name in ("description", "parameters", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        out.append({"type": "function", "function": function})
    return out


def _forces_calls(choice: Any) -> bool:  # (a chat tool_choice)
    return choice == "required" or isinstance(choice, dict)


def _tool_choice(choice: Any) -> tuple[Any, list[str] | None]:
    """(the chat tool_choice, the names of the allowed tools: None for all)."""
    if choice in ("auto", "none", "required"):
        return choice, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}, None
    if kind == "allowed_tools":
        mode, tools = choice.get("mode"), choice.get("tools")
        names = [t.get("name") for t in tools] if isinstance(tools, list) else None
        if (
            mode not in ("auto", "required")
            or not names
            or not all(
                isinstance(t, dict)
                and t.get("type") == "function"
                and isinstance(t.get("name"), str)
                for t in tools
            )
        ):
            raise ApiError(
                'tool_choice: allowed_tools needs "mode" ("auto" or "required") and "tools", '
                'a non-empty list of {"type": "function", "name": ...}',
                param="tool_choice",
            )
        if mode == "required" and len(names) == 1:
            return {"type": "function", "function": {"name": names[0]}}, names
        return mode, names
    raise ApiError(
        'tool_choice: must be "auto", "none", "required", {"type": "function", "name": ...} '
        'or {"type": "allowed_tools", "mode", "tools"}',
        param="tool_choice",
    )


def _allowed(tools: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """The tools an allowed_tools choice leaves: the model is shown and may call only
    these (OpenAI keeps the rest in the prompt; a chat template here renders the list)."""
    known = {tool["function"]["name"] for tool in tools}
    missing = [name for name in names if name not in known]
    if missing:
        raise ApiError(
            f"tool_choice: allowed tool {missing[0]!r} is not in tools", param="tool_choice"
        )
    return [tool for tool in tools if tool["function"]["name"] in names]


def _text_format(text: Any) -> dict[str, Any] | None:
    """text.format as a chat response_format (None: free text); `verbosity` is accepted."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise ApiError('text: must be {"format"?, "verbosity"?}', param="text")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise ApiError("text.format.schema: must be a JSON Schema object", param="text")
        spec = {"name": fmt.get("name") or "output", "schema": schema}
        for name in ("strict", "description"):
            if fmt.get(name) is not None:
                spec[name] = fmt[name]
        return {"type": "json_schema", "json_schema": spec}
    raise ApiError(
        'text.format: must be {"type": "text"}, {"type": "json_object"} or {"type": '
        '"json_schema", "name", "schema", "strict"?}',
        param="text",
    )
