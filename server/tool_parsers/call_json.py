"""JSON of tool calls: decoding a whole call, and reading one as it is generated.

    decode_call(text) / call_fields(obj)   a call object -> (name, canonical arguments)
    canonical_arguments(value)             json.dumps(arguments, ensure_ascii=False)
    CallScanner                            a call object read one character at a time; its
                                           arguments rewritten canonically as they come, never
                                           sending what the final text could still change

Shared by the parsers of this package (the rules they follow: its __init__).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Generator
from typing import Any

logger = logging.getLogger(__name__)

# Keys a call object may carry its arguments under; the first one present counts.
ARGUMENT_KEYS = ("arguments", "parameters")

# --- decoding a call --------------------------------------------------------------------


def _first_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        obj.setdefault(key, value)
    return obj


# strict=False: models write raw newlines and tabs inside strings (code); accept them.
DECODER = json.JSONDecoder(strict=False, object_pairs_hook=_first_wins)


def canonical_arguments(value: Any) -> str | None:
    """The arguments text of a call whose arguments member is `value`: an object, a JSON text
    of an object, or null (no arguments). None if it is none of these."""
    if value is None:
        value = {}
    if isinstance(value, str):
        try:
            value = DECODER.decode(value)
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_fields(obj: Any) -> tuple[str, str] | None:
    """(name, arguments) of a decoded call object `{"name": ..., "arguments": ...}`, or None
    if `obj` is not one: not an object, no non-empty string name, or unusable arguments."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = next((k for k in obj if k in ARGUMENT_KEYS), None)
    arguments = canonical_arguments(obj[key] if key is not None else None)
    return None if arguments is None else (name, arguments)


def decode_call(text: str) -> tuple[str, str] | None:
    """call_fields() of a text that must be exactly one JSON object (whitespace around it)."""
    try:
        obj = DECODER.decode(text.strip())
    except (ValueError, RecursionError):
        return None
    return call_fields(obj)


def strip_content(text: str) -> str | None:
    return text.strip() or None


def held_marker_length(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`: the part a
    stream must hold back until the next piece says whether the marker is there."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


# --- the arguments of a call, as they are generated -------------------------------------

_JSON_SPACE = " \t\n\r"
# A reader is a generator sent one character at a time; what it returns is its result.
_Reads = Generator[None, str, Any]
_Out = Callable[[str], Any] | None  # where canonical text goes; None: nowhere


class _Malformed(Exception):
    """No continuation can make this text valid JSON."""


def _write(out: _Out, text: str) -> None:
    if out is not None:
        out(text)


def _escape(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _decode_string(raw: str) -> str:
    try:
        return DECODER.decode('"' + raw + '"')
    except ValueError:
        raise _Malformed from None


def _decodable_length(raw: str) -> int:
    """The longest prefix of the raw string body `raw` that decodes to a prefix of whatever
    the whole string decodes to: no cut inside an escape, nor after a high-surrogate escape
    (a low one may follow and pair with it)."""
    i = cut = 0
    while i < len(raw):
        if raw[i] != "\\":
            i += 1
        elif i + 1 >= len(raw):
            break
        elif raw[i + 1] != "u":
            i += 2
        elif i + 6 > len(raw):
            break
        else:
            i += 6
            if _is_high_surrogate(raw[i - 4 : i]):
                continue
        cut = i
    return cut


def _is_high_surrogate(hex_digits: str) -> bool:
    try:
        return 0xD800 <= int(hex_digits, 16) <= 0xDBFF
    except ValueError:
        return False  # not an escape at all: decoding will say so


class CallScanner:
    """Reads one call object `{"name": ..., "arguments": {...}}` a character at a time.

    `name` is set once the name's string is complete. The arguments object is re-written as it
    is read, in the canonical form of `json.dumps(..., ensure_ascii=False)`: whitespace
    dropped, ", " and ": " separators, strings re-escaped, numbers and literals written when
    the character after them ends them, members with a repeated key skipped. What
    `take_arguments` hands out is therefore always a prefix of the final arguments text, if
    the object turns out well-formed. Arguments given as a JSON string come whole when that
    string closes. `complete`: the object closed; `broken`: it can never be valid JSON.

    The reader is a recursive-descent parser written as generators, each `yield` taking the
    next character, so it keeps its place between pieces for free.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self.complete = False
        self.broken = False
        self._arguments: list[str] = []
        self._string_out: _Out = None  # where the open string streams
        self._string_raw: list[str] = []  # its raw body not yet decoded
        self._string_held = ""  # its raw body held back at the last flush
        self._reader = self._call_object()
        next(self._reader)

    def feed(self, text: str) -> int:
        """Reads `text`; returns how many of its characters it took: all of them until the
        object closes (then `complete`) or proves malformed (then `broken`)."""
        if self.complete or self.broken:
            return 0
        for i, c in enumerate(text):
            try:
                self._reader.send(c)
            except StopIteration:
                self.complete = True
                return i + 1
            except (_Malformed, RecursionError):
                self.broken = True
                return i + 1
        try:
            self._flush_string()
        except _Malformed:
            self.broken = True
        return len(text)

    def take_arguments(self) -> str:
        text = "".join(self._arguments)
        self._arguments.clear()
        return text

    def _flush_string(self) -> None:
        if self._string_out is None or not self._string_raw:
            return
        raw = self._string_held + "".join(self._string_raw)
        self._string_raw.clear()
        cut = _decodable_length(raw)
        if cut:
            self._string_out(_escape(_decode_string(raw[:cut])))
        self._string_held = raw[cut:]

    def _call_object(self) -> _Reads:
        c = yield from self._skip_space(None)
        if c != "{":
            raise _Malformed
        seen: set[str] = set()
        arguments_seen = False
        c = yield from self._skip_space(None)
        if c == "}":
            return
        while True:
            key, c = yield from self._member_key(c)
            first = key not in seen
            seen.add(key)
            is_arguments = key in ARGUMENT_KEYS and not arguments_seen
            arguments_seen = arguments_seen or key in ARGUMENT_KEYS
            if first and key == "name" and c == '"':
                self.name = yield from self._string(None)
                c = None
            elif is_arguments and c == "{":
                c = yield from self._object(self._arguments.append)
            elif is_arguments and c == '"':
                canonical = canonical_arguments((yield from self._string(None)))
                if canonical is not None:
                    self._arguments.append(canonical)
                c = None
            else:
                c = yield from self._value(c, None)
            c = yield from self._skip_space(c)
            if c == "}":
                return
            if c != ",":
                raise _Malformed
            c = yield from self._skip_space(None)

    def _skip_space(self, c: str | None) -> _Reads:
        while c is None or c in _JSON_SPACE:
            c = yield
        return c

    def _member_key(self, c: str) -> _Reads:
        if c != '"':
            raise _Malformed
        key = yield from self._string(None)
        c = yield from self._skip_space(None)
        if c != ":":
            raise _Malformed
        c = yield from self._skip_space(None)
        return key, c

    def _value(self, c: str, out: _Out) -> _Reads:
        """Reads the value that starts with `c`; returns the character after it if it had to
        read one to see its end (numbers, literals), else None."""
        if c == "{":
            return (yield from self._object(out))
        if c == "[":
            return (yield from self._array(out))
        if c == '"':
            _write(out, '"')
            yield from self._string(out)
            _write(out, '"')
            return None
        return (yield from self._bare(c, out))

    def _object(self, out: _Out) -> _Reads:
        _write(out, "{")
        seen: set[str] = set()
        c = yield from self._skip_space(None)
        if c == "}":
            _write(out, "}")
            return None
        while True:
            key, c = yield from self._member_key(c)
            member_out = None if key in seen else out
            if key not in seen:
                _write(out, (", " if seen else "") + json.dumps(key, ensure_ascii=False) + ": ")
                seen.add(key)
            c = yield from self._value(c, member_out)
            c = yield from self._skip_space(c)
            if c == "}":
                _write(out, "}")
                return None
            if c != ",":
                raise _Malformed
            c = yield from self._skip_space(None)

    def _array(self, out: _Out) -> _Reads:
        _write(out, "[")
        c = yield from self._skip_space(None)
        if c == "]":
            _write(out, "]")
            return None
        while True:
            c = yield from self._value(c, out)
            c = yield from self._skip_space(c)
            if c == "]":
                _write(out, "]")
                return None
            if c != ",":
                raise _Malformed
            _write(out, ", ")
            c = yield from self._skip_space(None)

    def _string(self, out: _Out) -> _Reads:
        """After the opening quote, through the closing one. Streams the escaped text to
        `out` as far as it is decodable (at the end of each feed); returns the decoded text
        when `out` is None."""
        self._string_out = out
        escaped = False
        while True:
            c = yield
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                break
            self._string_raw.append(c)
        raw = self._string_held + "".join(self._string_raw)
        self._string_raw.clear()
        self._string_held = ""
        self._string_out = None
        text = _decode_string(raw)
        _write(out, _escape(text))
        return text

    def _bare(self, c: str, out: _Out) -> _Reads:
        chars = []
        while c.isalnum() or c in "+-.":
            chars.append(c)
            c = yield
        try:
            value = json.loads("".join(chars))
        except ValueError:
            raise _Malformed from None
        _write(out, json.dumps(value))
        return c
