"""Server-sent events: how a streamed response goes out on the wire.

    HTTP/1.1 200, Content-Type: text/event-stream
    data: {json chunk}\n\n        one per chunk, flushed as it is written
    data: [DONE]\n\n              the end, as OpenAI's API sends it

A failure after the stream has started cannot change the status code any more, so it is
sent as one `data: {"error": {...}}` event (OpenAI's error body) followed by [DONE];
the official clients raise it as an API error.
"""

from __future__ import annotations

import json

from aiohttp import web

DONE_EVENT = b"data: [DONE]\n\n"


class SseStream:
    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "Connection": "keep-alive",
            }
        )

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: dict) -> None:
        """Writes one event; raises ConnectionResetError when the client has gone."""
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(b"data: " + data.encode("utf-8") + b"\n\n")

    async def close(self) -> None:
        await self.response.write(DONE_EVENT)
        await self.response.write_eof()
