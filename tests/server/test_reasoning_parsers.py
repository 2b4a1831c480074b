"""Reasoning parsers: what split() gives, and that a stream, cut anywhere, gives the same."""

from __future__ import annotations

import pytest

from ringllm.server.reasoning_parsers import (
    REASONING_PARSER_NAMES,
    ReasoningParser,
    ReasoningSplit,
    reasoning_parser,
)

qwen3 = reasoning_parser("qwen3")
deepseek_r1 = reasoning_parser("deepseek_r1")


def run_stream(parser: ReasoningParser, pieces: list[str]) -> ReasoningSplit:
    stream = parser.stream()
    parts = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    for part in parts:
        assert part.reasoning != "" and part.content != "", "nothing is None, not empty"
    reasoning = "".join(part.reasoning or "" for part in parts)
    content = "".join(part.content or "" for part in parts)
    return ReasoningSplit(reasoning=reasoning or None, content=content or None)


def cuttings(text: str):
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("<think>\nAdd 2 and 2.\n</think>\n\nIt is 4.", ("\nAdd 2 and 2.\n", "It is 4.")),
        ("\n<think>plan</think>answer", ("plan", "answer")),
        ("It is 4.", (None, "It is 4.")),  # thinking was off: all content, unchanged
        ("  indented answer", (None, "  indented answer")),
        ("<think>\nstill thinking when it stopped", ("\nstill thinking when it stopped", None)),
        ("<think></think>\n\nanswer", (None, "answer")),
        ("<think>done</think>   ", ("done", None)),
        ("Write <think> tags like this.", (None, "Write <think> tags like this.")),
        ("", (None, None)),
    ],
)
def test_qwen3_split(text, want):
    assert qwen3.split(text) == ReasoningSplit(*want)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        # The template opened <think>: the text starts inside the thinking.
        ("Add 2 and 2.\n</think>\n\nIt is 4.", ("Add 2 and 2.\n", "It is 4.")),
        ("<think>\nAdd 2 and 2.</think>It is 4.", ("\nAdd 2 and 2.", "It is 4.")),
        ("still thinking when it stopped", ("still thinking when it stopped", None)),
        ("</think>only an answer", (None, "only an answer")),
        ("a</think>b</think>c", ("a", "b</think>c")),
        ("", (None, None)),
    ],
)
def test_deepseek_r1_split(text, want):
    assert deepseek_r1.split(text) == ReasoningSplit(*want)


TEXTS = [
    "<think>\nAdd 2 and 2.\n</think>\n\nIt is 4.",
    "\n <think>plan</think>answer",
    "It is 4.",
    "  indented answer",
    "<think>\nstill thinking when it stopped",
    "<think></think>\n\nanswer",
    "<think>done</think>   ",
    "Write <think> tags like this.",
    "<thin",
    "<think>cut short </thi",
    "Add 2 and 2.\n</think>\n\nIt is 4.",
    "</think>only an answer",
    "a</think>b</think>c",
    "   ",
    "<think>x < y, and </ is not </thinking> </think> ok",
]


@pytest.mark.parametrize("parser", [qwen3, deepseek_r1], ids=lambda parser: parser.name)
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_split_for_every_cut(parser, text):
    want = parser.split(text)
    for pieces in cuttings(text):
        assert run_stream(parser, pieces) == want, pieces


def test_markers_do_not_leak_while_streaming():
    text = "<think>\nreasoning here\n</think>\n\nThe answer."
    for parser in (qwen3, deepseek_r1):
        stream = parser.stream()
        for c in text:
            part = stream.feed(c)
            for piece in (part.reasoning or "", part.content or ""):
                assert "<" not in piece and ">" not in piece, (parser.name, piece)


def test_a_partial_end_marker_is_held_until_it_is_known():
    stream = deepseek_r1.stream()
    assert stream.feed("abc</thi") == ReasoningSplit(reasoning="abc")
    assert stream.feed("nk>\n") == ReasoningSplit()
    assert stream.feed("x") == ReasoningSplit(content="x")

    stream = deepseek_r1.stream()
    assert stream.feed("abc</thi") == ReasoningSplit(reasoning="abc")
    assert stream.feed("s is not it") == ReasoningSplit(reasoning="</this is not it")


def test_in_reasoning_follows_the_markers():
    stream = qwen3.stream()
    assert not stream.in_reasoning
    stream.feed("<think>")
    assert stream.in_reasoning
    stream.feed("hmm</think>")
    assert not stream.in_reasoning

    stream = deepseek_r1.stream()
    assert stream.in_reasoning  # the prompt opened the thinking
    stream.feed("hmm</think>ok")
    assert not stream.in_reasoning

    stream = qwen3.stream()
    stream.feed("No thinking.")
    assert not stream.in_reasoning


def test_names_and_unknown_name():
    assert REASONING_PARSER_NAMES == ("deepseek_r1", "qwen3")
    assert reasoning_parser("qwen3").name == "qwen3"
    with pytest.raises(ValueError, match=r"'granite'.*deepseek_r1, qwen3"):
        reasoning_parser("granite")
