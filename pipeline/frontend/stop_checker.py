"""Stop strings: find them in the streamed text, truncate there, never leak a partial one.

One `StopChecker` per request lives in the output processor. Each step it gets the text
delta from the detokenizer and answers with a `StopUpdate`: the text that may go to the
client now, and whether (and on which string) the request stopped.

    text so far:  ....................emitted..................|held back|+ delta
                                                                 <------ searched ------>

Search: a stop string not found before cannot lie wholly in the old text, so only the
last `max_stop_chars - 1` old characters plus the delta are searched: O(delta) per step.

Which match: the one that *completes first* (smallest end offset; on a tie the longer
one, which starts earlier). That is the string generation would have stopped on had the
text arrived one character at a time, so the result does not depend on how the text was
cut into deltas.

Hold-back: while the request runs, the last `max_stop_chars - 1` characters are not
emitted, since they could be the start of a stop string that a later delta completes
and that would then have to be taken back (vLLM's rule). With
`include_stop_str_in_output` nothing is held back: the text up to and including the stop
string is emitted anyway, and what follows it in the same delta was never emitted.

Invariants: the concatenation of `StopUpdate.text_delta` over the request, plus
`held_back` at any moment, is all the text so far; once the request ended (a stop, or
`finished`) nothing is held back, and the text never contains what follows the first
completed stop string, nor the stop string itself unless `include_stop_str_in_output`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopUpdate:
    """What one step of text produced for the client."""

    text_delta: str
    stopped: bool = False
    stop_reason: str | None = None  # the stop string that matched, when one did


@dataclass(frozen=True)
class StopMatch:
    """A completed stop string in a text: `stop_string` starts at `start` (char offset)."""

    stop_string: str
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.stop_string)


def find_first_stop(
    text: str, new_char_count: int, stop_strings: Sequence[str]
) -> StopMatch | None:
    """The stop string in `text` that completes first, among those that end in its last
    `new_char_count` characters (the older text was searched before)."""
    old_char_count = len(text) - new_char_count
    best: StopMatch | None = None
    for stop_string in stop_strings:
        # A match must end after old_char_count, so it starts after this.
        search_from = max(0, old_char_count - len(stop_string) + 1)
        start = text.find(stop_string, search_from)
        if start < 0:
            continue
        match = StopMatch(stop_string, start)
        if best is None or (match.end, match.start) < (best.end, best.start):
            best = match
    return best


class StopChecker:
    """Per-request stop-string state: text so far, what the client has, what is held back."""

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):  # one stop string, as OpenAI's API also allows
            stop = [stop]
        for index, stop_string in enumerate(stop):
            if not isinstance(stop_string, str) or not stop_string:
                raise ValueError(f"stop[{index}]: must be a non-empty string, got {stop_string!r}")
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_chars = max((len(s) for s in self.stop_strings), default=0)
        self.holdback_chars = 0 if include_stop_str_in_output else max(self.max_stop_chars - 1, 0)
        # Text not yet emitted (at most holdback_chars between steps).
        self._pending_text = ""
        # The last max_stop_chars - 1 characters of the text so far: the search context.
        self._search_tail = ""
        self.stopped = False
        self.finished = False  # ended for another reason; held-back text was released
        self.stop_reason: str | None = None

    @property
    def held_back(self) -> str:
        """Text received but not emitted yet: it may be the start of a stop string."""
        return self._pending_text

    def update(self, delta: str, finished: bool = False, check_stop: bool = True) -> StopUpdate:
        """Take the next text delta; return the text the client may see now.

        `finished`: the request ends this step for another reason (EOS, length), so
        held-back text is released. `check_stop=False` appends without searching (a
        request still under `min_tokens`). After a stop, further deltas are dropped: the
        engine may still deliver tokens it computed before the abort reached it.
        """
        if self.stopped:
            return StopUpdate("", stopped=True, stop_reason=self.stop_reason)
        if self.finished:
            raise ValueError("StopChecker.update: the request already finished; no more text")
        match = None
        if check_stop and self.stop_strings and delta:
            match = find_first_stop(self._search_tail + delta, len(delta), self.stop_strings)
        if match is not None:
            return self._stop_at(match, delta)
        self._pending_text += delta
        tail_chars = self.max_stop_chars - 1
        self._search_tail = (self._search_tail + delta)[-tail_chars:] if tail_chars > 0 else ""
        self.finished = finished
        keep_chars = 0 if finished else self.holdback_chars
        return StopUpdate(self._emit(len(self._pending_text) - keep_chars))

    def _stop_at(self, match: StopMatch, delta: str) -> StopUpdate:
        """Cut the text at the match (before or after the stop string) and release it all."""
        end_in_window = match.end if self.include_stop_str_in_output else match.start
        # The match lies in the search window (search_tail + delta); everything after the
        # cut point is still pending, never emitted, by the hold-back rule above.
        window_chars = len(self._search_tail) + len(delta)
        self._pending_text += delta
        cut_from_end = window_chars - end_in_window
        if cut_from_end:
            self._pending_text = self._pending_text[:-cut_from_end]
        self.stopped = True
        self.stop_reason = match.stop_string
        return StopUpdate(
            self._emit(len(self._pending_text)), stopped=True, stop_reason=match.stop_string
        )

    def _emit(self, char_count: int) -> str:
        """Move the first `char_count` pending characters to the emitted text."""
        if char_count <= 0:
            return ""
        text, self._pending_text = self._pending_text[:char_count], self._pending_text[char_count:]
        return text
