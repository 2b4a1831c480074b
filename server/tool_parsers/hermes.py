"""`--tool-call-parser hermes`: the format of Hermes 2 Pro, Qwen2.5 and Qwen3.

    I'll check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

A block runs from `<tool_call>` to the first `</tool_call>` after it, or to the end of the text
if generation stopped first. Its body must be exactly one call object; `arguments` may be an
object or a JSON text of one. A block whose body is not a call goes to content whole, its
markers included, so nothing the model wrote is lost. Content is everything outside the
blocks, stripped.

A stream places the text as it comes: outside a block it sends content but holds back a tail
that could be the start of `<tool_call>`; inside it collects the body, holding back a tail
that could be the start of `</tool_call>`. The block's call is sent when the block ends and
its body decodes (or, with `stream_arguments`, as CallScanner reads it).
"""

from __future__ import annotations

import logging

from ringllm.server.tool_parsers import (
    ExtractedToolCalls,
    StreamDelta,
    ToolParser,
    ToolStream,
    register,
)
from ringllm.server.tool_parsers.call_json import (
    CallScanner,
    decode_call,
    held_marker_length,
    strip_content,
)

logger = logging.getLogger(__name__)

START = "<tool_call>"
END = "</tool_call>"


@register
class HermesToolParser(ToolParser):
    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        calls = []
        content_parts = []
        position = 0
        while (start := text.find(START, position)) >= 0:
            content_parts.append(text[position:start])
            body_start = start + len(START)
            end = text.find(END, body_start)
            body_end = end if end >= 0 else len(text)
            position = body_end + len(END) if end >= 0 else len(text)
            fields = decode_call(text[body_start:body_end])
            if fields is None:
                content_parts.append(text[start:position])
            else:
                calls.append(self.make_call(*fields))
        content_parts.append(text[position:])
        return ExtractedToolCalls(tool_calls=calls, content=strip_content("".join(content_parts)))

    def stream(self) -> HermesToolStream:
        return HermesToolStream(self)


class HermesToolStream(ToolStream):
    def __init__(self, parser: HermesToolParser) -> None:
        super().__init__(parser)
        self._held = ""  # text not yet placed: it may end in the start of a marker
        self._body: list[str] | None = None  # the open block's body so far; None: outside
        self._scanner: CallScanner | None = None  # stream_arguments: reads the open body
        self._index: int | None = None  # the open block's call, once announced

    def feed(self, text: str) -> StreamDelta:
        self._held += text
        while self._place_held():
            pass
        return self._take()

    def finish(self) -> StreamDelta:
        if self._body is None:
            self._emit_content(self._held)
        else:
            self._extend_body(self._held)
            self._close_block(end_marker="")
        self._held = ""
        return self._take()

    def _place_held(self) -> bool:
        """Places the held text up to the next marker (True: one was found, go on) or up to
        what could be the start of one (False)."""
        marker = START if self._body is None else END
        found = self._held.find(marker)
        placed = found if found >= 0 else len(self._held) - held_marker_length(self._held, marker)
        if self._body is None:
            self._emit_content(self._held[:placed])
        else:
            self._extend_body(self._held[:placed])
        if found < 0:
            self._held = self._held[placed:]
            return False
        self._held = self._held[found + len(marker) :]
        if self._body is None:
            self._open_block()
        else:
            self._close_block(end_marker=END)
        return True

    def _open_block(self) -> None:
        self._body = []
        self._index = None
        self._scanner = CallScanner() if self.parser.stream_arguments else None

    def _extend_body(self, text: str) -> None:
        self._body.append(text)
        scanner = self._scanner
        if scanner is None or not text:
            return
        scanner.feed(text)
        self._index = self._follow(scanner, self._index)

    def _close_block(self, end_marker: str) -> None:
        body = "".join(self._body)
        fields = decode_call(body)
        if fields is None:
            if self._index is not None:
                logger.warning(
                    "tool call %d was streamed before its block proved malformed", self._index
                )
            self._emit_content(START + body + end_marker)
        else:
            name, arguments = fields
            index = self._open_call(name) if self._index is None else self._index
            self._close_call(index, arguments)
        self._body = None
        self._scanner = None
        self._index = None
