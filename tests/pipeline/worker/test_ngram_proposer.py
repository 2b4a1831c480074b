"""Prompt-lookup proposals: the tokens after the latest earlier occurrence of the longest
matching suffix (max_n down to min_n), capped by num_speculative_tokens and the budget."""

from __future__ import annotations

import numpy as np
import pytest

from ringllm.pipeline.worker.ngram_proposer import NgramProposer


def propose(tokens, k=3, min_n=1, max_n=3, max_tokens=None) -> list[int]:
    return NgramProposer(k, min_n, max_n).propose(np.array(tokens), max_tokens).tolist()


def test_the_longest_suffix_wins_and_its_latest_occurrence():
    # suffix [7, 8]: seen at 0 (followed by 1, 2, 3) and at 5 (followed by 4, 4, 7)
    tokens = [7, 8, 1, 2, 3, 7, 8, 4, 4, 7, 8]
    assert propose(tokens) == [4, 4, 7]
    # [9, 7, 8] occurs once earlier: the 3-gram wins over the later 2-gram
    assert propose([9, 7, 8, 5, 6, 7, 8, 1, 9, 7, 8], max_n=3) == [5, 6, 7]


def test_no_match_proposes_nothing_and_min_n_is_kept():
    assert propose([1, 2, 3, 4]) == []
    assert propose([5, 1, 2, 5], min_n=2) == []  # only a 1-gram matches
    assert propose([5, 1, 2, 5], min_n=1) == [1, 2, 5]


def test_the_proposal_is_capped():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(tokens, k=2) == [3, 4]
    assert propose(tokens, k=5, max_tokens=1) == [3]
    assert propose(tokens, k=5, max_tokens=0) == []
    assert propose(tokens, k=10) == [3, 4, 5, 6, 1, 2]  # up to the end of the sequence


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="prompt_lookup"):
        NgramProposer(2, min_n=3, max_n=2)


def test_a_short_period_at_the_end_still_proposes_a_full_run():
    """x y x y x y: the latest earlier 'x y' leaves one token after it; an earlier one with
    a full run after it is taken instead (and the latest such one)."""
    proposer = NgramProposer(num_speculative_tokens=3, min_n=2, max_n=2)
    tokens = np.array([9, 7, 8, 7, 8, 7, 8, 7, 8])
    assert proposer.propose(tokens).tolist() == [7, 8, 7]
    # no occurrence has 3 tokens after it: the earliest one, with the most
    assert proposer.propose(np.array([7, 8, 5, 7, 8])).tolist() == [5, 7, 8]
