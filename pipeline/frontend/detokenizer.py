"""Incremental detokenizing: token ids arrive a few at a time, text leaves as deltas.

Decoding a token on its own is wrong in three ways: a multi-byte UTF-8 character may be
split across tokens (byte-level BPE, `<0xNN>` byte fallback), a decoder may depend on the
neighbouring tokens (SentencePiece's leading-space rule, `Strip`, `Fuse`), and special
tokens may be skipped. Re-decoding the whole output each step is right but O(length) per
step. So, as vLLM does, we decode a short window of recent ids twice:

    ids:   ... prompt ... | output ids ...............................|
                          prefix_offset        read_offset           len(ids)
                          |<-- already emitted -->|<-- not emitted -->|

    prefix_text = decode(ids[prefix_offset:read_offset])
    window_text = decode(ids[prefix_offset:])
    delta       = window_text[len(prefix_text):]

The prefix gives the new tokens their left context; only the part after it is new. When
the window text ends in U+FFFD the last character's bytes are not all in yet, so nothing
is emitted and the offsets stay; the next token completes it. Once a delta is emitted
the window slides: prefix_offset <- read_offset, read_offset <- len(ids).

Invariants:
- Concatenating every delta (plus `flush()` at the end) gives
  `tokenizer.decode(output_ids)`, for decoders whose output for a sequence extends their
  output for every prefix (byte-level BPE, byte fallback). For SentencePiece decoders that
  strip the first leading space, the deltas give the text that the output adds after the
  prompt, leading space included, as vLLM does.
- Work per `update` is proportional to the window: the tokens of the last emitted delta
  plus those not emitted yet, which only pile up while a character is incomplete.
"""

from __future__ import annotations

from collections.abc import Sequence

from ringllm.pipeline.frontend.tokenizer import Tokenizer

# How many prompt tokens give the first output tokens their left context.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output ids into text deltas, a few ids at a time."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Only the prompt's tail is kept: it is all the left context the window needs.
        self._ids: list[int] = list(prompt_token_ids[self._context_start(prompt_token_ids) :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]) when known
        self.num_output_tokens = 0
        self._skipped_ids = tokenizer.all_special_ids if skip_special_tokens else frozenset()

    def _context_start(self, prompt_token_ids: Sequence[int]) -> int:
        """Where the prompt context starts: PROMPT_CONTEXT_TOKENS back, then further back
        to the first token of the character it would cut.

        NOTE: a context starting inside a multi-byte character decodes to U+FFFD there,
        and a byte-fallback decoder turns a whole run of <0xNN> tokens into U+FFFDs when
        the run is not valid UTF-8, output bytes included. A character spans at most 4
        tokens, so at most 3 steps back.
        """
        start = max(len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS, 0)
        for _ in range(3):
            context_text = self._decode(prompt_token_ids[start:])
            if start == 0 or not context_text.startswith(REPLACEMENT_CHAR):
                break
            start -= 1
        return start

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Append output ids; return the text they complete ('' while a character is partial)."""
        self.num_output_tokens += len(new_token_ids)
        if self.skip_special_tokens:
            # Skipped tokens add no text and split nothing, so they never enter the
            # window: a long run of them cannot make every later decode longer.
            new_token_ids = [t for t in new_token_ids if t not in self._skipped_ids]
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        return self._take_delta(final=False)

    def flush(self) -> str:
        """Text still held back at the end of the request (a character that never completed)."""
        return self._take_delta(final=True)

    def _take_delta(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if window_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        # NOTE: a prefix-stable decoder makes window_text start with prefix_text; for one
        # that is not, slicing by length (as vLLM does) at least never repeats text.
        delta = window_text[len(self._prefix_text) :]
        if delta:
            # Slide the window: the emitted part becomes the next step's left context.
            self._drop_consumed_ids(self._read_offset)
            self._read_offset = len(self._ids)
            self._prefix_text = None
        else:
            # Only skipped tokens arrived: keep the left context, mark them as read.
            self._read_offset = len(self._ids)
            self._prefix_text = window_text
        return delta

    def _drop_consumed_ids(self, new_prefix_offset: int) -> None:
        """Forget ids left of the new window so memory stays O(window), not O(output)."""
        del self._ids[:new_prefix_offset]
        self._read_offset -= new_prefix_offset
        self._prefix_offset = 0
