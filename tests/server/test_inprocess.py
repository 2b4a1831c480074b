"""The app in this process (aiohttp's TestServer) over an AsyncLLM whose core we can reach:
a core that fails mid-request, and client disconnects seen from inside the engine core."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.frontend.async_llm import AsyncLLM
from ringllm.server.app import create_app

WAIT_S = 60


@pytest.fixture(scope="module")
def config(model_factory):
    return EngineConfig.from_kwargs(
        model=str(model_factory("llama")),
        dtype="float32",
        max_model_len=1024,
        num_gpu_blocks_override=256,
    )


def run_with_app(config, scenario):
    async def main():
        llm = AsyncLLM.from_config(config, multiprocess=False)
        try:
            async with TestClient(TestServer(create_app(llm, "tiny"))) as client:
                await scenario(llm, client)
        finally:
            llm.shutdown()

    asyncio.run(main())


async def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def read_events(response, count: int | None = None) -> list:
    """SSE events of a streamed response (all of them, or the first `count`)."""
    events = []
    async for line in response.content:
        if line.startswith(b"data: "):
            data = line[len(b"data: ") :].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            if count is not None and len(events) == count:
                break
    return events


def long_request(stream: bool) -> dict:
    return {"prompt": "def main():", "max_tokens": 900, "ignore_eos": True, "stream": stream}


def test_engine_core_failure_fails_in_flight_and_new_requests(config):
    async def scenario(llm, client):
        ok = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.status == 200
        started = await client.post("/v1/completions", json=long_request(stream=True))
        assert started.status == 200
        assert len(await read_events(started, count=2)) == 2

        entered, release = threading.Event(), threading.Event()

        def failing_step():  # the core's next step blocks, then fails
            entered.set()
            release.wait(WAIT_S)
            raise RuntimeError("injected core failure")

        llm.client.core.step = failing_step
        blocking = asyncio.ensure_future(client.post("/v1/completions", json=long_request(False)))
        not_started = asyncio.ensure_future(client.post("/v1/completions", json=long_request(True)))
        await asyncio.to_thread(entered.wait, WAIT_S)
        await wait_until(lambda: llm.num_unfinished_requests == 3, "3 requests in flight")
        assert (await client.get("/health")).status == 200
        release.set()

        for response in (await blocking, await not_started):
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "engine_dead"
        rest = await read_events(started)
        assert rest[-1] == "[DONE]"
        assert rest[-2]["error"]["code"] == "engine_dead"
        # what failed stays in the server's log: the client is told only that it did
        assert (
            rest[-2]["error"]["message"]
            == "the engine is not running, so the request cannot be served"
        )

        new = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert new.status == 503 and (await new.json())["error"]["code"] == "engine_dead"
        health = await client.get("/health")
        assert health.status == 503 and (await health.json())["error"]["type"] == "server_error"

    run_with_app(config, scenario)


def test_disconnects_abort_in_the_engine_core(config):
    async def scenario(llm, client):
        core = llm.client.core
        aborted: list[str] = []
        real_abort = core.abort_requests

        def spy_abort(request_ids):  # runs in the core's thread
            aborted.extend(request_ids)
            real_abort(request_ids)

        core.abort_requests = spy_abort

        streaming = await client.post("/v1/completions", json=long_request(stream=True))
        assert len(await read_events(streaming, count=3)) == 3
        streaming.close()  # drop the connection mid-stream
        await wait_until(lambda: len(aborted) == 1, "the streamed request's abort")
        await wait_until(lambda: not core.has_unfinished_requests(), "an idle core")
        assert core.scheduler.kv.usage == 0.0

        blocking = asyncio.ensure_future(client.post("/v1/completions", json=long_request(False)))
        await wait_until(core.has_unfinished_requests, "the blocking request to run")
        blocking.cancel()  # the client gives up: its connection closes
        await wait_until(lambda: len(aborted) == 2, "the blocking request's abort")
        await wait_until(lambda: not core.has_unfinished_requests(), "an idle core")
        assert core.scheduler.kv.usage == 0.0
        assert all(rid.startswith("cmpl-") for rid in aborted) and len(set(aborted)) == 2
        assert llm.num_unfinished_requests == 0

        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert (await client.post("/v1/chat/completions", json=chat)).status == 200

    run_with_app(config, scenario)
