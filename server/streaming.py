"""Server-sent events: how a streamed response goes out on the wire.

    HTTP/1.1 200, Content-Type: text/event-stream
    data: {json chunk}\n\n        one per chunk, flushed as it is written
    data: [DONE]\n\n              the end, as OpenAI's API sends it

A failure after the stream has started cannot change the status code any more, so it is
sent as one `data: {"error": {...}}` event (OpenAI's error body) followed by [DONE];
the official clients raise it as an API error. Anthropic's streams (`named_events`) name
each event (`event: message_start` before its `data:` line), end after `message_stop`
with no [DONE], and report a failure as an `event: error` with Anthropic's error body.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

DONE_EVENT = b"data: [DONE]\n\n"


class SlowClientError(ConnectionResetError):
    """The client took no byte of its stream for `write_timeout_s`: treated as gone."""


class SseStream:
    """`write_timeout_s`: a write that cannot hand its bytes to the socket for this long
    (the client stopped reading: full socket buffer, zero window) drops the connection and
    raises SlowClientError, so the handler's clean-up aborts its requests."""

    def __init__(
        self,
        request: web.Request,
        write_timeout_s: float | None = None,
        named_events: bool = False,
    ) -> None:
        self.request = request
        self.write_timeout_s = write_timeout_s
        self.named_events = named_events
        self.response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "Connection": "keep-alive",
            }
        )

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: dict, event: str | None = None) -> None:
        """Writes one event (`event`: its name line, as Anthropic's streams name every
        event); raises ConnectionResetError when the client has gone."""
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        named = b"" if event is None else b"event: " + event.encode() + b"\n"
        await self._write(named + b"data: " + data.encode("utf-8") + b"\n\n")

    async def close(self, error: dict | None = None) -> None:
        """Ends the stream: the `error` event if one is given, then OpenAI's [DONE] (an
        Anthropic stream, `named_events`, has none: its error event is named "error"). A
        client that has gone meanwhile (or a server stopping under it) has nobody left to
        tell."""
        try:
            if error is not None:
                await self.send(error, "error" if self.named_events else None)
            if not self.named_events:
                await self._write(DONE_EVENT)
            # write_eof waits for the socket to take what is buffered: a client that reads
            # nothing would hold the handler (and its count of aborted choices) forever
            await self._bounded(self.response.write_eof())
        except ConnectionError:
            pass

    async def _write(self, data: bytes) -> None:
        await self._bounded(self.response.write(data))

    async def _bounded(self, write) -> None:
        """Awaits `write` for at most write_timeout_s, then drops the connection."""
        try:
            await asyncio.wait_for(write, self.write_timeout_s)
        except TimeoutError:
            transport = self.request.transport
            if transport is not None:
                transport.abort()  # drop what it did not take: memory stays bounded
            raise SlowClientError(
                f"the client read nothing for {self.write_timeout_s} s; dropped"
            ) from None
