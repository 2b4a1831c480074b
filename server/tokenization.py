"""POST /tokenize and /detokenize, in vLLM's shapes.

    /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
              or {"messages": [...], "add_generation_prompt": true,
                  "add_special_tokens": false, "return_token_strs": false}
              -> {"count", "max_model_len", "tokens": [ids], "token_strs": [str] | null}
    /detokenize  {"tokens": [ids]} -> {"prompt": str}

A text of more tokens than the context holds is a 400 naming the count (as a generation
request would be). Chat messages are rendered with the model's chat template exactly as
/v1/chat/completions renders them, so `count` is the prompt size a chat request will have:
for a model that takes images, each image part counts as the positions its features fill
(the image token repeated), without the image being fetched or decoded (the count does not
depend on its pixels), and the image limit applies. Unknown fields are a 400, as on the
generation endpoints.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from ringllm.server.errors import ApiError
from ringllm.server.protocol import parse_tool_call_arguments

if TYPE_CHECKING:
    from ringllm.pipeline.frontend.async_llm import AsyncLLM

_TOKENIZE_FIELDS = {
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "return_token_strs",
}
_DETOKENIZE_FIELDS = {"model", "tokens"}


def known_fields(body: Any, known: set[str]) -> dict[str, Any]:
    """A JSON object body without its nulls; a 400 naming the first field not in `known`
    (the rule of every vLLM-shaped endpoint: embeddings.py's too)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    body = {key: value for key, value in body.items() if value is not None}
    for key in body:
        if key not in known:
            raise ApiError(f"unrecognized request argument supplied: {key}", param=key)
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(f"{name}: must be a JSON boolean, got {value!r}", param=name)
    return value


async def tokenize(llm: AsyncLLM, body: Any) -> str:
    """The response's JSON text. Tokenizing, the chat template and writing the JSON (a
    million ids: tens of ms) run on a worker thread, off the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, lambda: json.dumps(_tokenize(llm, body)))


async def detokenize(llm: AsyncLLM, body: Any) -> str:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, lambda: json.dumps(_detokenize(llm, body)))


def _tokenize(llm: AsyncLLM, body: Any) -> dict[str, Any]:
    body = known_fields(body, _TOKENIZE_FIELDS)
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise ApiError("give exactly one of prompt (text) or messages (a chat)", param="prompt")
    if has_prompt:
        if not isinstance(body["prompt"], str):
            raise ApiError("prompt: must be a string", param="prompt")
        add_special_tokens = _flag(body, "add_special_tokens", True)
        try:
            llm.front_end.check_text_fits(body["prompt"], "prompt")
            ids = llm.front_end.encode(body["prompt"], add_special_tokens, field="prompt")
        except ValueError as exc:
            raise ApiError(str(exc), param="prompt") from exc
    else:
        add_generation_prompt = _flag(body, "add_generation_prompt", True)
        add_special_tokens = _flag(body, "add_special_tokens", False)
        if isinstance(body["messages"], list):
            parse_tool_call_arguments(body["messages"])
        try:
            ids = llm.front_end.chat_prompt(
                body["messages"],
                add_generation_prompt=add_generation_prompt,
                add_special_tokens=add_special_tokens,
                load_images=False,
            ).token_ids
        except ValueError as exc:
            raise ApiError(str(exc), param="messages") from exc
    if len(ids) > llm.max_model_len:
        # the same answer whichever way the text was tokenized (a long one comes back from
        # the tokenizer process as its count only)
        field = "prompt" if has_prompt else "messages"
        raise ApiError(
            f"{field}: {len(ids)} tokens, more than this model's context of "
            f"{llm.max_model_len} tokens",
            param=field,
        )
    token_strs = None
    if _flag(body, "return_token_strs", False):
        token_strs = llm.tokenizer.convert_ids_to_tokens(ids)
    return {
        "count": len(ids),
        "max_model_len": llm.max_model_len,
        "tokens": ids,
        "token_strs": token_strs,
    }


def _detokenize(llm: AsyncLLM, body: Any) -> dict[str, Any]:
    body = known_fields(body, _DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise ApiError("tokens: must be a list of token ids (integers)", param="tokens")
    vocab_size = llm.tokenizer.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(
            f"tokens: token id {bad[0]} is outside the tokenizer's vocabulary [0, {vocab_size})",
            param="tokens",
        )
    return {"prompt": llm.tokenizer.decode(tokens)}
