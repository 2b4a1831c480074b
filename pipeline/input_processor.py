"""Front-end input processing: a prompt (text, token ids, or a dict of either) -> token ids.

Checks what the engine core cannot: the prompt is non-empty, every id is inside the
vocabulary, and the sampling parameters' token ids too. Errors name the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.tokenizer import Tokenizer


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]


def process_prompt(prompt: Any, tokenizer: Tokenizer, vocab_size: int) -> ProcessedPrompt:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return ProcessedPrompt(prompt, tokenizer.encode(prompt))
    if isinstance(prompt, Sequence) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: token id list is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )
        return ProcessedPrompt(None, ids)
    raise ValueError(
        f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}"
    )


def check_params(params: SamplingParams, vocab_size: int) -> None:
    params.check_token_ids(vocab_size)
