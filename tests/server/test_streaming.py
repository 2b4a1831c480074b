"""server/streaming.py: the end of a stream whose connection is closing."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from ringllm.server.streaming import SseStream


def test_ending_a_stream_on_a_closing_connection_raises_nothing():
    """A server that stops closes its connections; a stream whose client read nothing
    still has bytes buffered, so its handler is not cancelled and its last writes (the
    error event, [DONE]) meet a closing transport. Ending the stream must raise nothing:
    before, each such stream logged an "Error handling request" traceback."""
    outcome: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        sse = SseStream(request, write_timeout_s=5)
        await sse.open()
        await sse.send({"n": 0})
        request.transport.close()  # what the server's stop does to every connection
        try:
            await sse.close({"error": {"message": "the server is stopping"}})
            outcome.append("ended")
        except Exception as exc:  # noqa: BLE001 - the test reports which
            outcome.append(repr(exc))
        return sse.response

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/", handler)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            async with session.get(server.make_url("/")) as response:
                try:
                    await response.read()
                except aiohttp.ClientError:
                    pass  # the connection was closed under it

    asyncio.run(run())
    assert outcome == ["ended"]
