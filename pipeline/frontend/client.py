"""The local IPC client: reach a running engine from another process, no HTTP, no sockets.

    from ringllm.pipeline import Client
    with Client.connect("ringllm_1234_ab12cd34ef56_engine") as client:   # `ringllm serve` prints it
        for out in client.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.outputs[0].text)
        async for out in client.agenerate([1, 2, 3], params): ...     # from asyncio code

Each client owns its output ring and its own front end (tokenizer, detokenizer, stop
strings), so several clients, in one process or many, run side by side; the engine core
only ever sees token ids. A client that exits (or dies) has its requests aborted by the
core. Internally the client is an `AsyncLLM` whose event loop runs on a thread of its
own, so the synchronous iterator and the async one share all the front-end logic.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.ring_client import RingCoreClient
from ringllm.pipeline.frontend.async_llm import AsyncLLM
from ringllm.pipeline.outputs import RequestOutput
from ringllm.pipeline.sampling_params import SamplingParams


class Client:
    def __init__(self, core: RingCoreClient) -> None:
        self.core = core
        config = EngineConfig.from_kwargs(model=str(core.info.model_path))
        self.llm = AsyncLLM(config, core)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="ringllm-client-loop", daemon=True
        )
        self._thread.start()

    @classmethod
    def connect(cls, instance_name: str) -> Client:
        return cls(RingCoreClient.connect(instance_name))

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    def generate(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Iterator[RequestOutput]:
        """Streams the outputs of one request (text or token ids); blocks between outputs."""
        agen = self.llm.generate(prompt, params or SamplingParams(), request_id)
        try:
            while True:
                future = asyncio.run_coroutine_threadsafe(agen.__anext__(), self._loop)
                try:
                    yield future.result()
                except StopAsyncIteration:
                    return
        finally:
            asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop).result()

    async def agenerate(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The same stream for asyncio code (any event loop: items hop over from the client's)."""
        agen = self.llm.generate(prompt, params or SamplingParams(), request_id)
        try:
            while True:
                future = asyncio.run_coroutine_threadsafe(agen.__anext__(), self._loop)
                try:
                    yield await asyncio.wrap_future(future)
                except StopAsyncIteration:
                    return
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop))

    def abort(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self.llm.abort, request_id)

    def close(self) -> None:
        """Leaves the engine running; only this client's rings go."""
        if self._loop.is_closed():
            return
        self.llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
