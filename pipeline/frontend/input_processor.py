"""Front-end input processing: a prompt (text, token ids, a dict of either, or a chat) ->
token ids, and a user request -> the engine-core requests it becomes.

Checks what the engine core cannot: the prompt is non-empty, every id is inside the
vocabulary, and the sampling parameters' token ids too; the online APIs also refuse an
explicit max_tokens the context cannot hold. Errors name the field.

For a model that takes images (`images`: the front end's PromptImages, mm_prompt.py) a
prompt's images come from its chat parts or `multi_modal_data`; its token ids are then
the expanded ones and `mm_inputs` the images at their positions. For a text-only model
(`images` None) any image is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ringllm.pipeline.frontend.chat_template import ChatTemplate, image_parts
from ringllm.pipeline.frontend.mm_prompt import (
    MM_DATA_FIELD,
    ImageSource,
    PromptImages,
    sources_of_mm_data,
)
from ringllm.pipeline.messages import ImageInput, cache_salt_digest
from ringllm.pipeline.sampling_params import SamplingParams

# (text, add_special_tokens) -> token ids: `Tokenizer.encode`, or the front end's, which
# sends long texts to a tokenizer process
Encode = Callable[[str, bool], list[int]]


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    mm_inputs: tuple[ImageInput, ...] = ()  # in position order (token_ids are expanded)
    cache_salt: bytes = b""  # its digest (messages.py: cache_salt_digest); b"": none


def cache_salt_of(salt: Any, field: str = "cache_salt") -> bytes:
    """A request's `cache_salt` (vLLM's: a non-empty string) as the engine carries it."""
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"{field}: must be a non-empty string, got {salt!r:.80}")
    return cache_salt_digest(salt)


def process_prompt(
    prompt: Any, encode: Encode, vocab_size: int, images: PromptImages | None = None
) -> ProcessedPrompt:
    """Text, token ids, or {"prompt" | "prompt_token_ids": ..., "multi_modal_data": ...,
    "cache_salt": ...} (vLLM's prompt dicts)."""
    sources: list[ImageSource] = []
    salt = b""
    if isinstance(prompt, dict):
        if prompt.get("cache_salt") is not None:
            salt = cache_salt_of(prompt["cache_salt"])
        if prompt.get(MM_DATA_FIELD) is not None:
            sources = _mm_data_sources(prompt[MM_DATA_FIELD], images)
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    processed = _text_or_ids(prompt, encode, vocab_size)
    if images is not None:
        processed = with_images(processed, sources, images, "prompt")
    processed.cache_salt = salt
    return processed


def _mm_data_sources(mm_data: Any, images: PromptImages | None) -> list[ImageSource]:
    if images is None:
        raise ValueError(
            f"{MM_DATA_FIELD}: this model does not take images (it is text-only); send the "
            "prompt alone"
        )
    sources = sources_of_mm_data(mm_data)
    images.check_count(len(sources), f"{MM_DATA_FIELD}.image")
    return sources


def with_images(
    processed: ProcessedPrompt,
    sources: list[ImageSource],
    images: PromptImages,
    field: str,
    load: bool = True,
) -> ProcessedPrompt:
    """The prompt expanded for its images and, with `load`, the images read and
    preprocessed (on the media pool; without it, the expanded ids alone, for counting)."""
    ids, offsets = images.place(processed.token_ids, len(sources), field)
    mm_inputs = images.load(sources, offsets) if load and sources else ()
    return ProcessedPrompt(processed.text, ids, mm_inputs)


def _text_or_ids(prompt: Any, encode: Encode, vocab_size: int) -> ProcessedPrompt:
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
    images: PromptImages | None = None,
    load_images: bool = True,
) -> ProcessedPrompt:
    """A conversation rendered with the model's chat template, then tokenized: the one
    place chat prompts are made (LLM.chat, /v1/chat/completions, /tokenize). The template
    writes any BOS itself, so the tokenizer adds no special token unless asked.

    With `images`, the image parts are counted against the limit first, and read and
    preprocessed last, once the prompt's image tokens are checked and it fits
    (`load_images` False: not at all, the expanded ids only)."""
    sources = []
    if images is not None:
        sources = [ImageSource(item, where) for where, item in image_parts(messages)]
        images.check_count(len(sources), "messages")
    text = template.render(
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
        tools=tools,
        image_placeholder=images.tokens.text if images is not None else None,
    )
    if check_text is not None:
        check_text(text)  # before the (costly) tokenizing
    processed = ProcessedPrompt(None, encode(text, add_special_tokens))
    if images is None:
        return processed
    return with_images(processed, sources, images, "messages", load=load_images)


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
