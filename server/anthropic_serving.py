"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the engine.

The request is the chat endpoint's (server/anthropic_protocol.py translates it), and so is
the way to the engine; what differs is the answer's shape:

    message   {"id": "msg_...", "type": "message", "role": "assistant", "model",
               "content": [text block, tool_use blocks...], "stop_reason", "stop_sequence",
               "usage": {"input_tokens", "output_tokens"}}
    stream    message_start, then per block content_block_start, its deltas (text_delta,
              or input_json_delta for a tool call's arguments), content_block_stop; then
              message_delta (stop_reason, stop_sequence, usage.output_tokens), message_stop.
              Every event is named (`event: ...`); a failure once streaming is `event: error`.

stop_reason: "end_turn" (the model's end), "stop_sequence" (one of stop_sequences, named in
stop_sequence), "max_tokens", "tool_use" (the answer ends in tool calls). Tool calls are the
chat endpoint's (server/chat_outputs.py: the grammar for `any` / a named tool, the server's
tool-call parser for `auto`), their ids `toolu_` where the chat endpoint's are `call_`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from ringllm.pipeline.outputs import CompletionOutput
from ringllm.server.anthropic_protocol import MessagesRequest
from ringllm.server.engine_requests import MergedGenerations
from ringllm.server.errors import anthropic_error_body, to_api_error
from ringllm.server.serving import ChoiceCounter, Serving, admit, collect_finals
from ringllm.server.streaming import SseStream

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


async def create_message(serving: Serving, http: web.Request, req: MessagesRequest):
    chat = req.chat
    prompt = await serving.chat_prompt(chat.messages, chat.tools.tools if chat.tools else None)
    message_id = "msg_" + uuid.uuid4().hex
    merged = MergedGenerations(serving.llm, [prompt], chat.params, message_id)
    counter = ChoiceCounter(serving.metrics, 1)
    counter.prompt_tokens = len(prompt.token_ids)
    head = {"id": message_id, "type": "message", "role": "assistant", "model": serving.model_name}
    try:
        if chat.stream:
            return await _stream(serving, http, req, merged, counter, head)
        (out,) = await collect_finals(merged, {})
        completion = out.outputs[0]
        counter.add(completion)
        message, finish = serving.parsing.choice(chat.tools).final(
            completion.text, completion.finish_reason
        )
        stop_reason, stop_sequence = _stop(finish, completion, req.stop_sequences)
        return web.json_response(
            {
                **head,
                "content": _blocks(message),
                "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": _usage(counter),
            }
        )
    finally:
        counter.close()
        await merged.close()


async def count_tokens(serving: Serving, req: MessagesRequest) -> web.Response:
    """{"input_tokens": N}: the prompt the same request would run, rendered and counted."""
    chat = req.chat
    prompt = await serving.chat_prompt(chat.messages, chat.tools.tools if chat.tools else None)
    return web.json_response({"input_tokens": len(prompt.token_ids)})


def _usage(counter: ChoiceCounter) -> dict[str, int]:
    return {"input_tokens": counter.prompt_tokens, "output_tokens": counter.completion_tokens}


def _stop(
    finish: str | None, completion: CompletionOutput, stop_sequences: list[str]
) -> tuple[str | None, str | None]:
    if finish == "stop" and completion.stop_reason in stop_sequences:
        return "stop_sequence", completion.stop_reason
    if finish is None:
        return None, None
    return _STOP_REASONS.get(finish, "end_turn"), None


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message (content, tool_calls) as Messages content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": _tool_use_id(call["id"]),
                "name": function["name"],
                "input": json.loads(function["arguments"] or "{}"),
            }
        )
    return blocks


class _BlockEvents:
    """A stream's chat deltas (content text, tool-call pieces) as content block events:
    one text block while text comes, one tool_use block per call, each closed before the
    next one opens."""

    def __init__(self) -> None:
        self.index = -1
        self.open: object = None  # "text", or ("tool", the call's index); None: none open
        self.events: list[tuple[str, dict]] = []

    def take(self, delta: dict[str, Any]) -> list[tuple[str, dict]]:
        if delta.get("content"):
            if self.open != "text":
                self._start({"type": "text", "text": ""}, "text")
            self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if self.open != ("tool", call["index"]):
                block = {"type": "tool_use", "id": _tool_use_id(call["id"]), "input": {}}
                self._start({**block, "name": function["name"]}, ("tool", call["index"]))
            if function.get("arguments"):
                self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
        events, self.events = self.events, []
        return events

    def finish(self) -> list[tuple[str, dict]]:
        self._stop()
        events, self.events = self.events, []
        return events

    def _start(self, block: dict, kind: object) -> None:
        self._stop()
        self.index += 1
        self.open = kind
        event = {"type": "content_block_start", "index": self.index, "content_block": block}
        self.events.append(("content_block_start", event))

    def _delta(self, delta: dict) -> None:
        event = {"type": "content_block_delta", "index": self.index, "delta": delta}
        self.events.append(("content_block_delta", event))

    def _stop(self) -> None:
        if self.open is not None:
            event = {"type": "content_block_stop", "index": self.index}
            self.events.append(("content_block_stop", event))
            self.open = None


async def _stream(serving: Serving, http, req: MessagesRequest, merged, counter, head):
    await admit(merged, {})  # a prompt over the context is still a 400
    sse = SseStream(http, serving.limits.stream_write_timeout_s, named_events=True)
    await sse.open()
    start = {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": counter.prompt_tokens, "output_tokens": 0},
    }  # fmt: skip
    parser, blocks = serving.parsing.choice(req.chat.tools), _BlockEvents()
    try:
        await sse.send({"type": "message_start", "message": start}, "message_start")
        async for _, out in merged.outputs():
            completion = out.outputs[0]
            counter.add(completion)
            delta = parser.feed(completion.text) if completion.text else {}
            finish = completion.finish_reason
            if finish is not None:
                rest, finish = parser.finish(finish)
                events = blocks.take(delta) + blocks.take(rest) + blocks.finish()
            else:
                events = blocks.take(delta)
            for name, event in events:
                await sse.send(event, name)
            if finish is not None:
                stop_reason, stop_sequence = _stop(finish, completion, req.stop_sequences)
                end = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
                usage = {"output_tokens": counter.completion_tokens}
                await sse.send(
                    {"type": "message_delta", "delta": end, "usage": usage}, "message_delta"
                )
                await sse.send({"type": "message_stop"}, "message_stop")
    except ConnectionError:  # the client is gone
        return sse.response
    except Exception as exc:
        await sse.close(anthropic_error_body(to_api_error(exc)))
    else:
        await sse.close()
    return sse.response
