"""OpenAI response shapes: completion and chat objects, their stream chunks, logprobs, usage.

Pure functions from the engine's outputs (`CompletionOutput`, `PositionLogprobs`) to the
JSON-ready dicts OpenAI's API returns, so the shapes can be read in one place:

    completion   {"id": "cmpl-..", "object": "text_completion", "created", "model",
                  "choices": [{"index", "text", "logprobs", "finish_reason"}], "usage"}
    chat         {"id": "chatcmpl-..", "object": "chat.completion", ...,
                  "choices": [{"index", "message": {"role", "content"}, "logprobs",
                               "finish_reason"}], "usage"}
    chunks       the same with object "*.chunk" / "text_completion" and `delta` for chat

Logprobs: completions give tokens / token_logprobs / top_logprobs / text_offset; chat
gives content[{token, logprob, bytes, top_logprobs[{token, logprob, bytes}]}]. "Top N"
means the N best-ranked tokens of the position (the sampled one appears there only when
it is among them).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ringllm.pipeline.frontend.tokenizer import Tokenizer
from ringllm.pipeline.outputs import Logprob, PositionLogprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ResponseHeader:
    """What every object and chunk of one response repeats."""

    response_id: str
    model: str
    created_s: int = field(default_factory=lambda: int(time.time()))

    def wrap(self, obj: str, choices: list, **extra) -> dict:
        return {
            "id": self.response_id,
            "object": obj,
            "created": self.created_s,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def completion_choice(
    index: int, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason
) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_choice(
    index: int, message: dict, logprobs: dict | None, finish_reason: str | None, stop_reason
) -> dict:
    """`message`: {"role": "assistant", "content", and reasoning_content / tool_calls}."""
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_chunk_choice(
    index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None
) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


# ---- logprobs ------------------------------------------------------------------------


def _top(position: PositionLogprobs, num_top: int) -> list[tuple[int, Logprob]]:
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank >= 1]
    ranked.sort(key=lambda item: item[1].rank)
    return ranked[:num_top]


# JSON has no -Infinity: a token the sampler could not pick (refused by a grammar, cut by
# top-k / top-p) shows vLLM's stand-in instead, so every client can parse the body.
MIN_LOGPROB = -9999.0


def _logprob(value: float | None) -> float | None:
    return None if value is None else max(value, MIN_LOGPROB)


def _token_text(token_id: int, entry: Logprob | None, tokenizer: Tokenizer) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionLogprobsBuilder:
    """Builds completions' logprobs for one choice; text_offset runs on across chunks."""

    def __init__(self, tokenizer: Tokenizer, num_top: int) -> None:
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.offset_chars = 0

    def build(
        self, token_ids: list[int], positions: list[PositionLogprobs | None]
    ) -> dict[str, list]:
        """A position of None (a prompt's first token) has no logprob."""
        result: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token_id, position in zip(token_ids, positions, strict=True):
            entry = position.get(token_id) if position is not None else None
            text = _token_text(token_id, entry, self.tokenizer)
            result["tokens"].append(text)
            result["token_logprobs"].append(_logprob(entry.logprob) if entry is not None else None)
            result["top_logprobs"].append(None if position is None else self._top_dict(position))
            result["text_offset"].append(self.offset_chars)
            self.offset_chars += len(text)
        return result

    def _top_dict(self, position: PositionLogprobs) -> dict[str, float]:
        # NOTE: OpenAI keys these by text; two tokens with one text (two halves of a
        # multi-byte character both show as U+FFFD) keep the better-ranked one.
        top: dict[str, float] = {}
        for tid, lp in _top(position, self.num_top):
            top.setdefault(_token_text(tid, lp, self.tokenizer), _logprob(lp.logprob))
        return top


def _token_bytes(token_id: int, text: str, tokenizer: Tokenizer) -> list[int]:
    try:
        return list(tokenizer.token_bytes(token_id))
    except ValueError:  # an id the model has but the tokenizer does not (padded vocab)
        return list(text.encode("utf-8"))


def chat_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], tokenizer: Tokenizer, num_top: int
) -> dict[str, list]:
    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        entry = position.get(token_id)
        text = _token_text(token_id, entry, tokenizer)
        top = []
        for tid, lp in _top(position, num_top):
            top_text = _token_text(tid, lp, tokenizer)
            top.append(
                {
                    "token": top_text,
                    "logprob": _logprob(lp.logprob),
                    "bytes": _token_bytes(tid, top_text, tokenizer),
                }
            )
        content.append(
            {
                "token": text,
                "logprob": _logprob(entry.logprob) if entry is not None else None,
                "bytes": _token_bytes(token_id, text, tokenizer),
                "top_logprobs": top,
            }
        )
    return {"content": content}
