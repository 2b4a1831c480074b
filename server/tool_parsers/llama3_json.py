"""`--tool-call-parser llama3_json`: Llama 3.1 / 3.2 JSON tool calling.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The calls are the whole output: after leading whitespace and an optional `<|python_tag|>`,
one or more call objects (`parameters` or `arguments`), separated by an optional `;` and
whitespace. Reading stops at the first thing that is not a call object; that thing and
what follows are content. An output that does not start with a call object is all content,
the python tag included (`<|python_tag|>` followed by code is Llama's code interpreter, not a
JSON call), and so is a JSON answer that is not a call (`{"answer": 42}`).

A stream holds the text back while it could still open a call: whitespace, the python tag or
a start of it. A call is sent when its object closes and decodes (CallScanner finds the close);
a call already made stands whatever follows it, since the reading rule above never takes one
back.
"""

from __future__ import annotations

import enum
import logging

from ringllm.server.tool_parsers import (
    ExtractedToolCalls,
    StreamDelta,
    ToolParser,
    ToolStream,
    register,
)
from ringllm.server.tool_parsers.call_json import (
    DECODER,
    CallScanner,
    call_fields,
    decode_call,
    strip_content,
)

logger = logging.getLogger(__name__)

PYTHON_TAG = "<|python_tag|>"
_SPACE = " \t\n\r"


def find_first_object(text: str) -> int | None:
    """Where the first call object starts in `text` (its `{`); -1 if the text cannot be tool
    calls; None if that is not decided yet (only whitespace and the python tag, or a start
    of it, so far)."""
    head = text.lstrip()
    if head.startswith(PYTHON_TAG):
        head = head[len(PYTHON_TAG) :].lstrip()
    elif PYTHON_TAG.startswith(head):
        return None
    if not head:
        return None
    return len(text) - len(head) if head[0] == "{" else -1


def _after_separator(text: str, position: int) -> int:
    while position < len(text) and text[position] in _SPACE:
        position += 1
    if position < len(text) and text[position] == ";":
        position += 1
        while position < len(text) and text[position] in _SPACE:
            position += 1
    return position


@register
class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def extract(self, text: str) -> ExtractedToolCalls:
        start = find_first_object(text)
        position = start if start is not None and start >= 0 else len(text)
        calls = []
        while position < len(text) and text[position] == "{":
            try:
                obj, end = DECODER.raw_decode(text, position)
            except (ValueError, RecursionError):
                break
            fields = call_fields(obj)
            if fields is None:
                break
            calls.append(self.make_call(*fields))
            position = _after_separator(text, end)
        if not calls:
            return ExtractedToolCalls(tool_calls=[], content=strip_content(text))
        return ExtractedToolCalls(tool_calls=calls, content=strip_content(text[position:]))

    def stream(self) -> Llama3JsonToolStream:
        return Llama3JsonToolStream(self)


class _State(enum.Enum):
    OPENING = "opening"  # not yet known whether the text is calls
    IN_CALL = "in_call"  # reading a call object
    BETWEEN = "between"  # after a call: a separator, then the next object or content
    CONTENT = "content"  # everything from here on is content


class Llama3JsonToolStream(ToolStream):
    def __init__(self, parser: Llama3JsonToolParser) -> None:
        super().__init__(parser)
        self._state = _State.OPENING
        self._opening = ""  # the text before the first object (all of it while OPENING)
        self._object: list[str] = []  # the open object's text so far
        self._scanner: CallScanner | None = None
        self._index: int | None = None  # the open object's call, once announced
        self._num_calls_done = 0
        self._separated = False  # BETWEEN: its `;` has come

    def feed(self, text: str) -> StreamDelta:
        if self._state is _State.OPENING:
            text = self._read_opening(text)
        while text:
            if self._state is _State.CONTENT:
                self._emit_content(text)
                break
            if self._state is _State.BETWEEN:
                text = self._read_separator(text)
            else:
                text = self._read_object(text)
        return self._take()

    def finish(self) -> StreamDelta:
        if self._state is _State.OPENING:
            self._emit_content(self._opening)
        elif self._state is _State.IN_CALL:
            self._give_up_object()
        return self._take()

    def _read_opening(self, text: str) -> str:
        self._opening += text
        start = find_first_object(self._opening)
        if start is None:
            return ""
        if start < 0:
            self._state = _State.CONTENT
            text, self._opening = self._opening, ""
            return text
        text, self._opening = self._opening[start:], self._opening[:start]
        self._begin_object()
        return text

    def _read_separator(self, text: str) -> str:
        for i, c in enumerate(text):
            if c in _SPACE:
                continue
            if c == ";" and not self._separated:
                self._separated = True
                continue
            if c == "{":
                self._begin_object()
            else:
                self._state = _State.CONTENT
            return text[i:]
        return ""

    def _begin_object(self) -> None:
        self._state = _State.IN_CALL
        self._object = []
        self._scanner = CallScanner()
        self._index = None

    def _read_object(self, text: str) -> str:
        taken = self._scanner.feed(text)
        if self._scanner.broken:
            self._object.append(text)
            self._give_up_object()
            return ""
        self._object.append(text[:taken])
        if self.parser.stream_arguments:
            self._index = self._follow(self._scanner, self._index)
        if self._scanner.complete:
            self._end_object()
        return text[taken:]

    def _end_object(self) -> None:
        fields = decode_call("".join(self._object))
        if fields is None:
            self._give_up_object()
            return
        name, arguments = fields
        index = self._open_call(name) if self._index is None else self._index
        self._close_call(index, arguments)
        self._num_calls_done += 1
        self._state = _State.BETWEEN
        self._separated = False

    def _give_up_object(self) -> None:
        """The open object is no call: it and all that follows are content, and so is the
        opening if no call came before it."""
        if self._index is not None:
            logger.warning("tool call %d was streamed before it proved malformed", self._index)
        lead = self._opening if self._num_calls_done == 0 else ""
        self._emit_content(lead + "".join(self._object))
        self._state = _State.CONTENT
