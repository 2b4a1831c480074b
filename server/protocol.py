"""OpenAI request bodies -> validated requests with the engine's `SamplingParams`.

This is the one place where OpenAI's field names meet the engine's: `FIELD_TYPES` and
the `_sampling_kwargs` mapping below. Everything past this module speaks the engine's
names only.

Policy (documented for clients):
- A field whose value is null counts as absent, as in OpenAI's API.
- An unknown field is a 400 ("unrecognized request argument"), as OpenAI's API answers,
  so a misspelled sampling field is never silently ignored.
- A known OpenAI field that this engine cannot honour (functions, audio, suffix, best_of
  other than n, ...) is a 400 that names it; `user` is accepted and ignored (it only
  identifies the end user to the provider). Output constraints and tools:
  server/structured_request.py.
- Every value is type-checked here (JSON type) and range-checked by `SamplingParams`
  against what the wire carries (int32 counts, float64 numbers); either failure is a 400
  whose `param` is the field the client sent.
- `max_tokens` absent on /v1/completions: 16, as OpenAI's API and vLLM; `max_tokens` /
  `max_completion_tokens` absent on /v1/chat/completions: whatever is left of the context.
- What one request may ask for is bounded (server/limits.py): each limit is a 400 naming
  the field, the value and the limit.
- Chat content parts: an `image_url` part's `image_url` is {"url": str, "detail": ...} or
  the URL as a string (vLLM takes both; `detail` is accepted and ignored); any other shape
  is a 400 naming the part's path. Whether the model takes images, the URL and the image
  itself are the front end's to check (pipeline/frontend/mm_prompt.py). /v1/completions
  takes no images, as vLLM's.
- `cache_salt` (vLLM's, both endpoints): a non-empty string; only requests with the same
  salt share prefix-cache blocks (the salt keys the first block's hash).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringllm.pipeline.sampling_params import MAX_INT32, RequestOutputKind, SamplingParams
from ringllm.server.errors import ApiError, invalid_value
from ringllm.server.guards import parse_json
from ringllm.server.limits import ServerLimits
from ringllm.server.structured_request import (
    STRUCTURED_FIELDS,
    TOOL_FIELDS,
    ToolRequest,
    parse_structured_outputs,
    parse_tools,
)

IMAGE_DETAILS = ("auto", "low", "high")
# OpenAI's default for /v1/completions when max_tokens is absent (vLLM's too).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
DEFAULT_LIMITS = ServerLimits()

INTEGER, NUMBER, BOOLEAN, STRING, ARRAY, OBJECT = (
    "integer",
    "number",
    "boolean",
    "string",
    "array",
    "object",
)

# Sampling fields that keep their name in SamplingParams, with their JSON type. The vLLM
# extras (top_k ... include_stop_str_in_output) are accepted by both endpoints.
FIELD_TYPES = {
    "temperature": NUMBER,
    "top_p": NUMBER,
    "n": INTEGER,
    "seed": INTEGER,
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "top_k": INTEGER,
    "min_p": NUMBER,
    "repetition_penalty": NUMBER,
    "min_tokens": INTEGER,
    "ignore_eos": BOOLEAN,
    "skip_special_tokens": BOOLEAN,
    "include_stop_str_in_output": BOOLEAN,
}
# Fields every generation endpoint knows, handled one by one below.
COMMON_FIELDS = {
    "model",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "max_tokens",
    "logprobs",
    "user",
    "cache_salt",
}
COMPLETION_FIELDS = COMMON_FIELDS | STRUCTURED_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = (
    COMMON_FIELDS
    | STRUCTURED_FIELDS
    | TOOL_FIELDS
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "functions",
        "function_call",
        "audio",
        "modalities",
        "prediction",
        "reasoning_effort",
        "web_search_options",
        "store",
        "metadata",
    }
)

# OpenAI fields the engine cannot honour: the values that are harmless, and why others fail.
_CHAT_UNSUPPORTED = {
    "functions": (lambda v: v == [], "the deprecated functions field is not supported; use tools"),
    "function_call": (
        lambda v: v == "none",
        "the deprecated function_call field is not supported; use tool_choice",
    ),
    "audio": (lambda v: False, "audio output is not supported"),
    "modalities": (lambda v: v == ["text"], "only the 'text' modality is supported"),
    "prediction": (lambda v: False, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v: False, "reasoning effort is not supported"),
    "web_search_options": (lambda v: False, "web search is not supported"),
    "store": (lambda v: v is False, "storing completions is not supported"),
}
_COMPLETION_UNSUPPORTED = {
    "suffix": (lambda v: v == "", "suffix (insertion) is not supported"),
}


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    cache_salt: str | None = None

    @property
    def engine_prompts(self) -> list[Any]:
        """The prompts as the engine takes them: with the cache salt, vLLM's prompt dicts."""
        if self.cache_salt is None:
            return list(self.prompts)
        return [
            {
                "prompt" if isinstance(p, str) else "prompt_token_ids": p,
                "cache_salt": self.cache_salt,
            }
            for p in self.prompts
        ]


@dataclass
class ChatRequest:
    model: str | None
    messages: list[Any]
    params: SamplingParams
    stream: bool
    include_usage: bool
    want_logprobs: bool
    tools: ToolRequest | None = None
    cache_salt: str | None = None


def parse_completion_request(
    body: Any, limits: ServerLimits = DEFAULT_LIMITS, max_model_len: int | None = None
) -> CompletionRequest:
    body = _checked_body(body, COMPLETION_FIELDS, _COMPLETION_UNSUPPORTED)
    kwargs = _sampling_kwargs(body, limits)
    max_tokens = _typed(body, "max_tokens", INTEGER)
    kwargs["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    kwargs["logprobs"] = _typed(body, "logprobs", INTEGER)
    echo = bool(_typed(body, "echo", BOOLEAN))
    if echo and kwargs["logprobs"] is not None:
        kwargs["prompt_logprobs"] = kwargs["logprobs"]
    stream, include_usage = _stream_flags(body)
    kwargs["structured_outputs"] = parse_structured_outputs(body)
    params = _make_params(kwargs, stream, {})
    best_of = _typed(body, "best_of", INTEGER)
    if best_of is not None and best_of != params.n:
        raise ApiError(
            f"best_of: {best_of} is not supported; this engine returns every sequence it "
            f"samples, so best_of must equal n ({params.n}) or be omitted",
            param="best_of",
        )
    prompts = _parse_prompts(body.get("prompt"))
    _check_budget(len(prompts), params, limits, max_model_len)
    return CompletionRequest(
        model=_typed(body, "model", STRING),
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=include_usage,
        echo=echo,
        cache_salt=_cache_salt(body),
    )


def parse_chat_request(
    body: Any,
    limits: ServerLimits = DEFAULT_LIMITS,
    max_model_len: int | None = None,
    auto_tool_choice: bool = False,
) -> ChatRequest:
    """`auto_tool_choice`: the server parses tool calls out of free text (its
    --enable-auto-tool-choice and --tool-call-parser)."""
    body = _checked_body(body, CHAT_FIELDS, _CHAT_UNSUPPORTED)
    kwargs = _sampling_kwargs(body, limits)
    rename = {}
    max_tokens = _typed(body, "max_tokens", INTEGER)
    max_completion_tokens = _typed(body, "max_completion_tokens", INTEGER)
    if max_tokens is not None and max_completion_tokens is not None:
        raise ApiError(
            "max_tokens and max_completion_tokens were both given; send only "
            "max_completion_tokens (max_tokens is its deprecated name)",
            param="max_completion_tokens",
        )
    if max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    kwargs["max_tokens"] = max_completion_tokens if max_tokens is None else max_tokens
    want_logprobs = bool(_typed(body, "logprobs", BOOLEAN))
    top_logprobs = _typed(body, "top_logprobs", INTEGER)
    if top_logprobs is not None and not want_logprobs:
        raise ApiError("top_logprobs: needs logprobs set to true", param="top_logprobs")
    if want_logprobs:
        kwargs["logprobs"] = top_logprobs or 0
        rename["logprobs"] = "top_logprobs"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages: must be a non-empty list of messages", param="messages")
    _check_messages(messages, limits)
    stream, include_usage = _stream_flags(body)
    _check_tool_count(body.get("tools"), limits)
    tools = parse_tools(body, auto_tool_choice)
    structured = parse_structured_outputs(body)
    forced = tools.structured_outputs if tools is not None else None
    if structured is not None and forced is not None:
        raise ApiError(
            f"tool_choice: {tools.mode} tool calls are enforced with a grammar, which cannot "
            "go together with response_format / structured_outputs; drop one",
            param="tool_choice",
        )
    kwargs["structured_outputs"] = structured or forced
    params = _make_params(kwargs, stream, rename)
    _check_budget(1, params, limits, max_model_len, rename)
    return ChatRequest(
        model=_typed(body, "model", STRING),
        messages=messages,
        params=params,
        stream=stream,
        include_usage=include_usage,
        want_logprobs=want_logprobs,
        tools=tools,
        cache_salt=_cache_salt(body),
    )


# ---- helpers -------------------------------------------------------------------------


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's `cache_salt`: only requests with the same salt share cached prefixes (a
    tenant's prompts cannot be probed through another's prefix hits); a non-empty string."""
    salt = _typed(body, "cache_salt", STRING)
    if salt == "":
        raise ApiError("cache_salt: must be a non-empty string if given", param="cache_salt")
    return salt


def _check_budget(
    num_prompts: int,
    params: SamplingParams,
    limits: ServerLimits,
    max_model_len: int | None,
    rename: dict[str, str] | None = None,
) -> None:
    choices = num_prompts * params.n
    if choices > limits.max_choices:
        raise ApiError(
            f"n: {num_prompts} prompt(s) x n={params.n} asks for {choices} choices; "
            f"at most {limits.max_choices} per request (--max-choices)",
            param="n",
        )
    per_choice = params.max_tokens if params.max_tokens is not None else max_model_len
    if per_choice is not None and choices * per_choice > limits.max_request_tokens:
        name = (rename or {}).get("max_tokens", "max_tokens")
        given = "absent (the whole context)" if params.max_tokens is None else per_choice
        raise ApiError(
            f"{name}: {choices} choice(s) x {name} {given} = {choices * per_choice} tokens "
            f"is more than one request may ask for ({limits.max_request_tokens}, "
            f"--max-request-tokens); lower n or set a smaller {name}",
            param=name,
        )


def _check_tool_count(tools: Any, limits: ServerLimits) -> None:
    """Before any schema is checked: the checks are what costs (milliseconds each)."""
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        raise ApiError(
            f"tools: {len(tools)} tools; at most {limits.max_tools} per request (--max-tools)",
            param="tools",
        )


def _check_messages(messages: list[Any], limits: ServerLimits) -> None:
    if len(messages) > limits.max_messages:
        raise ApiError(
            f"messages: {len(messages)} messages; at most {limits.max_messages} per request "
            f"(--max-messages)",
            param="messages",
        )
    parts = sum(
        len(m["content"])
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    if parts > limits.max_content_parts:
        raise ApiError(
            f"messages: {parts} content parts; at most {limits.max_content_parts} per request "
            f"(--max-content-parts)",
            param="messages",
        )
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "image_url":
                _check_image_url(part.get("image_url"), f"messages[{i}].content[{j}].image_url")
    parse_tool_call_arguments(messages)


def parse_tool_call_arguments(messages: list[Any]) -> None:
    """Each assistant's tool-call `arguments` (JSON text, as OpenAI sends them) parsed in
    place under the body's own rules (server/guards.py: depth, text, no NaN): a template
    is given only what the body itself could have held, as the objects it indexes."""
    for i, message in enumerate(messages):
        if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
            messages[i] = {**message, "tool_calls": _parsed_tool_calls(message["tool_calls"], i)}


def _parsed_tool_calls(tool_calls: list[Any], index: int) -> list[Any]:
    parsed = []
    for k, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            where = f"messages[{index}].tool_calls[{k}].function.arguments"
            try:
                arguments = parse_json(arguments, where)
            except ApiError as exc:
                exc.param = "messages"
                raise
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return parsed


def _check_image_url(value: Any, where: str) -> None:
    """OpenAI's {"url": ..., "detail": ...}, or the URL alone (vLLM's)."""
    if isinstance(value, str):
        url = value
    elif isinstance(value, dict):
        unknown = sorted(set(value) - {"url", "detail"})
        if unknown:
            raise ApiError(
                f"{where}: unknown field(s) {unknown}; an image_url has 'url' and 'detail'",
                param="messages",
            )
        url = value.get("url")
        detail = value.get("detail")
        if detail is not None and detail not in IMAGE_DETAILS:
            raise ApiError(
                f"{where}.detail: must be one of {', '.join(IMAGE_DETAILS)}, got {_short(detail)}",
                param="messages",
            )
    else:
        raise ApiError(
            f"{where}: must be an object {{'url': '<URL>'}} or a URL string, got "
            f"{_json_type(value)}",
            param="messages",
        )
    if not isinstance(url, str) or not url:
        raise ApiError(
            f"{where}.url: must be a non-empty string (a data:, file: or http(s): URL), got "
            f"{_short(url)}",
            param="messages",
        )


def _checked_body(body: Any, known: set[str], unsupported: dict) -> dict[str, Any]:
    """The body with null fields dropped; refuses unknown and unsupported fields."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {_json_type(body)}")
    body = {key: value for key, value in body.items() if value is not None}
    for key in body:
        if key not in known and key not in FIELD_TYPES:
            raise ApiError(f"unrecognized request argument supplied: {key}", param=key)
    for key, (harmless, why) in unsupported.items():
        if key in body and not harmless(body[key]):
            raise ApiError(f"{key}: {why} (got {body[key]!r})", param=key)
    return body


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return BOOLEAN
    if isinstance(value, int):
        return INTEGER
    if isinstance(value, float):
        return NUMBER
    return {str: STRING, list: ARRAY, dict: OBJECT}.get(type(value), type(value).__name__)


def _typed(body: dict[str, Any], name: str, expected: str) -> Any:
    """body[name] (None when absent), after checking its JSON type."""
    value = body.get(name)
    if value is None:
        return None
    actual = _json_type(value)
    if actual == expected or (expected == NUMBER and actual == INTEGER):
        return value
    raise ApiError(f"{name}: must be a JSON {expected}, got {actual} {value!r}", param=name)


def _sampling_kwargs(body: dict[str, Any], limits: ServerLimits) -> dict[str, Any]:
    kwargs = {name: _typed(body, name, kind) for name, kind in FIELD_TYPES.items()}
    kwargs = {name: value for name, value in kwargs.items() if value is not None}
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise ApiError(
            f"stop: must be a string or a list of strings, got {_short(stop)}", param="stop"
        )
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > limits.max_stop:
        raise ApiError(
            f"stop: {len(stops)} stop strings; at most {limits.max_stop} (--max-stop)", param="stop"
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_chars:
        raise ApiError(
            f"stop: a stop string of {longest} characters; at most {limits.max_stop_chars} "
            f"(--max-stop-chars)",
            param="stop",
        )
    kwargs["stop"] = stop
    stop_ids = _typed(body, "stop_token_ids", ARRAY)
    if stop_ids is not None:
        if not all(_json_type(t) == INTEGER and 0 <= t <= MAX_INT32 for t in stop_ids):
            raise ApiError(
                f"stop_token_ids: must be a list of token ids (integers in [0, {MAX_INT32}]), "
                f"got {_short(stop_ids)}",
                param="stop_token_ids",
            )
        if len(stop_ids) > limits.max_stop_token_ids:
            raise ApiError(
                f"stop_token_ids: {len(stop_ids)} ids; at most {limits.max_stop_token_ids} "
                f"(--max-stop-token-ids)",
                param="stop_token_ids",
            )
    kwargs["stop_token_ids"] = stop_ids
    kwargs["logit_bias"] = _parse_logit_bias(_typed(body, "logit_bias", OBJECT), limits)
    return kwargs


def _short(value: Any, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters (error messages stay readable)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_logit_bias(raw: dict[str, Any] | None, limits: ServerLimits) -> dict[int, Any] | None:
    """JSON object keys are strings: {"50256": -100} -> {50256: -100}."""
    if raw is None:
        return None
    if len(raw) > limits.max_logit_bias:
        raise ApiError(
            f"logit_bias: {len(raw)} entries; at most {limits.max_logit_bias} (--max-logit-bias)",
            param="logit_bias",
        )
    bias = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= MAX_INT32):
            raise ApiError(
                f"logit_bias: keys must be token ids written as decimal strings (at most "
                f"{MAX_INT32}), got {_short(key)}",
                param="logit_bias",
            )
        if _json_type(value) not in (INTEGER, NUMBER):
            raise ApiError(
                f"logit_bias: the bias of token {key} must be a number, got {value!r}",
                param="logit_bias",
            )
        bias[int(key)] = value
    return bias


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_typed(body, "stream", BOOLEAN))
    options = _typed(body, "stream_options", OBJECT)
    if options is None:
        return stream, False
    if not stream:
        raise ApiError("stream_options: only allowed when stream is true", param="stream_options")
    unknown = set(options) - {"include_usage"}
    if unknown:
        raise ApiError(
            f"stream_options: unknown option(s) {sorted(unknown)}; only include_usage is known",
            param="stream_options",
        )
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ApiError(
            f"stream_options.include_usage: must be a JSON boolean, got {include_usage!r}",
            param="stream_options",
        )
    return stream, bool(include_usage)


def _make_params(kwargs: dict[str, Any], stream: bool, rename: dict[str, str]) -> SamplingParams:
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**kwargs, output_kind=kind)
    except ValueError as exc:
        raise invalid_value(exc, rename) from exc


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_json_type(t) == INTEGER for t in value)


def _parse_prompts(prompt: Any) -> list[str | list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if _is_token_ids(prompt):
            return [prompt]
        if all(_is_token_ids(p) for p in prompt):
            return list(prompt)
    if prompt is None:
        raise ApiError("prompt: is required", param="prompt")
    raise ApiError(
        "prompt: must be a string, a non-empty list of strings, a non-empty list of token ids "
        f"(integers), or a list of non-empty token-id lists; got {_json_type(prompt)} "
        f"{str(prompt)[:80]}",
        param="prompt",
    )
