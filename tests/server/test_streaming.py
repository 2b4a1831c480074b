"""server/streaming.py: the end of a stream whose connection is closing, or whose client reads
nothing."""

from __future__ import annotations

import asyncio
import socket
import time

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


def test_ending_a_stream_nobody_reads_is_bounded_by_the_write_timeout():
    """aiohttp waits for the socket only every 64 KiB written, so a stream can end (its
    requests dropped for a reader that fell behind, say) while its transport is paused over
    bytes the client never takes. Ending it then waited in write_eof for as long as the
    client kept its socket open: the handler never returned and never counted its choices
    as aborted. It is bounded by the write timeout, and the connection is dropped."""
    outcome: list[str] = []
    took: list[float] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        request.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
        )
        request.transport.set_write_buffer_limits(high=1024)
        sse = SseStream(request, write_timeout_s=0.5)
        await sse.open()
        # more than both sockets hold, less than aiohttp writes before it waits: the
        # transport pauses, the write returns
        await sse.send({"text": "x" * 60_000})
        assert request.protocol._paused  # the state a stream can end in between writes
        start = time.monotonic()
        try:
            await sse.close({"error": {"message": "dropped"}})
            outcome.append("ended")
        except Exception as exc:  # noqa: BLE001 - the test reports which
            outcome.append(repr(exc))
        took.append(time.monotonic() - start)
        transport = request.transport
        outcome.append("dropped" if transport is None or transport.is_closing() else "open")
        return sse.response

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/", handler)
        async with TestServer(app) as server:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, (server.host, server.port))
            await loop.sock_sendall(sock, f"GET / HTTP/1.1\r\nHost: {server.host}\r\n\r\n".encode())
            try:  # reads nothing, keeps its socket open until the handler is done
                for _ in range(100):
                    if len(outcome) == 2:
                        break
                    await asyncio.sleep(0.05)
            finally:
                sock.close()

    asyncio.run(run())
    assert outcome == ["ended", "dropped"]
    assert took[0] < 3
