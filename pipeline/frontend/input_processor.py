"""Front-end input processing: a prompt (text, token ids, or a dict of either) -> token ids.

Checks what the engine core cannot: the prompt is non-empty, every id is inside the
vocabulary, and the sampling parameters' token ids too. Errors name the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringllm.pipeline.core.request import Request
from ringllm.pipeline.frontend.output_processor import OutputProcessor, ParentRequest
from ringllm.pipeline.frontend.tokenizer import Tokenizer
from ringllm.pipeline.sampling_params import SamplingParams


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


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The engine-core requests of one user request: itself, or its n children.

    Child i is "{i}_{request_id}" with n=1; a seeded parent gives it seed + i (mod 2**64),
    so the children differ from each other but the whole request stays reproducible.
    """
    if params.n == 1:
        return [(request_id, params)]
    children = []
    for index in range(params.n):
        child = params.clone()
        child.n = 1
        if params.seed is not None:
            child.seed = (params.seed + index) % (1 << 64)
        children.append((f"{index}_{request_id}", child))
    return children


def submit(
    core,
    output_processor: OutputProcessor,
    request_id: str,
    processed: ProcessedPrompt,
    params: SamplingParams,
    eos_token_ids: tuple[int, ...],
    arrival: float,
    priority: int = 0,
) -> None:
    """Admits a user request's engine-core requests and registers them for output processing.

    All or nothing: if the core refuses one child, the children already sent are aborted and
    the ValueError propagates.
    """
    parent = ParentRequest(request_id, params.n) if params.n > 1 else None
    sent: list[str] = []
    try:
        for index, (child_id, child_params) in enumerate(fan_out(request_id, params)):
            request = Request(
                child_id,
                processed.token_ids,
                child_params,
                eos_token_ids,
                priority=priority,
                arrival_time=arrival,
            )
            core.add_request(request)
            sent.append(child_id)
            output_processor.add_request(
                child_id,
                processed.text,
                processed.token_ids,
                child_params,
                arrival,
                parent=parent,
                index=index,
            )
    except BaseException:
        if sent:
            core.abort_requests(sent)
        output_processor.abort([request_id])
        raise
