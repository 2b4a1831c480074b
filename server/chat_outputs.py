"""A chat choice's text -> OpenAI's message: content, reasoning_content, tool_calls.

    OutputParsing     the server's parsers (--tool-call-parser, --reasoning-parser,
                      --enable-auto-tool-choice), checked at start-up
    ChoiceOutput      one choice: `final(text, finish_reason)` for a whole response,
                      `feed(delta)` / `finish(finish_reason)` for a stream's deltas

The text is taken apart in order: first the reasoning (`<think>...</think>`, with a
reasoning parser), then the tool calls in what is left, by the request's tool mode:

    named      the grammar made the whole text the function's arguments: one call
    required   the grammar made it a JSON array of {"name", "parameters"}: one call each
    auto       the tool-call parser finds calls in free text (the rest is content)
    none       no tool calls

A choice that made calls ends with finish_reason "tool_calls" (when it ended by itself;
"length" stays "length"). Streamed deltas, concatenated, give the whole response's message:
the same content, reasoning and tool calls (ids included) as `final` would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ringllm.server.reasoning_parsers import reasoning_parser
from ringllm.server.structured_request import ToolRequest
from ringllm.server.tool_parsers import ToolCall, ToolCallDelta, new_call_id, tool_parser


@dataclass(frozen=True)
class OutputParsing:
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    auto_tool_choice: bool = False

    def check(self) -> None:
        """ValueError naming the known parsers for an unknown name."""
        if self.tool_parser is not None:
            tool_parser(self.tool_parser)
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)

    def choice(self, tools: ToolRequest | None) -> ChoiceOutput:
        return ChoiceOutput(self, tools)


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _delta_json(delta: ToolCallDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": delta.index}
    if delta.id is not None:
        out["id"] = delta.id
        out["type"] = "function"
    function: dict[str, Any] = {}
    if delta.name is not None:
        function["name"] = delta.name
    function["arguments"] = delta.arguments
    out["function"] = function
    return out


@dataclass
class ChoiceOutput:
    parsing: OutputParsing
    tools: ToolRequest | None
    _reasoning: Any = None
    _tools_stream: Any = None
    _named: dict | None = None
    called: bool = False
    _ids: list[str] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return self.tools.mode if self.tools is not None else "none"

    # ---- a whole response ------------------------------------------------------------

    def final(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the message, the finish reason) of a whole choice."""
        message: dict[str, Any] = {"role": "assistant"}
        if self.parsing.reasoning_parser is not None:
            split = reasoning_parser(self.parsing.reasoning_parser).split(text)
            message["reasoning_content"] = split.reasoning
            text = split.content or ""
        calls, content = self._calls_of(text)
        message["content"] = content
        if calls:
            message["tool_calls"] = [tool_call_json(c) for c in calls]
        return message, _finish(finish_reason, bool(calls))

    def _calls_of(self, text: str) -> tuple[list[ToolCall], str | None]:
        mode = self.mode
        if mode == "named":
            return [ToolCall(self.tools.named, text, new_call_id())], None
        if mode == "required":
            return _required_calls(text, self.tools.tools), None
        if mode == "auto" and self.parsing.tool_parser is not None:
            extracted = tool_parser(self.parsing.tool_parser, self.tools.tools).extract(text)
            return extracted.tool_calls, extracted.content
        return [], text

    # ---- a stream ------------------------------------------------------------------------

    def feed(self, text: str) -> dict[str, Any]:
        """The delta (content / reasoning_content / tool_calls) for the next piece of text."""
        delta: dict[str, Any] = {}
        if self.parsing.reasoning_parser is not None:
            if self._reasoning is None:
                self._reasoning = reasoning_parser(self.parsing.reasoning_parser).stream()
            split = self._reasoning.feed(text)
            if split.reasoning:
                delta["reasoning_content"] = split.reasoning
            text = split.content or ""
        self._tool_delta(text, delta, last=False)
        return delta

    def finish(self, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """What is left to send when the choice ends, and its finish reason."""
        delta: dict[str, Any] = {}
        text = ""
        if self._reasoning is not None:
            split = self._reasoning.finish()
            if split.reasoning:
                delta["reasoning_content"] = split.reasoning
            text = split.content or ""
        self._tool_delta(text, delta, last=True)
        return delta, _finish(finish_reason, self.called)

    def _tool_delta(self, text: str, delta: dict[str, Any], last: bool) -> None:
        mode = self.mode
        if mode == "named":
            pieces = []
            if not self.called:
                self.called = True
                pieces.append(ToolCallDelta(0, new_call_id(), self.tools.named, text))
            elif text:
                pieces.append(ToolCallDelta(0, arguments=text))
            if pieces:
                delta["tool_calls"] = [_delta_json(p) for p in pieces]
            return
        if mode not in ("required", "auto") or (
            mode == "auto" and self.parsing.tool_parser is None
        ):
            if text:
                delta["content"] = text
            return
        if self._tools_stream is None:
            if mode == "required":
                self._tools_stream = _RequiredStream(self.tools.tools)
            else:
                self._tools_stream = tool_parser(
                    self.parsing.tool_parser, self.tools.tools
                ).stream()
        stream = self._tools_stream
        out = stream.feed(text) if text else None
        pieces, content = (list(out.tool_calls), out.content) if out else ([], None)
        if last:
            end = stream.finish()
            pieces += end.tool_calls
            content = (content or "") + (end.content or "") or None
        if content:
            delta["content"] = content
        if pieces:
            self.called = True
            delta["tool_calls"] = [_delta_json(p) for p in pieces]


def _finish(finish_reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def _required_calls(text: str, tools) -> list[ToolCall]:
    """The calls of a required-mode text: read as its stream reads it, so a response and a
    stream of the same text agree (an array cut short by max_tokens keeps its complete
    calls)."""
    stream = _RequiredStream(tools)
    deltas = [*stream.feed(text).tool_calls, *stream.finish().tool_calls]
    calls: dict[int, list] = {}
    for delta in deltas:
        call = calls.setdefault(delta.index, [delta.id, delta.name, ""])
        call[0] = call[0] or delta.id
        call[1] = call[1] or delta.name
        call[2] += delta.arguments
    return [
        ToolCall(name, arguments, call_id)
        for call_id, name, arguments in calls.values()
        if _is_json(arguments)  # a call cut short by max_tokens is not reported
    ]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class _RequiredStream:
    """tool_choice "required": the text is a JSON array of {"name", "parameters"} objects
    (arguments streamed as they are written: the grammar makes every call well-formed)
    (the grammar says so). Streamed through the llama3_json parser, which reads such
    objects separated by ";": the array's own brackets and top-level commas are turned
    into that as the text arrives (strings and nesting followed, so none inside count)."""

    def __init__(self, tools) -> None:
        self._inner = tool_parser("llama3_json", tools, stream_arguments=True).stream()
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str):
        return self._inner.feed(self._translate(text))

    def finish(self):
        return self._inner.finish()

    def _translate(self, text: str) -> str:
        out = []
        for c in text:
            if self._in_string:
                out.append(c)
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                continue
            if c == '"':
                self._in_string = True
            elif c in "[{":
                self._depth += 1
                if self._depth == 1:  # the array's own bracket
                    continue
            elif c in "]}":
                self._depth -= 1
                if self._depth == 0:
                    continue
            elif c == "," and self._depth == 1:
                out.append(";")
                continue
            out.append(c)
        return "".join(out)
