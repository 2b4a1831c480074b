"""Prompt-lookup (n-gram) proposals for speculative decoding: no model, the request's own
tokens. If the last n tokens (n from `max_n` down to `min_n`) occurred earlier in the
sequence, the tokens that followed their latest earlier occurrence are proposed, up to
`num_speculative_tokens` of them (the latest occurrence with that many after it, else
the earliest). Input-grounded text (code being edited, a document being
quoted) repeats itself, so these proposals are often right and cost nothing to make.

One request is one numpy pass: the sequence's sliding windows of length n compared with its
last n tokens at once (`sliding_window_view`), no Python loop over positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    num_speculative_tokens: int
    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens: must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"prompt_lookup_min / prompt_lookup_max: need 1 <= min <= max, got "
                f"{self.min_n} and {self.max_n}"
            )

    def propose(self, token_ids: np.ndarray, max_tokens: int | None = None) -> np.ndarray:
        """The proposed tokens (int32, possibly none) to follow `token_ids` (the request's
        prompt and output so far); at most `max_tokens` (what is left of its budget)."""
        tokens = np.asarray(token_ids)
        limit = (
            self.num_speculative_tokens
            if max_tokens is None
            else min(self.num_speculative_tokens, max_tokens)
        )
        if limit < 1:
            return np.zeros(0, np.int32)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            windows = sliding_window_view(tokens[:-1], n)  # every earlier n-gram, by its start
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                # the latest earlier occurrence that has `limit` tokens after it; if none
                # has (a short period near the end), the earliest: the most to propose
                full = starts[starts + n + limit <= len(tokens)]
                follow = (full[-1] if full.size else starts[0]) + n
                return tokens[follow : follow + limit].astype(np.int32)
        return np.zeros(0, np.int32)
