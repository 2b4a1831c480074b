"""Tool-call parsers: what extract() finds, and that a stream, cut anywhere, sends the same.

The oracle for arguments is `json`: a call's arguments must be `json.dumps(obj,
ensure_ascii=False)` of the object the model wrote, and streamed fragments must concatenate
to exactly that text.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from ringllm.server import tool_parsers
from ringllm.server.tool_parsers import (
    ExtractedToolCalls,
    StreamDelta,
    ToolParser,
    ToolStream,
    register,
    tool_parser,
)
from ringllm.server.tool_parsers.call_json import CallScanner  # noqa: E402

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def canonical(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def run_stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[dict]]:
    """Feeds `pieces`, checks the shape of every delta, and returns the content and the calls
    (id, name, arguments) the deltas add up to."""
    stream = parser.stream()
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    calls: list[dict] = []
    for delta in deltas:
        assert delta.content != "", "no content is None, not an empty string"
        for piece in delta.tool_calls:
            if piece.index == len(calls):
                assert piece.id is not None and piece.name is not None, piece
                calls.append({"id": piece.id, "name": piece.name, "arguments": piece.arguments})
            else:
                assert piece.index == len(calls) - 1, "deltas follow the latest call, in order"
                assert piece.id is None and piece.name is None, "id and name come once"
                calls[-1]["arguments"] += piece.arguments
    assert stream.called_tools == bool(calls)
    content = "".join(delta.content or "" for delta in deltas)
    return content, calls


def cuttings(text: str, seed: int = 0):
    """The whole text; every cut into two; one character at a time; random cuts into many."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def assert_streams_like_extract(parser: ToolParser, text: str) -> None:
    expected = parser.extract(text)
    want_calls = [(call.name, call.arguments) for call in expected.tool_calls]
    for pieces in cuttings(text):
        content, calls = run_stream(parser, pieces)
        assert content == (expected.content or ""), pieces
        assert [(call["name"], call["arguments"]) for call in calls] == want_calls, pieces


def hermes(**kwargs) -> ToolParser:
    return tool_parser("hermes", **kwargs)


def llama3(**kwargs) -> ToolParser:
    return tool_parser("llama3_json", **kwargs)


def block(obj) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


# --- hermes: extract ---------------------------------------------------------------------

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}


def test_hermes_single_call():
    result = hermes().extract(block(WEATHER))
    assert result.content is None
    [call] = result.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert call.arguments == '{"city": "Paris", "unit": "celsius"}'
    assert CALL_ID.fullmatch(call.id)


def test_hermes_two_calls_after_content():
    text = "Let me look both up.\n\n" + block(WEATHER) + "\n" + block(TIME)
    result = hermes().extract(text)
    assert result.content == "Let me look both up."
    assert [call.name for call in result.tool_calls] == ["get_weather", "get_time"]
    assert [json.loads(call.arguments) for call in result.tool_calls] == [
        WEATHER["arguments"],
        TIME["arguments"],
    ]
    assert len({call.id for call in result.tool_calls}) == 2


def test_hermes_text_without_calls_is_content():
    text = "  Use <b>bold</b>, or write tool_call, <tool> or </tool_call> in prose.\n"
    assert hermes().extract(text) == ExtractedToolCalls(tool_calls=[], content=text.strip())


def test_hermes_whitespace_only_output_has_no_content():
    assert hermes().extract(" \n\t ") == ExtractedToolCalls(tool_calls=[], content=None)


def test_hermes_malformed_block_is_content_and_the_good_one_a_call():
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
    text = "Checking." + broken + "\n" + block(TIME)
    result = hermes().extract(text)
    assert result.content == "Checking." + broken
    assert [call.name for call in result.tool_calls] == ["get_time"]


@pytest.mark.parametrize(
    "body",
    [
        "[1, 2]",  # not an object
        '{"arguments": {"a": 1}}',  # no name
        '{"name": "", "arguments": {}}',  # empty name
        '{"name": 7, "arguments": {}}',  # name not a string
        '{"name": "f", "arguments": [1]}',  # arguments not an object
        '{"name": "f", "arguments": "not json"}',  # a string that is no JSON object
        '{"name": "f", "arguments": {}} trailing',  # more than one object
    ],
)
def test_hermes_block_that_is_no_call_is_content(body):
    text = f"<tool_call>{body}</tool_call>"
    assert hermes().extract(text) == ExtractedToolCalls(tool_calls=[], content=text)


def test_hermes_arguments_given_as_a_json_string():
    obj = {"name": "search", "arguments": json.dumps({"query": "ringllm", "limit": 5})}
    [call] = hermes().extract(block(obj)).tool_calls
    assert call.arguments == '{"query": "ringllm", "limit": 5}'


def test_hermes_missing_or_null_arguments_are_empty():
    for obj in ({"name": "now"}, {"name": "now", "arguments": None}):
        [call] = hermes().extract(block(obj)).tool_calls
        assert call.arguments == "{}"


def test_hermes_unicode_arguments_stay_unescaped():
    args = {"city": "Zürich", "note": "東京 😀", "escaped": "caf\u00e9"}
    # The model may escape non-ASCII (ensure_ascii=True) or not: the result is the same text.
    for dumped in (json.dumps(args), json.dumps(args, ensure_ascii=False)):
        text = '<tool_call>{"name": "f", "arguments": ' + dumped + "}</tool_call>"
        [call] = hermes().extract(text).tool_calls
        assert call.arguments == '{"city": "Zürich", "note": "東京 😀", "escaped": "café"}'
        assert json.loads(call.arguments) == args


NESTED_ARGUMENTS = (
    '{ "edits" : [ {"path":"a/b.py","lines":[1,2,3],"text":"def f():\\n    return \\"x\\"\\\\"},'
    ' {"path": "c.py", "lines": [], "opts": {"dry": true, "force": false, "owner": null}}],'
    ' "ratio": 2.50, "big": 1E3, "neg": -0.0, "count": 12345678901234567890 }'
)


def test_hermes_nested_arguments_are_canonical():
    text = '<tool_call>{"name": "apply", "arguments": ' + NESTED_ARGUMENTS + "}</tool_call>"
    [call] = hermes().extract(text).tool_calls
    assert call.arguments == canonical(json.loads(NESTED_ARGUMENTS))
    assert json.loads(call.arguments)["edits"][0]["text"] == 'def f():\n    return "x"\\'
    assert '"ratio": 2.5, "big": 1000.0' in call.arguments


def test_hermes_raw_newline_inside_a_string_is_accepted():
    text = '<tool_call>{"name": "write", "arguments": {"code": "a\nb"}}</tool_call>'
    [call] = hermes().extract(text).tool_calls
    assert call.arguments == '{"code": "a\\nb"}'


def test_hermes_duplicate_keys_keep_the_first():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1, "b": 2, "a": 3}}</tool_call>'
    [call] = hermes().extract(text).tool_calls
    assert call.arguments == '{"a": 1, "b": 2}'


def test_hermes_unterminated_last_block_with_complete_json_is_a_call():
    text = "On it." + block(WEATHER) + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    result = hermes().extract(text)
    assert result.content == "On it."
    assert [(call.name, call.arguments) for call in result.tool_calls] == [
        ("get_weather", canonical(WEATHER["arguments"])),
        ("get_time", "{}"),
    ]


def test_hermes_unterminated_last_block_with_incomplete_json_is_content():
    tail = '<tool_call>\n{"name": "get_time", "argum'
    result = hermes().extract(block(WEATHER) + tail)
    assert result.content == tail
    assert [call.name for call in result.tool_calls] == ["get_weather"]


def test_hermes_call_of_a_tool_not_in_the_request_is_still_returned():
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    [call] = hermes(tools=tools).extract(block(WEATHER)).tool_calls
    assert call.name == "get_weather"


# --- hermes: streaming -------------------------------------------------------------------

HERMES_TEXTS = [
    block(WEATHER),
    "Let me look both up.\n\n" + block(WEATHER) + "\n" + block(TIME) + "\n",
    "  Plain text with <b>tags</b>, a < sign and tool_call, no calls.  ",
    "Ends with a partial marker <tool_",
    block(WEATHER) + " Anything else?",
    '<tool_call>{"name": "apply", "arguments": ' + NESTED_ARGUMENTS + "}</tool_call>",
    '<tool_call>{"arguments": {"q": "x"}, "name": "late_name"}</tool_call>',
    block({"name": "search", "arguments": json.dumps({"query": 'a "b" c'})}),
    '<tool_call>{"name":"f","arguments":{"s":"\\ud83d\\ude00 \\u00fc\\/ caf\u00e9 东京"}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1, "b": {"a": 2, "a": [3]}, "a": 4}}</tool_call>',
    '<tool_call>{"name": "write", "arguments": {"code": "a\nb\tc"}}</tool_call>',
    block(WEATHER) + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n',
    block({"name": "now"}) + block({"name": "now", "arguments": None}),
]
MALFORMED_HERMES_TEXTS = [
    'Checking.<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>\n' + block(TIME),
    '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call> after',
    "<tool_call>[1, 2]</tool_call>",
    block(WEATHER) + '<tool_call>\n{"name": "get_time", "argum',
    "<tool_call><tool_call>" + json.dumps(TIME) + "</tool_call>",
]


@pytest.mark.parametrize("text", HERMES_TEXTS + MALFORMED_HERMES_TEXTS)
def test_hermes_stream_equals_extract_for_every_cut(text):
    assert_streams_like_extract(hermes(), text)


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_stream_arguments_equals_extract_for_every_cut(text):
    assert_streams_like_extract(hermes(stream_arguments=True), text)


def test_hermes_stream_holds_back_a_partial_marker():
    stream = hermes().stream()
    assert stream.feed("Sure <tool_") == StreamDelta(content="Sure")
    assert stream.feed("call>\n" + json.dumps(TIME)) == StreamDelta()
    delta = stream.feed("\n</tool_call>")
    assert delta.content is None
    [piece] = delta.tool_calls
    assert (piece.index, piece.name, piece.arguments) == (
        0,
        "get_time",
        canonical(TIME["arguments"]),
    )
    assert stream.finish() == StreamDelta()

    stream = hermes().stream()
    assert stream.feed("a <tool_") == StreamDelta(content="a")
    assert stream.feed("box> b") == StreamDelta(content=" <tool_box> b")


def test_hermes_stream_sends_nothing_of_a_call_before_it_is_known_good():
    text = block(WEATHER)
    stream = hermes().stream()
    for c in text[: -len("</tool_call>")]:
        assert stream.feed(c) == StreamDelta()
    assert not stream.called_tools
    assert [piece.name for piece in stream.feed("</tool_call>").tool_calls] == ["get_weather"]
    assert stream.called_tools


def test_hermes_stream_arguments_arrive_while_they_are_written():
    code = "def main():\n    print('hello')\n" * 4
    text = block({"name": "write_file", "arguments": {"path": "x.py", "content": code}})
    final = canonical({"path": "x.py", "content": code})
    stream = hermes(stream_arguments=True).stream()
    sent = ""
    halfway = text.index("hello") + 200
    for c in text[:halfway]:
        for piece in stream.feed(c).tool_calls:
            sent += piece.arguments
    assert len(sent) > len('{"path": "x.py", "content": "def main'), sent
    assert final.startswith(sent)
    assert stream.called_tools


def test_hermes_stream_arguments_cannot_take_back_a_call_that_proves_malformed():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1} oops</tool_call>'
    content, calls = run_stream(hermes(stream_arguments=True), list(text))
    assert [call["name"] for call in calls] == ["f"]  # announced before the break
    assert content == text  # and the block still goes to content, as extract() says
    assert hermes().extract(text).tool_calls == []


def test_call_ids_are_unique_and_openai_shaped():
    text = block(WEATHER) + block(TIME) + block(WEATHER)
    ids = [call.id for call in hermes().extract(text).tool_calls]
    ids += [call.id for call in hermes().extract(text).tool_calls]
    ids += [call["id"] for call in run_stream(hermes(), [text])[1]]
    ids += [call["id"] for call in run_stream(llama3(), [json.dumps(TIME)])[1]]
    assert all(CALL_ID.fullmatch(call_id) for call_id in ids), ids
    assert len(set(ids)) == len(ids) == 10


# --- llama3_json -------------------------------------------------------------------------


def llama3_call(name: str, parameters: dict, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: parameters})


def test_llama3_single_call_with_python_tag():
    text = "<|python_tag|>" + llama3_call("get_weather", {"city": "Paris"})
    result = llama3().extract(text)
    assert result.content is None
    [call] = result.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert CALL_ID.fullmatch(call.id)


def test_llama3_arguments_key_is_accepted():
    [call] = llama3().extract(llama3_call("f", {"x": [1, 2]}, key="arguments")).tool_calls
    assert call.arguments == '{"x": [1, 2]}'


def test_llama3_calls_separated_by_semicolons():
    text = (
        "\n "
        + llama3_call("a", {"n": 1})
        + "; "
        + llama3_call("b", {})
        + ";\n"
        + llama3_call("c", {"s": "ü"})
    )
    result = llama3().extract(text)
    assert [(call.name, call.arguments) for call in result.tool_calls] == [
        ("a", '{"n": 1}'),
        ("b", "{}"),
        ("c", '{"s": "ü"}'),
    ]
    assert result.content is None


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        'I would call {"name": "f", "parameters": {}} but not now.',  # not at the start
        "{not json at all}",
        '{"answer": 42}',  # JSON, but no call
        '{"name": "f", "parameters": {"a": 1}',  # never closed
        '<|python_tag|>print("hello")',  # code interpreter: content, tag included
        "<|python_tag|>",
        "",
    ],
)
def test_llama3_text_that_does_not_start_with_a_call_is_content(text):
    assert llama3().extract(text) == ExtractedToolCalls(tool_calls=[], content=text.strip() or None)


def test_llama3_what_follows_the_calls_is_content():
    text = llama3_call("a", {}) + "; " + '{"name": "b", "param'
    result = llama3().extract(text)
    assert [call.name for call in result.tool_calls] == ["a"]
    assert result.content == '{"name": "b", "param'

    result = llama3().extract(llama3_call("a", {}) + "  Done. ")
    assert ([call.name for call in result.tool_calls], result.content) == (["a"], "Done.")


LLAMA3_TEXTS = [
    "<|python_tag|>" + llama3_call("get_weather", {"city": "Paris"}),
    "\n "
    + llama3_call("a", {"n": 1})
    + "; "
    + llama3_call("b", {})
    + ";\n"
    + llama3_call("c", {"s": "ü"}),
    llama3_call("f", json.loads(NESTED_ARGUMENTS), key="arguments"),
    '{"parameters": {"q": "x"}, "name": "late_name"}',
    '{"name": "f", "parameters": "{\\"a\\": [1, 2]}"}',
    llama3_call("a", {}) + llama3_call("b", {}),  # no separator
    llama3_call("a", {}) + "  Done. ",
]
NOT_LLAMA3_TEXTS = [
    "The weather in Paris is sunny.",
    "  <|python_tag|>  ",
    "<|python_t",
    '<|python_tag|>print("hello")',
    "{not json at all}",
    '  {"answer": 42} is the JSON you asked for',
    '{"name": "f", "parameters": {"a": 1}',
    llama3_call("a", {}) + "; " + '{"name": "b", "param',
    llama3_call("a", {}) + ";; " + llama3_call("b", {}),
]


@pytest.mark.parametrize("text", LLAMA3_TEXTS + NOT_LLAMA3_TEXTS)
def test_llama3_stream_equals_extract_for_every_cut(text):
    assert_streams_like_extract(llama3(), text)


@pytest.mark.parametrize("text", LLAMA3_TEXTS)
def test_llama3_stream_arguments_equals_extract_for_every_cut(text):
    assert_streams_like_extract(llama3(stream_arguments=True), text)


def test_llama3_stream_holds_text_back_while_it_could_be_a_call():
    stream = llama3().stream()
    assert stream.feed(" <|python") == StreamDelta()
    assert stream.feed("_tag|>") == StreamDelta()
    assert stream.feed('{"name": "f", "para') == StreamDelta()
    assert stream.finish() == StreamDelta(content='<|python_tag|>{"name": "f", "para')

    stream = llama3().stream()
    assert stream.feed("{") == StreamDelta()
    assert stream.feed("not json") == StreamDelta(content="{not json")
    assert stream.feed(" at all") == StreamDelta(content=" at all")

    stream = llama3().stream()
    assert stream.feed("Sunny") == StreamDelta(content="Sunny")


def test_llama3_stream_sends_each_call_when_its_object_closes():
    stream = llama3().stream()
    first = llama3_call("a", {"n": 1})
    assert stream.feed(first[:-1]) == StreamDelta()
    [piece] = stream.feed(first[-1] + "; {").tool_calls
    assert (piece.index, piece.name, piece.arguments) == (0, "a", '{"n": 1}')


# --- the scanner behind stream_arguments -------------------------------------------------


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["dict", "list", "str", "num", "lit"] if depth < 3 else ["str", "num", "lit"])
    if kind == "dict":
        keys = [random_text(rng, 6) for _ in range(rng.randint(0, 4))]
        return {key: random_value(rng, depth + 1) for key in keys}
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "str":
        return random_text(rng, 12)
    if kind == "num":
        return rng.choice([0, -7, 12345678901234567890, 2.5, -0.001, 1e300, 3.14159])
    return rng.choice([True, False, None])


def random_text(rng: random.Random, max_length: int) -> str:
    alphabet = 'ab Z09"\\/\n\t\x01éü東😀'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_length)))


def test_scanner_streams_a_prefix_of_the_canonical_arguments():
    """Random objects, written the ways a model might (spacing, escaped non-ASCII, surrogate
    pairs), fed a character at a time: every step's text is a prefix of the canonical one,
    and they end equal."""
    rng = random.Random(1234)
    for case in range(300):
        arguments = {f"k{i}": random_value(rng) for i in range(rng.randint(0, 4))}
        style = [{}, {"indent": 2}, {"separators": (",", ":")}, {"ensure_ascii": False}][case % 4]
        text = '{"name": "f", "arguments": ' + json.dumps(arguments, **style) + "}"
        want = canonical(json.loads(text)["arguments"])
        scanner = CallScanner()
        sent = ""
        for c in text:
            scanner.feed(c)
            sent += scanner.take_arguments()
            assert want.startswith(sent), (text, sent)
        assert scanner.complete and not scanner.broken
        assert (scanner.name, sent) == ("f", want)


def test_scanner_reports_where_the_object_ends_and_what_is_broken():
    scanner = CallScanner()
    assert scanner.feed('{"name": "f"}; next') == len('{"name": "f"}')
    assert scanner.complete
    for text in (
        '{"name": "f",}',
        '{"name" "f"}',
        '{"a": 01}',
        '{"a": tru}',
        "[1]",
        '{"a": "\\x"}',
    ):
        scanner = CallScanner()
        scanner.feed(text)
        assert scanner.broken, text


# --- the registry ------------------------------------------------------------------------


def test_builtin_parsers_are_registered():
    assert {"hermes", "llama3_json"} <= set(tool_parsers.TOOL_PARSER_NAMES)
    assert list(tool_parsers.TOOL_PARSER_NAMES) == sorted(tool_parsers.TOOL_PARSER_NAMES)


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"'mistral'.*hermes, llama3_json"):
        tool_parser("mistral")


class _WholeTextStream(ToolStream):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self._text = ""

    def feed(self, text: str) -> StreamDelta:
        self._text += text
        return self._take()

    def finish(self) -> StreamDelta:
        self._emit_content(self._text)
        return self._take()


def test_a_new_parser_registers_with_a_decorator(monkeypatch):
    monkeypatch.setattr(tool_parsers, "_REGISTRY", dict(tool_parsers._REGISTRY))

    @register
    class ShoutingParser(ToolParser):
        name = "test_shouting"

        def extract(self, text: str) -> ExtractedToolCalls:
            return ExtractedToolCalls(tool_calls=[], content=text.upper())

        def stream(self) -> ToolStream:
            return _WholeTextStream(self)

    assert "test_shouting" in tool_parsers.TOOL_PARSER_NAMES
    parser = tool_parser("test_shouting")
    assert isinstance(parser, ShoutingParser)
    assert parser.extract("hi").content == "HI"
    assert run_stream(parser, ["h", "i "]) == ("hi", [])

    class Impostor(ShoutingParser):
        name = "hermes"

    with pytest.raises(ValueError, match="'hermes' is taken"):
        register(Impostor)

    class Nameless(ShoutingParser):
        pass

    with pytest.raises(ValueError, match="needs a `name`"):
        register(Nameless)
