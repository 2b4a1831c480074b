"""Tool-call parsers: the model's generated text in, OpenAI `tool_calls` and content out.

Each parser reads one model family's tool-call format (`--tool-call-parser NAME`). It has
two entry points, and they must agree:

    parser.extract(text)                   the whole text -> ExtractedToolCalls  (non-streaming)
    s = parser.stream(); s.feed(piece)...  pieces of the text -> StreamDelta each (streaming)
                         s.finish()        the end: flushes what was held back

Invariants of a stream, for every way of cutting the text into pieces (the tests try every
cut point and one character at a time):
- its content deltas, concatenated, are `extract(text).content` ("" for None); content is
  the text outside tool calls with its surrounding whitespace stripped, so a stream holds
  back whitespace until more content follows it and drops what is left at the end;
- call i is sent as deltas with index i; its id and its name come once, in its first
  delta; its argument fragments, concatenated, are `extract(text).tool_calls[i].arguments`;
- text that may still turn out to be part of a marker is held back, never sent as content;
- arguments are canonical: `json.dumps(arguments, ensure_ascii=False)`, whatever spacing or
  escapes the model used, so a client can compare or re-parse them;
- a call is sent only once it is known to be well-formed (hermes: its `</tool_call>` came or
  the text ended; llama3_json: its object closed); a malformed one goes to content whole.

NOTE: the last rule means arguments arrive when the call is complete, not as they are
generated. `stream_arguments=True` trades it away: a call is announced as soon as its name is
complete and its arguments follow as the model writes them, each fragment a prefix of the
canonical text (CallScanner below). A call that later proves malformed cannot be taken back
then: the client has a broken call, and the block's text still goes to content.

JSON objects are decoded with the first of duplicate keys winning (json's default is the
last): a streamed member cannot be unsent, so both paths keep the first.

Adding a parser is one new module with a `@register` class, imported at the end of this file.
"""

from __future__ import annotations

import logging
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

logger = logging.getLogger(__name__)

CALL_ID_PREFIX = "call_"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # canonical JSON text of the arguments object
    id: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    tool_calls: list[ToolCall]  # empty: the model called no tool
    content: str | None  # the text outside tool calls, stripped; None if nothing is left


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of OpenAI's streamed `delta.tool_calls[i]`."""

    index: int
    id: str | None = None  # in the first delta of the call only
    name: str | None = None  # in the first delta of the call only
    arguments: str = ""  # the next fragment of the arguments text


@dataclass(frozen=True)
class StreamDelta:
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return CALL_ID_PREFIX + secrets.token_hex(12)


from ringllm.server.tool_parsers.call_json import CallScanner, canonical_arguments  # noqa: E402

__all__ = [
    "ExtractedToolCalls",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStream",
    "canonical_arguments",
    "new_call_id",
    "register",
    "tool_parser",
]

# --- parsers and streams ----------------------------------------------------------------


class ToolParser(ABC):
    """One model family's tool-call format. `tools` is the request's OpenAI `tools` list; a
    call of a tool not in it is still returned (the client decides), and logged."""

    name: ClassVar[str]

    def __init__(self, tools: list[dict] | None = None, *, stream_arguments: bool = False):
        self.tool_names = frozenset(_tool_name(tool) for tool in tools or ()) - {None}
        self.stream_arguments = stream_arguments

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls: ...

    @abstractmethod
    def stream(self) -> ToolStream:
        """A fresh incremental parser for one request's text."""

    def make_call(self, name: str, arguments: str) -> ToolCall:
        self.note_name(name)
        return ToolCall(name=name, arguments=arguments, id=new_call_id())

    def note_name(self, name: str) -> None:
        if self.tool_names and name not in self.tool_names:
            logger.debug("the model called %r, which is not among the request's tools", name)


def _tool_name(tool: Any) -> str | None:
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


class ToolStream(ABC):
    """The incremental side of a parser. Subclasses read the text; this base turns what they
    find into deltas: `_emit_content`, `_open_call`, `_send_arguments`, `_close_call`, and
    `_take` collects what was made since the last feed."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._content = _StreamedStrip()
        self._content_parts: list[str] = []
        self._call_deltas: list[ToolCallDelta] = []
        self._num_calls = 0
        self._sent_arguments: list[str] = []  # of the latest call

    @abstractmethod
    def feed(self, text: str) -> StreamDelta:
        """The next piece of generated text -> what can be sent now."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The text is over: what was held back, resolved."""

    @property
    def called_tools(self) -> bool:
        return self._num_calls > 0

    def _emit_content(self, text: str) -> None:
        kept = self._content.take(text)
        if kept:
            self._content_parts.append(kept)

    def _open_call(self, name: str) -> int:
        self.parser.note_name(name)
        index = self._num_calls
        self._num_calls += 1
        self._sent_arguments = []
        self._call_deltas.append(ToolCallDelta(index=index, id=new_call_id(), name=name))
        return index

    def _send_arguments(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        self._sent_arguments.append(fragment)
        last = self._call_deltas[-1] if self._call_deltas else None
        if last is not None and last.index == index:
            self._call_deltas[-1] = replace(last, arguments=last.arguments + fragment)
        else:
            self._call_deltas.append(ToolCallDelta(index=index, arguments=fragment))

    def _follow(self, scanner: CallScanner, index: int | None) -> int | None:
        """stream_arguments: sends what `scanner` has made certain of the open call, announcing
        it once its name is complete. Returns the call's index once it is announced."""
        if index is None and scanner.name:
            index = self._open_call(scanner.name)
        if index is not None:
            self._send_arguments(index, scanner.take_arguments())
        return index

    def _close_call(self, index: int, arguments: str) -> None:
        """Sends what is left of the call's final arguments text after what was streamed."""
        sent = "".join(self._sent_arguments)
        if not arguments.startswith(sent):
            logger.error(
                "tool call %d: streamed arguments %r are not a prefix of %r", index, sent, arguments
            )
            return
        self._send_arguments(index, arguments[len(sent) :])

    def _take(self) -> StreamDelta:
        content = "".join(self._content_parts) or None
        delta = StreamDelta(content=content, tool_calls=self._call_deltas)
        self._content_parts = []
        self._call_deltas = []
        return delta


class _StreamedStrip:
    """strip_content() of a text that comes in pieces: leading whitespace is dropped, trailing
    whitespace is held until content follows it (and never sent if none does)."""

    def __init__(self) -> None:
        self._started = False
        self._held_space = ""

    def take(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held_space + text
        kept = text.rstrip()
        self._held_space = text[len(kept) :]
        return kept


# --- the registry -----------------------------------------------------------------------

_REGISTRY: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    """Class decorator: makes `cls` available as `--tool-call-parser cls.name`."""
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool parser class {cls.__qualname__} needs a `name` class attribute")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(
            f"tool parser name {name!r} is taken by {_REGISTRY[name].__qualname__}; "
            f"choose another name for {cls.__qualname__}"
        )
    _REGISTRY[name] = cls
    return cls


def tool_parser(
    name: str, tools: list[dict] | None = None, *, stream_arguments: bool = False
) -> ToolParser:
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(
            f"unknown tool-call parser {name!r}; known parsers: {', '.join(sorted(_REGISTRY))}"
        )
    return cls(tools, stream_arguments=stream_arguments)


def __getattr__(attribute: str) -> Any:
    # TOOL_PARSER_NAMES is read when asked for, so it includes parsers registered late.
    if attribute == "TOOL_PARSER_NAMES":
        return tuple(sorted(_REGISTRY))
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")


from ringllm.server.tool_parsers import hermes, llama3_json  # noqa: E402, F401  (they register)
