"""StopChecker: stop strings across deltas, truncation, hold-back, chunking independence."""

from __future__ import annotations

import random

import pytest

from ringllm.pipeline.frontend.stop_checker import StopChecker, StopMatch, find_first_stop


class Shown:
    """What a client saw of a checker's stream, plus what the checker still holds back."""

    def __init__(self, checker):
        self.checker, self.emitted = checker, ""

    def update(self, delta, **kwargs):
        result = self.checker.update(delta, **kwargs)
        self.emitted += result.text_delta
        return result

    @property
    def text(self) -> str:
        return self.emitted + self.checker.held_back

    def __getattr__(self, name):
        return getattr(self.checker, name)


def _feed(checker, deltas, finish=True):
    """Stream `deltas`; check emitted text is never taken back; return the emitted text."""
    shown = Shown(checker)
    for index, delta in enumerate(deltas):
        before = shown.text
        result = shown.update(delta, finished=finish and index == len(deltas) - 1)
        assert (before + delta).startswith(shown.emitted) or result.stopped
        if result.stopped:
            break
    return shown.emitted


def test_stop_string_spanning_deltas_is_cut_and_never_shown():
    checker = Shown(StopChecker(["STOP"], include_stop_str_in_output=False))
    assert checker.holdback_chars == 3
    steps = [("Hello ", "Hel"), ("wor", "lo "), ("ldST", "worl"), ("OP and more", "d")]
    for delta, expected_emit in steps:
        result = checker.update(delta)
        assert result.text_delta == expected_emit
    assert result.stopped and result.stop_reason == "STOP"
    assert checker.text == "Hello world"
    assert checker.stopped and checker.stop_reason == "STOP"


def test_include_stop_str_in_output_emits_at_once_and_keeps_the_stop_string():
    checker = Shown(StopChecker(["STOP"], include_stop_str_in_output=True))
    assert checker.holdback_chars == 0
    assert checker.update("Hello ST").text_delta == "Hello ST"
    result = checker.update("OP and more")
    assert (result.text_delta, result.stopped, result.stop_reason) == ("OP", True, "STOP")
    assert checker.text == "Hello STOP"


def test_first_completed_match_wins_then_the_longer_one():
    checker = Shown(StopChecker(["abcde", "bcd"]))
    result = checker.update("xabcdef")
    assert (result.stop_reason, checker.text) == ("bcd", "xa")
    checker = Shown(StopChecker(["cd", "abcd"]))
    result = checker.update("xabcdef")
    assert (result.stop_reason, checker.text) == ("abcd", "x")


def test_find_first_stop_only_reports_matches_ending_in_the_new_text():
    assert find_first_stop("STOP then", 5, ["STOP"]) is None
    assert find_first_stop("xxSTOP", 1, ["STOP"]) == StopMatch("STOP", 2)
    assert find_first_stop("xxSTOP", 4, ["ST", "STOP"]) == StopMatch("ST", 2)
    assert StopMatch("STOP", 2).end == 6


def test_request_finishing_releases_held_back_text():
    checker = Shown(StopChecker(["</answer>"]))
    assert checker.update("The answer is 42</ans").text_delta == "The answer is"
    result = checker.update("", finished=True)
    assert (result.text_delta, result.stopped) == (" 42</ans", False)
    assert checker.text == "The answer is 42</ans"
    with pytest.raises(ValueError, match="already finished"):
        checker.update("more")


def test_a_bare_string_is_one_stop_string():
    checker = Shown(StopChecker("ab"))
    assert checker.stop_strings == ("ab",)
    assert not checker.update("a b").stopped


def test_no_stop_strings_is_a_passthrough():
    checker = Shown(StopChecker([]))
    assert checker.holdback_chars == 0
    assert [checker.update(d).text_delta for d in ("a", "bc", "")] == ["a", "bc", ""]
    assert checker.text == "abc"


def test_deltas_after_a_stop_are_dropped():
    checker = Shown(StopChecker(["."]))
    assert checker.update("One. Two").stopped
    result = checker.update(" three")
    assert (result.text_delta, result.stopped, result.stop_reason) == ("", True, ".")
    assert checker.text == "One"


def test_check_stop_false_skips_the_search():
    checker = Shown(StopChecker(["END"]))
    assert checker.update("xEND", check_stop=False).text_delta == "xE"  # under min_tokens
    assert checker.update("y").text_delta == "N"  # that END lies wholly in older text
    assert checker.update("EN").text_delta == "Dy"
    result = checker.update("D")
    assert (result.text_delta, result.stopped) == ("", True)
    assert checker.text == "xENDy"


def test_unicode_stop_strings():
    checker = Shown(StopChecker(["。", "🛑"]))
    assert _feed(checker, ["你好", "世界。再", "见"]) == "你好世界"
    assert checker.stop_reason == "。"
    checker = Shown(StopChecker(["🛑"], include_stop_str_in_output=True))
    assert _feed(checker, ["go 🚀", "🛑 no"]) == "go 🚀🛑"


@pytest.mark.parametrize("bad", ["", None, 3])
def test_bad_stop_strings_are_rejected(bad):
    with pytest.raises(ValueError, match=r"stop\[1\]: must be a non-empty string"):
        StopChecker(["ok", bad])


def _reference(text, stop_strings, include):
    """Scan the text one character at a time: the first end offset where a stop string
    completes; among those ending there, the longest."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop_strings if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def _random_chunks(rng, text):
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(0, 6)
        chunks.append(text[i : i + n])
        i += n
    return chunks


@pytest.mark.parametrize("include", [False, True])
def test_random_texts_and_chunkings_match_character_by_character_scan(include):
    rng = random.Random(2024)
    alphabet = "ab c🙂"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stop = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        ]
        expected_text, expected_reason = _reference(text, stop, include)
        checker = Shown(StopChecker(stop, include_stop_str_in_output=include))
        chunks = _random_chunks(rng, text)
        emitted = _feed(checker, chunks + [""])
        assert emitted == checker.text == expected_text, (text, stop, chunks)
        assert checker.stop_reason == expected_reason
        if not include:
            assert not any(s in emitted for s in stop)


def test_held_back_text_is_at_most_longest_stop_minus_one():
    rng = random.Random(3)
    checker = Shown(StopChecker(["xyzzy", "q"]))
    text_so_far = emitted = ""
    for _ in range(200):
        delta = "".join(rng.choice("abcxy") for _ in range(rng.randint(0, 5)))
        text_so_far += delta
        emitted += checker.update(delta).text_delta
        assert text_so_far.startswith(emitted)
        assert len(text_so_far) - len(emitted) == min(4, len(text_so_far))
