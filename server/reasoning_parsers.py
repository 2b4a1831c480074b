"""Reasoning parsers: a thinking model's text split into `reasoning_content` and `content`.

`--reasoning-parser deepseek_r1 | qwen3`. The thinking is written between `<think>` and
`</think>`; what follows `</think>` is the answer.

    <think>The user wants ...</think>\\n\\nThe answer is 4.
            `-- reasoning, exactly --'    `-- content, leading whitespace stripped

The two parsers differ only in what a text without a leading `<think>` means:
- qwen3: the model opens `<think>` itself when it thinks, so such a text is all content,
  left as it is (thinking was off).
- deepseek_r1: the chat template opens `<think>` in the prompt, so the text starts inside the
  thinking: everything before `</think>` is reasoning.
Either way `<think>` counts only at the start of the text (after whitespace): a `<think>`
further on is text the model wrote, not a marker. A thinking that never closes (generation
stopped) is all reasoning, and content is None. Empty parts are None.

A stream gives, concatenated, exactly what `split` gives, for any cutting of the text: it
holds back a tail that could still be the start of a marker, and the whitespace after
`</think>` until content follows it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None = None
    content: str | None = None


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    # True: the prompt opened <think>; the text is reasoning until </think>.
    think_opened_in_prompt: bool

    def split(self, text: str) -> ReasoningSplit:
        head = text.lstrip()
        if head.startswith(THINK_START):
            body = head[len(THINK_START) :]
        elif self.think_opened_in_prompt:
            body = text
        else:
            return ReasoningSplit(content=text or None)
        reasoning, _, after = body.partition(THINK_END)
        return ReasoningSplit(reasoning=reasoning or None, content=after.lstrip() or None)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class _Phase(enum.Enum):
    OPENING = "opening"  # only whitespace and a start of <think> so far
    REASONING = "reasoning"  # inside the thinking
    AFTER_END = "after_end"  # after </think>, dropping whitespace
    CONTENT = "content"  # everything from here on is content


class ReasoningStream:
    """split() for a text that comes in pieces; feed() and finish() return the new parts."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._phase = _Phase.OPENING
        self._held = ""  # text not yet given out

    @property
    def in_reasoning(self) -> bool:
        """Whether the text now being generated is reasoning (not yet known counts as not,
        except where the prompt opened the thinking)."""
        if self._phase is _Phase.OPENING:
            return self.parser.think_opened_in_prompt
        return self._phase is _Phase.REASONING

    def feed(self, text: str) -> ReasoningSplit:
        self._held += text
        reasoning = content = ""
        if self._phase is _Phase.OPENING:
            self._read_opening()
        if self._phase is _Phase.REASONING:
            reasoning = self._read_reasoning()
        if self._phase is _Phase.AFTER_END:
            self._held = self._held.lstrip()
            if self._held:
                self._phase = _Phase.CONTENT
        if self._phase is _Phase.CONTENT:
            content, self._held = self._held, ""
        return ReasoningSplit(reasoning=reasoning or None, content=content or None)

    def finish(self) -> ReasoningSplit:
        """The text is over: a held tail was no marker after all."""
        held, self._held = self._held, ""
        if self._phase is _Phase.REASONING or (
            self._phase is _Phase.OPENING and self.parser.think_opened_in_prompt
        ):
            return ReasoningSplit(reasoning=held or None)
        return ReasoningSplit(content=held or None)

    def _read_opening(self) -> None:
        head = self._held.lstrip()
        if head.startswith(THINK_START):
            self._held = head[len(THINK_START) :]
            self._phase = _Phase.REASONING
        elif not THINK_START.startswith(head):
            reasoning = self.parser.think_opened_in_prompt
            self._phase = _Phase.REASONING if reasoning else _Phase.CONTENT

    def _read_reasoning(self) -> str:
        end = self._held.find(THINK_END)
        if end >= 0:
            reasoning = self._held[:end]
            self._held = self._held[end + len(THINK_END) :]
            self._phase = _Phase.AFTER_END
            return reasoning
        keep = _held_marker_length(self._held, THINK_END)
        reasoning = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return reasoning


def _held_marker_length(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


_PARSERS = {
    parser.name: parser
    for parser in (
        ReasoningParser("deepseek_r1", think_opened_in_prompt=True),
        ReasoningParser("qwen3", think_opened_in_prompt=False),
    )
}
REASONING_PARSER_NAMES = tuple(sorted(_PARSERS))


def reasoning_parser(name: str) -> ReasoningParser:
    parser = _PARSERS.get(name)
    if parser is None:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known parsers: {', '.join(REASONING_PARSER_NAMES)}"
        )
    return parser
