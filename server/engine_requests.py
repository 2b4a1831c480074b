"""The engine requests behind one HTTP request: one per prompt, merged into one stream.

A completions request with a list of prompts becomes one engine request per prompt
(ids `<response id>-<prompt index>`), as in vLLM; each runs in its own task and their
outputs arrive here in the order the engine produces them, tagged with the prompt index.

Invariants:
- `close()` ends every engine request that has not finished: its task is cancelled, its
  `generate` loop exits early, and AsyncLLM aborts it in the engine core (which frees its
  KV blocks). Handlers call it on every exit path (client gone, error, success).
- The merged queue holds one output: a reader that stops reading holds up the prompts'
  tasks, so unread outputs wait in AsyncLLM's per-request queues, which are bounded in
  bytes (pipeline/frontend/output_queue.py), never here.
- An error from any prompt (a prompt over the context, a dead engine core) is raised to
  the reader at the point it arrives; `wait_admitted()` lets a streaming handler learn of
  admission errors before it commits to a 200.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from ringllm.pipeline.outputs import RequestOutput
from ringllm.pipeline.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ringllm.pipeline.frontend.async_llm import AsyncLLM

_FINISHED = object()


class MergedGenerations:
    def __init__(
        self, llm: AsyncLLM, prompts: Sequence[Any], params: SamplingParams, request_id: str
    ) -> None:
        self.num_prompts = len(prompts)
        self._queue: asyncio.Queue = asyncio.Queue(1)
        self._buffer: list[tuple[int, Any]] = []
        # every prompt of one HTTP request shares one group: the scheduler's fair share
        # treats the HTTP request as one user
        self._tasks = [
            asyncio.create_task(
                self._run(llm, i, prompt, params.clone(), f"{request_id}-{i}", request_id)
            )
            for i, prompt in enumerate(prompts)
        ]

    async def _run(
        self,
        llm: AsyncLLM,
        index: int,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        group_id: str,
    ) -> None:
        try:
            generation = llm.generate(prompt, params, request_id, group_id=group_id)
            async with contextlib.aclosing(generation) as outputs:
                async for out in outputs:
                    await self._queue.put((index, out))
        except Exception as exc:  # handed to the reader, who turns it into a response
            await self._queue.put((index, exc))
            return
        await self._queue.put((index, _FINISHED))

    async def wait_admitted(self) -> None:
        """Returns once every prompt has produced its first output; raises its error if any."""
        seen: set[int] = set()
        while len(seen) < self.num_prompts:
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            seen.add(index)
            self._buffer.append((index, item))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) until every prompt's request has finished."""
        remaining = self.num_prompts
        while remaining:
            if self._buffer:
                index, item = self._buffer.pop(0)
            else:
                index, item = await self._queue.get()
            if item is _FINISHED:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item

    async def close(self) -> None:
        """Aborts whatever has not finished (a no-op once everything has)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
