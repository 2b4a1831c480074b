"""POST /v1/completions and /v1/chat/completions: validated requests -> engine -> OpenAI JSON.

One `Serving` per app holds the engine and what the responses repeat. Per request:

    parse (protocol.py) -> MergedGenerations (one engine request per prompt)
       non-streaming: FINAL_ONLY outputs -> one JSON object
       streaming:     wait until every prompt is admitted (so a prompt over the context is
                      still a 400), then DELTA outputs -> one SSE chunk per token step

Choice indices follow OpenAI and vLLM: prompt i, sample j -> index i * n + j.

Invariants: every exit (finished, client gone, handler cancelled, engine dead) closes the
engine requests, which aborts the unfinished ones in the engine core and frees their KV
blocks; every choice is counted once in request_success (unfinished ones as "abort").
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ringllm.pipeline.frontend.input_processor import ProcessedPrompt, cache_salt_of
from ringllm.pipeline.outputs import CompletionOutput, RequestOutput
from ringllm.server.chat_outputs import ChoiceOutput, OutputParsing
from ringllm.server.engine_requests import MergedGenerations
from ringllm.server.errors import ApiError, invalid_value, to_api_error
from ringllm.server.limits import ServerLimits
from ringllm.server.metrics import ServerMetrics
from ringllm.server.protocol import ChatRequest, CompletionRequest
from ringllm.server.responses import (
    CompletionLogprobsBuilder,
    ResponseHeader,
    chat_choice,
    chat_chunk_choice,
    chat_logprobs,
    completion_choice,
    new_id,
    usage,
)
from ringllm.server.streaming import SseStream

if TYPE_CHECKING:
    from ringllm.pipeline.frontend.async_llm import AsyncLLM


@dataclass
class ChoiceCounter:
    """Counts each choice's end once: finished ones by reason, the rest as aborted."""

    metrics: ServerMetrics
    num_choices: int
    num_finished: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, completion: CompletionOutput) -> None:
        self.completion_tokens += len(completion.token_ids)
        if completion.finish_reason is not None:
            self.num_finished += 1
            self.metrics.count_finished(completion.finish_reason)

    def close(self) -> None:
        self.metrics.count_finished("abort", self.num_choices - self.num_finished)
        self.num_finished = self.num_choices

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens)


@dataclass
class Serving:
    llm: AsyncLLM
    model_name: str
    metrics: ServerMetrics
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)
    parsing: OutputParsing = dataclasses.field(default_factory=OutputParsing)

    def with_lora(self, lora) -> Serving:
        """This model's serving for requests that name LoRA adapter `lora` (a
        LoRARequest): they run with it, and responses name it as their model."""
        from ringllm.server.lora_adapters import LoraEngine

        return dataclasses.replace(self, llm=LoraEngine(self.llm, lora), model_name=lora.lora_name)

    # ---- completions -----------------------------------------------------------------

    async def completions(self, http: web.Request, req: CompletionRequest) -> web.StreamResponse:
        header = ResponseHeader(new_id("cmpl"), self.model_name)
        merged = MergedGenerations(self.llm, req.engine_prompts, req.params, header.response_id)
        counter = ChoiceCounter(self.metrics, len(req.prompts) * req.params.n)
        try:
            if req.stream:
                stream = _Stream(
                    "text_completion", req.include_usage, {}, self.limits.stream_write_timeout_s
                )
                choices_of = self._completion_chunks(req, counter)
                return await stream.run(http, header, merged, counter, choices_of)
            finals = await collect_finals(merged, {})
            choices = []
            for i, out in enumerate(finals):
                counter.prompt_tokens += len(out.prompt_token_ids)
                for completion in out.outputs:
                    counter.add(completion)
                    choices.append(self._completion_choice(req, i, out, completion, first=True))
            return web.json_response(header.wrap("text_completion", choices, usage=counter.usage()))
        finally:
            counter.close()
            await merged.close()

    def _completion_choice(
        self,
        req: CompletionRequest,
        prompt_index: int,
        out: RequestOutput,
        completion: CompletionOutput,
        first: bool,
        builders: dict[int, CompletionLogprobsBuilder] | None = None,
    ) -> dict | None:
        """One choice (or chunk choice); `first`: the choice's first appearance (echo)."""
        index = prompt_index * req.params.n + completion.index
        text, token_ids = completion.text, completion.token_ids
        positions = completion.logprobs
        if first and req.echo:
            text = self._prompt_text(out) + text
            if positions is not None:
                token_ids = out.prompt_token_ids + token_ids
                positions = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
                positions += completion.logprobs
        if not (text or token_ids or completion.finish_reason):
            return None
        logprobs = None
        if positions is not None:
            builders = {} if builders is None else builders
            if index not in builders:
                builders[index] = CompletionLogprobsBuilder(self.llm.tokenizer, req.params.logprobs)
            logprobs = builders[index].build(token_ids, positions)
        return completion_choice(
            index, text, logprobs, completion.finish_reason, completion.stop_reason
        )

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _completion_chunks(self, req: CompletionRequest, counter: ChoiceCounter):
        """The streamed choices of each output of a completions request."""
        builders: dict[int, CompletionLogprobsBuilder] = {}
        prompts_seen: set[int] = set()
        choices_seen: set[tuple[int, int]] = set()

        def choices_of(i: int, out: RequestOutput) -> list[dict]:
            if i not in prompts_seen:
                prompts_seen.add(i)
                counter.prompt_tokens += len(out.prompt_token_ids)
            choices = []
            for completion in out.outputs:
                counter.add(completion)
                if not (completion.token_ids or completion.finish_reason):
                    continue  # prompt-logprob progress only: the prompt is not done yet
                first = (i, completion.index) not in choices_seen
                choices_seen.add((i, completion.index))
                choice = self._completion_choice(req, i, out, completion, first, builders)
                if choice is not None:
                    choices.append(choice)
            return choices

        return choices_of

    # ---- chat ------------------------------------------------------------------------

    async def chat(self, http: web.Request, req: ChatRequest) -> web.StreamResponse:
        header = ResponseHeader(new_id("chatcmpl"), self.model_name)
        prompt = await self.chat_prompt(req.messages, req.tools.tools if req.tools else None)
        if req.cache_salt is not None:
            prompt.cache_salt = cache_salt_of(req.cache_salt)
        merged = MergedGenerations(self.llm, [prompt], req.params, header.response_id)
        counter = ChoiceCounter(self.metrics, req.params.n)
        rename = {"prompt": "messages"}
        try:
            if req.stream:
                stream = _Stream(
                    "chat.completion.chunk",
                    req.include_usage,
                    rename,
                    self.limits.stream_write_timeout_s,
                )
                opening = [
                    chat_chunk_choice(j, {"role": "assistant", "content": ""})
                    for j in range(req.params.n)
                ]
                choices_of = self._chat_chunks(req, counter)
                return await stream.run(http, header, merged, counter, choices_of, opening)
            (out,) = await collect_finals(merged, rename)
            counter.prompt_tokens = len(out.prompt_token_ids)
            choices = []
            for completion in out.outputs:
                counter.add(completion)
                message, finish_reason = self.parsing.choice(req.tools).final(
                    completion.text, completion.finish_reason
                )
                choices.append(
                    chat_choice(
                        completion.index,
                        message,
                        self._chat_logprobs(req, completion),
                        finish_reason,
                        completion.stop_reason,
                    )
                )
            return web.json_response(header.wrap("chat.completion", choices, usage=counter.usage()))
        finally:
            counter.close()
            await merged.close()

    async def chat_prompt(self, messages: list[Any], tools=None) -> ProcessedPrompt:
        """Rendered and tokenized on a worker thread: never on the event loop. Its images
        (a model that takes them) are read, decoded and preprocessed on the front end's media
        pool (--media-loading-threads) meanwhile; any refusal, a bad image's too, is a 400."""
        loop = asyncio.get_running_loop()
        render = functools.partial(self.llm.front_end.chat_prompt, messages, tools=tools)
        try:
            return await loop.run_in_executor(None, render)
        except ValueError as exc:
            raise ApiError(str(exc), param="messages") from exc

    def _chat_logprobs(self, req: ChatRequest, completion: CompletionOutput) -> dict | None:
        if not req.want_logprobs or completion.logprobs is None:
            return None
        return chat_logprobs(
            completion.token_ids, completion.logprobs, self.llm.tokenizer, req.params.logprobs
        )

    def _chat_chunks(self, req: ChatRequest, counter: ChoiceCounter):
        """The streamed choices of each output of a chat request."""

        parsers: dict[int, ChoiceOutput] = {}

        def choices_of(_: int, out: RequestOutput) -> list[dict]:
            counter.prompt_tokens = len(out.prompt_token_ids)
            choices = []
            for completion in out.outputs:
                counter.add(completion)
                if not (completion.text or completion.token_ids or completion.finish_reason):
                    continue
                parser = parsers.get(completion.index)
                if parser is None:
                    parser = parsers[completion.index] = self.parsing.choice(req.tools)
                delta = parser.feed(completion.text) if completion.text else {}
                finish_reason = completion.finish_reason
                if finish_reason is not None:
                    rest, finish_reason = parser.finish(finish_reason)
                    _merge_delta(delta, rest)
                logprobs = self._chat_logprobs(req, completion)
                if not delta and finish_reason is None and logprobs is None:
                    continue  # held back (a tool-call marker, a partial name)
                choices.append(chat_chunk_choice(completion.index, delta, logprobs, finish_reason))
            return choices

        return choices_of


def _merge_delta(delta: dict, rest: dict) -> None:
    """`rest` (what a choice's end flushes) added to the delta of its last output."""
    for key, value in rest.items():
        if key == "tool_calls":
            delta.setdefault("tool_calls", []).extend(value)
        else:
            delta[key] = delta.get(key, "") + value


@dataclass
class _Stream:
    """The one SSE loop of both endpoints: wait for admission (a prompt over the context is
    still a 400), open the stream, send the opening chunks, then one chunk per output that
    has choices, then the usage chunk if asked; a client that leaves ends it (closing the
    requests aborts them), any other error after the 200 is reported in-band."""

    obj: str
    include_usage: bool
    rename: dict[str, str]
    write_timeout_s: float | None = None

    async def run(
        self, http, header: ResponseHeader, merged, counter, choices_of, opening=()
    ) -> web.StreamResponse:
        await admit(merged, self.rename)
        sse = SseStream(http, self.write_timeout_s)
        await sse.open()
        extra = {"usage": None} if self.include_usage else {}
        try:
            if opening:
                await sse.send(header.wrap(self.obj, list(opening), **extra))
            async for i, out in merged.outputs():
                choices = choices_of(i, out)
                if choices:
                    await sse.send(header.wrap(self.obj, choices, **extra))
            if self.include_usage:
                await sse.send(header.wrap(self.obj, [], usage=counter.usage()))
        except ConnectionError:  # the client is gone (reset, or aiohttp's "Connection lost")
            return sse.response
        except ValueError as exc:  # refused once streaming (a later prompt of several)
            await sse.close(invalid_value(exc, self.rename).body())
        except Exception as exc:
            await sse.close(to_api_error(exc).body())
        else:
            await sse.close()
        return sse.response


async def admit(merged: MergedGenerations, rename: dict[str, str]) -> None:
    try:
        await merged.wait_admitted()
    except ValueError as exc:
        raise invalid_value(exc, rename) from exc


async def collect_finals(merged: MergedGenerations, rename: dict[str, str]) -> list[RequestOutput]:
    """The final output of every prompt, in prompt order."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, out in merged.outputs():
            finals[index] = out
    except ValueError as exc:
        raise invalid_value(exc, rename) from exc
    return [finals[i] for i in range(merged.num_prompts)]
