"""What every dataset makes and needs: a `SampleRequest`, the tokenizer protocol, the pool of
token ids a random prompt draws from, and the checks of the counts the flags give."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class DatasetTokenizer(Protocol):
    """What a dataset needs from a tokenizer (ringllm's `Tokenizer` has all of it)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def all_special_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids the engine takes as they are
    prompt_len: int  # tokens (with the image positions, when known: see the module doc)
    expected_output_len: int  # tokens
    images: tuple[bytes, ...] = ()  # PNG files, sent with the prompt in this order


def prompt_token_pool(tokenizer: DatasetTokenizer) -> np.ndarray:
    """Every id of the vocabulary a random prompt may use: all but the special tokens.

    NOTE: special tokens (BOS, EOS, chat markers) would change what the model does
    (an early EOS in the prompt, a new turn), so benchmarks avoid them as vLLM does.
    """
    ids = np.arange(tokenizer.vocab_size, dtype=np.int64)
    special = np.fromiter(tokenizer.all_special_ids, dtype=np.int64)
    pool = ids[~np.isin(ids, special)]
    if pool.size == 0:
        raise ValueError(
            f"tokenizer: all {tokenizer.vocab_size} ids are special; no prompt tokens to draw"
        )
    return pool


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive [low, high] a length drawn with `range_ratio` falls in (low >= 1)."""
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def check_positive(field: str, value: Any, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}: must be an int >= 1 {unit}, got {value!r}")


def draw_lengths(
    rng: np.random.Generator, num_requests: int, input_len: int, output_len: int, range_ratio: float
) -> list[tuple[int, int]]:
    """Each request's (input, output) token counts, uniform in `length_bounds`; all the
    inputs are drawn first, then all the outputs (the order a seed's requests depend on)."""
    in_low, in_high = length_bounds(input_len, range_ratio)
    out_low, out_high = length_bounds(output_len, range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    return list(zip(input_lens.tolist(), output_lens.tolist(), strict=True))
