"""Front-end input processing: a prompt (text, token ids, a dict of either, or a chat) ->
token ids, and a user request -> the engine-core requests it becomes.

Checks what the engine core cannot: the prompt is non-empty, every id is inside the
vocabulary, and the sampling parameters' token ids too; the online APIs also refuse an
explicit max_tokens the context cannot hold. Errors name the field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ringllm.pipeline.frontend.chat_template import ChatTemplate
from ringllm.pipeline.sampling_params import SamplingParams

# (text, add_special_tokens) -> token ids: `Tokenizer.encode`, or the front end's, which
# sends long texts to a tokenizer process
Encode = Callable[[str, bool], list[int]]


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]


def process_prompt(prompt: Any, encode: Encode, vocab_size: int) -> ProcessedPrompt:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return ProcessedPrompt(prompt, encode(prompt, True))
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


def chat_prompt(
    template: ChatTemplate,
    encode: Encode,
    messages: list[Any],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    check_text=None,
    tools: list[dict[str, Any]] | None = None,
) -> ProcessedPrompt:
    """A conversation rendered with the model's chat template, then tokenized: the one
    place chat prompts are made (LLM.chat, /v1/chat/completions, /tokenize). The template
    writes any BOS itself, so the tokenizer adds no special token unless asked."""
    text = template.render(
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
        tools=tools,
    )
    if check_text is not None:
        check_text(text)  # before the (costly) tokenizing
    return ProcessedPrompt(None, encode(text, add_special_tokens))


def check_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Online APIs refuse an explicit max_tokens the context cannot hold (the offline API
    caps it instead), as OpenAI and vLLM's server do."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: this model's maximum context length is {max_model_len} tokens, but "
            f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion); reduce the prompt or max_tokens"
        )


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
