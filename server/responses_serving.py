"""POST /v1/responses and the stored responses' routes: OpenAI's Responses API on the engine.

The request is the chat endpoint's (server/responses_protocol.py translates it), and so is
the way to the engine and the reading of its text (server/chat_outputs.py: reasoning, tool
calls); what differs is the answer's shape:

    response   {"id": "resp_...", "object": "response", "status", "output": [items],
                "usage": {"input_tokens", "output_tokens", "total_tokens", ...}, and the
                request's settings echoed (instructions, tools, text, temperature, ...)}
    output     a reasoning item (with a reasoning parser), then a message item (one
               output_text part), then one function_call item per tool call
    stream     response.created, response.in_progress; per item output_item.added, its
               content_part.added, deltas (output_text / reasoning_text /
               function_call_arguments), their .done, content_part.done, output_item.done;
               then response.completed (or .incomplete, or an error event and
               response.failed). Every event is named and numbered (sequence_number from 0).

status: "completed"; "incomplete" with incomplete_details.reason "max_output_tokens" when
the budget ran out; "failed" with `error` when the engine failed; a background response
is "queued" until its generation runs, "in_progress" meanwhile, "cancelled" when cancelled.

Stored responses (store: true, the default) go to the bounded store
(server/responses_store.py) as they start: GET /v1/responses/{id} reads one,
GET .../input_items lists its input, DELETE forgets it, POST .../cancel stops a background
one. A background response (background: true) runs on its own task; the request answers at
once (or streams, if asked), and GET with stream=true and starting_after=N replays its
events and follows it to the end. A foreground response whose client leaves is aborted
(its engine request with it) and stored as "cancelled".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web

from ringllm.pipeline.frontend.input_processor import ProcessedPrompt
from ringllm.server.engine_requests import MergedGenerations
from ringllm.server.errors import (
    NOT_FOUND,
    ApiError,
    busy_error,
    invalid_value,
    to_api_error,
)
from ringllm.server.responses import chat_logprobs
from ringllm.server.responses_protocol import RENAME, ResponsesRequest
from ringllm.server.responses_store import ResponseStore, StoredResponse
from ringllm.server.serving import ChoiceCounter, Serving, admit
from ringllm.server.streaming import SseStream

Emit = Callable[[dict[str, Any]], Awaitable[None]]
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as stored and listed: each with an id (its own, or a new one), a
    message's text content as a list of parts (as OpenAI lists them)."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        item = {"id": new_id(_ITEM_PREFIX.get(kind, "item")), **item, "type": kind}
        if kind == "message" and isinstance(item["content"], str):
            if item["role"] == "assistant":
                part = {"type": "output_text", "text": item["content"], "annotations": []}
            else:
                part = {"type": "input_text", "text": item["content"]}
            item["content"] = [part]
            item.setdefault("status", "completed")
        out.append(item)
    return out


# ---- creating a response ----------------------------------------------------------------


async def create_response(
    serving: Serving,
    http: web.Request,
    req: ResponsesRequest,
    store: ResponseStore,
    history: list[dict[str, Any]],
) -> web.StreamResponse:
    if req.background and len(store.running()) >= serving.limits.max_concurrent_requests:
        # nothing else bounds them: no connection waits for a background response
        raise busy_error(
            f"{serving.limits.max_concurrent_requests} background responses are running "
            "(--max-concurrent-requests); try again when one has ended"
        )
    prompt = await _prompt(serving, req)
    run = _Run(serving, req, prompt)
    chat = req.chat
    stored = None
    if req.store:
        stored = StoredResponse(run.response, history, with_ids(req.input_items))
        store.put(stored)
    if req.background:
        run.response["status"] = "queued"
        stored.task = asyncio.get_running_loop().create_task(run.background(stored, store))
        if chat.stream:
            return await follow(http, serving, stored, -1)
        return web.json_response(run.response)
    try:
        if chat.stream:
            return await run.stream(http)
        return web.json_response(await run.whole())
    except ApiError as exc:
        if stored is not None and exc.status < HTTPStatus.INTERNAL_SERVER_ERROR:
            store.delete(run.response["id"])  # refused as asked (a prompt too long): no response
            stored = None
        raise
    finally:
        if stored is not None:
            if run.response["status"] == "in_progress":  # the client left, or a failure
                run.response["status"] = "cancelled" if run.client_gone else "failed"
            store.put(stored)


async def _prompt(serving: Serving, req: ResponsesRequest) -> ProcessedPrompt:
    """The rendered conversation; with truncation "auto", its oldest turns dropped (the
    system messages and the last turn always kept) until it leaves room for
    max_output_tokens in the context, as OpenAI's API does. Without it, a conversation
    over the context is the engine's 400."""
    chat = req.chat
    tools = chat.tools.tools if chat.tools else None
    messages = chat.messages
    prompt = await serving.chat_prompt(messages, tools)
    if req.body.get("truncation") != "auto":
        return prompt
    budget = serving.llm.max_model_len - (chat.params.max_tokens or 1)
    while len(prompt.token_ids) > budget:
        messages = drop_oldest_turn(messages)
        if messages is None:
            break
        prompt = await serving.chat_prompt(messages, tools)
    return prompt


def drop_oldest_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages without their first non-system one and the tool results right after it
    (a template takes no result without its call); None when only one is left."""
    turns = [i for i, m in enumerate(messages) if m.get("role") != "system"]
    if len(turns) <= 1:
        return None
    first = turns[0]
    end = first + 1
    while end < len(messages) - 1 and messages[end].get("role") == "tool":
        end += 1
    return messages[:first] + messages[end:]


class _Run:
    """One response's generation: the engine request, the output items, the events."""

    def __init__(self, serving: Serving, req: ResponsesRequest, prompt: ProcessedPrompt):
        self.serving = serving
        self.req = req
        self.prompt = prompt
        self.response = response_object(serving, req, new_id("resp"), "in_progress")
        self.counter = ChoiceCounter(serving.metrics, 1)
        self.counter.prompt_tokens = len(prompt.token_ids)
        self.items = _OutputItems(serving.parsing.choice(req.chat.tools))
        self.sequence = 0
        self.client_gone = False

    def _merged(self) -> MergedGenerations:
        chat = self.req.chat
        return MergedGenerations(self.serving.llm, [self.prompt], chat.params, self.response["id"])

    async def whole(self) -> dict[str, Any]:
        merged = self._merged()
        try:
            await self._generate(merged, None)
        finally:
            self.counter.close()
            await merged.close()
        return self.response

    async def stream(self, http: web.Request) -> web.StreamResponse:
        merged = self._merged()
        try:
            await admit(merged, RENAME)  # a prompt over the context is still a 400
            sse = SseStream(http, self.serving.limits.stream_write_timeout_s, named_events=True)
            await sse.open()

            async def emit(event: dict[str, Any]) -> None:
                await sse.send(event, event["type"])

            try:
                await self._generate(merged, emit)
            except ConnectionError:  # the client is gone: the engine request is aborted
                self.client_gone = True
                return sse.response
            except Exception as exc:
                await self._fail(exc, emit)
            await sse.close()
            return sse.response
        finally:
            self.counter.close()
            await merged.close()

    async def background(self, stored: StoredResponse, store: ResponseStore) -> None:
        """The task of a background response: events kept for whoever follows it."""

        async def emit(event: dict[str, Any]) -> None:
            stored.add_event(event)

        merged = self._merged()
        try:
            self.response["status"] = "in_progress"
            await self._generate(merged, emit)
        except asyncio.CancelledError:
            self.response["status"] = "cancelled"
        except Exception as exc:
            await self._fail(exc, emit)
        finally:
            self.counter.close()
            await merged.close()
            stored.task = None
            stored.changed.set()
            if store.get(self.response["id"]) is stored:  # not deleted meanwhile
                store.put(stored)  # counted again, output and events in

    async def _send(self, emit: Emit | None, event: dict[str, Any]) -> None:
        if emit is not None:
            event["sequence_number"] = self.sequence
            self.sequence += 1
            await emit(event)

    async def _generate(self, merged: MergedGenerations, emit: Emit | None) -> None:
        response = self.response
        if emit is not None:
            await self._send(emit, {"type": "response.created", "response": _copy(response)})
            await self._send(emit, {"type": "response.in_progress", "response": _copy(response)})
        finish = None
        try:
            async for _, out in merged.outputs():
                completion = out.outputs[0]
                self.counter.add(completion)
                logprobs = self._logprobs(completion)
                events = self.items.take(completion.text, logprobs)
                if completion.finish_reason is not None:
                    events += self.items.finish(completion.finish_reason)
                    finish = completion.finish_reason
                    response["usage"] = self._usage(out.num_cached_tokens)
                for event in events:
                    await self._send(emit, event)
        except ValueError as exc:  # refused by the engine (the prompt), as the chat's are
            raise invalid_value(exc, RENAME) from exc
        response["output"] = self.items.output
        response["completed_at"] = int(time.time())
        if finish == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"
        kind = "response.completed" if finish != "length" else "response.incomplete"
        await self._send(emit, {"type": kind, "response": _copy(response)})

    async def _fail(self, exc: BaseException, emit: Emit) -> None:
        error = to_api_error(exc)
        self.response["status"] = "failed"
        self.response["error"] = {"code": "server_error", "message": error.message}
        self.response["output"] = self.items.output
        with contextlib.suppress(ConnectionError):
            await self._send(
                emit,
                {
                    "type": "error",
                    "code": error.code or error.error_type,
                    "message": error.message,
                    "param": error.param,
                },
            )
            await self._send(emit, {"type": "response.failed", "response": _copy(self.response)})

    def _logprobs(self, completion) -> list[dict[str, Any]] | None:
        if not self.req.want_logprobs or completion.logprobs is None:
            return None
        tokenizer = self.serving.llm.tokenizer
        num_top = self.req.chat.params.logprobs or 0
        return chat_logprobs(completion.token_ids, completion.logprobs, tokenizer, num_top)[
            "content"
        ]

    def _usage(self, cached: int) -> dict[str, Any]:
        counter = self.counter
        reasoning = self.items.reasoning_text
        reasoning_tokens = 0
        if reasoning:  # the tokenizer's count of the thinking, within the output's
            tokens = self.serving.llm.tokenizer.encode(reasoning, add_special_tokens=False)
            reasoning_tokens = min(len(tokens), counter.completion_tokens)
        return {
            "input_tokens": counter.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": counter.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": counter.prompt_tokens + counter.completion_tokens,
        }


def response_object(
    serving: Serving, req: ResponsesRequest, response_id: str, status: str
) -> dict[str, Any]:
    body, params = req.body, req.chat.params
    reasoning = body.get("reasoning") or {}
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "background": req.background,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "model": serving.model_name,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": req.store,
        "temperature": params.temperature,
        "text": {"format": fmt},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []),
        "top_logprobs": body.get("top_logprobs", 0),
        "top_p": params.top_p,
        "truncation": body.get("truncation", "disabled"),
        "usage": None,
        "user": body.get("user"),
        "metadata": body.get("metadata", {}),
    }


def _copy(response: dict[str, Any]) -> dict[str, Any]:
    return {**response, "output": list(response["output"])}


class _OutputItems:
    """A choice's text, piece by piece, as output items and the events that build them:
    the chat parser's deltas (reasoning_content, content, tool_calls) each go to their own
    item, one open at a time, each closed (its .done events) before the next opens."""

    def __init__(self, parser) -> None:
        self.parser = parser
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.open_key: object = None  # "reasoning", "message" or ("call", index)
        self.events: list[dict[str, Any]] = []
        self.pending_logprobs: list[dict[str, Any]] = []
        self.reasoning_text = ""

    def take(self, text: str, logprobs: list | None = None) -> list[dict[str, Any]]:
        if logprobs:
            self.pending_logprobs += logprobs
        if text:
            self._delta(self.parser.feed(text))
        return self._flush()

    def finish(self, finish_reason: str) -> list[dict[str, Any]]:
        rest, _ = self.parser.finish(finish_reason)
        self._delta(rest)
        self._close("incomplete" if finish_reason == "length" else "completed")
        return self._flush()

    def _flush(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def _delta(self, delta: dict[str, Any]) -> None:
        if delta.get("reasoning_content"):
            self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            self._text(delta["content"])
        for call in delta.get("tool_calls") or ():
            self._call(call)

    def _start(self, item: dict[str, Any], key: object, part: dict[str, Any] | None) -> None:
        self._close("completed")
        self.output.append(item)
        self.open, self.open_key = item, key
        index = len(self.output) - 1
        self._event("response.output_item.added", output_index=index, item=_in_progress(item))
        if part is not None:
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            )
            item["content"].append(part)

    def _reasoning(self, text: str) -> None:
        if self.open_key != "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            self._start(item, "reasoning", {"type": "reasoning_text", "text": ""})
        self.open["content"][0]["text"] += text
        self.reasoning_text += text
        self._event("response.reasoning_text.delta", **self._where(), delta=text)

    def _text(self, text: str) -> None:
        if self.open_key != "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._start(item, "message", part)
        part = self.open["content"][0]
        part["text"] += text
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        part["logprobs"] += logprobs
        self._event("response.output_text.delta", **self._where(), delta=text, logprobs=logprobs)

    def _call(self, call: dict[str, Any]) -> None:
        function = call.get("function") or {}
        key = ("call", call["index"])
        if self.open_key != key:
            item = {
                "id": new_id("fc"),
                "type": "function_call",
                "call_id": call.get("id") or new_id("call"),
                "name": function.get("name", ""),
                "arguments": "",
            }
            self._start(item, key, None)
        arguments = function.get("arguments") or ""
        if arguments:
            self.open["arguments"] += arguments
            index = len(self.output) - 1
            self._event(
                "response.function_call_arguments.delta",
                item_id=self.open["id"],
                output_index=index,
                delta=arguments,
            )

    def _where(self) -> dict[str, Any]:
        return {
            "item_id": self.open["id"],
            "output_index": len(self.output) - 1,
            "content_index": 0,
        }

    def _close(self, status: str) -> None:
        item, self.open, key = self.open, None, self.open_key
        self.open_key = None
        if item is None:
            return
        index = len(self.output) - 1
        item["status"] = status
        if key == "message" or key == "reasoning":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if key == "message":
                part["logprobs"] += self.pending_logprobs
                self.pending_logprobs = []
                done = {"text": part["text"], "logprobs": part["logprobs"]}
                self._event("response.output_text.done", **where, **done)
            else:
                self._event("response.reasoning_text.done", **where, text=part["text"])
            self._event("response.content_part.done", **where, part=dict(part))
        else:
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            )
        self._event("response.output_item.done", output_index=index, item=_snapshot(item))

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, **fields})


def _in_progress(item: dict[str, Any]) -> dict[str, Any]:
    out = {**item, "status": "in_progress"}
    if "content" in out:
        out["content"] = []
    return out


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
    return out


# ---- stored responses -----------------------------------------------------------------


def stored_or_404(store: ResponseStore, response_id: str) -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        raise ApiError(
            f"response {response_id!r} is not stored here (never stored, deleted, or evicted "
            "from the store: --max-stored-responses)",
            status=HTTPStatus.NOT_FOUND,
            error_type=NOT_FOUND,
            code="response_not_found",
        )
    return stored


async def follow(
    http: web.Request, serving: Serving, stored: StoredResponse, starting_after: int
) -> web.StreamResponse:
    """A background response's events after `starting_after` as a stream, up to its end."""
    sse = SseStream(http, serving.limits.stream_write_timeout_s, named_events=True)
    await sse.open()
    sent = starting_after + 1
    try:
        while True:
            changed = stored.changed
            while sent < len(stored.events):
                event = stored.events[sent]
                await sse.send(event, event["type"])
                sent += 1
            if not stored.running:
                break
            await changed.wait()
    except ConnectionError:  # the client left; the response runs on
        return sse.response
    await sse.close()
    return sse.response


async def cancel(store: ResponseStore, response_id: str) -> dict[str, Any]:
    """Stops a background response (its engine request aborted); a cancelled one again is
    answered as it is (OpenAI's: idempotent)."""
    stored = stored_or_404(store, response_id)
    response = stored.response
    if not response["background"]:
        raise ApiError(
            "only a background response (background: true) can be cancelled",
            param="response_id",
        )
    if stored.running:
        task = stored.task
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if response["status"] in ("queued", "in_progress"):  # cancelled before it began
            response["status"] = "cancelled"
            stored.task = None
            stored.changed.set()
    elif response["status"] not in ("cancelled",):
        raise ApiError(
            f"response {response_id!r} has already ended ({response['status']}); only a "
            "queued or in-progress response can be cancelled",
            param="response_id",
        )
    return response


def input_items_page(stored: StoredResponse, query) -> dict[str, Any]:
    """OpenAI's list shape; `order` (desc by default), `limit` (1-100, 20), `after`."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError('order: must be "asc" or "desc"', param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError("limit: must be an integer from 1 to 100", param="limit")
    items = list(stored.input_items)
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise ApiError(f"after: {after!r} is not an item of this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
