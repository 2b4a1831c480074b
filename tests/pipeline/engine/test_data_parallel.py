"""--data-parallel-size N: N engine core processes behind one front end."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from ringllm.ipc.shm import list_segments
from ringllm.pipeline import LLM, SamplingParams
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.frontend.async_llm import AsyncLLM

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_two_engine_cores_share_the_load_and_agree(model_factory):
    path = model_factory("llama")
    args = dict(model=str(path), dtype="float32", num_gpu_blocks_override=128)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(12)]
    reference_llm = LLM(**args)
    reference = reference_llm.generate(prompts, PARAMS, use_tqdm=False)
    paused_reference = reference_llm.generate(prompts[:4], LONG, use_tqdm=False)
    before = set(list_segments())  # other processes' segments may come and go meanwhile
    with LLM(multiprocess=True, data_parallel_size=2, **args) as llm:
        client = llm.llm_engine.core_client
        assert len(client.clients) == 2
        engine_pids = [c.engine_pid for c in client.clients]
        got = llm.generate(prompts, PARAMS, use_tqdm=False)
        assert min(client.num_routed) >= 3, f"requests were not spread: {client.num_routed}"
        resumed = _paused_and_resumed(llm.llm_engine, prompts[:4])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]
    assert resumed == [o.outputs[0].token_ids for o in paused_reference]
    mine = {n for n in set(list_segments()) - before if n.startswith(f"ringllm_{os.getpid()}_")}
    assert not mine and not any(
        n.startswith(tuple(f"ringllm_{p}_" for p in engine_pids)) for n in list_segments()
    )


LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _paused_and_resumed(engine, prompts) -> list[list[int]]:
    """Requests spread over the cores, paused once each has a token (each core then runs
    nothing, and none grows), then resumed: their final token ids."""
    ids = [f"paused-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, LONG)
    tokens: dict[str, list[int]] = {}

    def take() -> None:
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)

    while len(tokens) < len(ids):
        take()
    engine.core_client.pause_requests(ids)
    deadline = time.monotonic() + 30
    cores = engine.core_client.clients
    while any(c.instance.load() != (0, 0) for c in cores) and time.monotonic() < deadline:
        take()
    assert [c.instance.load() for c in cores] == [(0, 0), (0, 0)]
    take()  # what they made before the pause took effect
    made = {rid: len(t) for rid, t in tokens.items()}
    time.sleep(0.3)
    take()
    assert {rid: len(t) for rid, t in tokens.items()} == made  # nothing while paused
    assert all(n < LONG.max_tokens for n in made.values())
    engine.core_client.resume_requests(ids)
    while engine.has_unfinished_requests() and time.monotonic() < deadline + 60:
        take()
    return [tokens[rid] for rid in ids]


def test_data_parallel_needs_processes(model_factory):
    with pytest.raises(ValueError, match="data_parallel_size.*multiprocess=True"):
        LLM(model_factory("llama"), dtype="float32", data_parallel_size=2)


def test_a_killed_rank_restarts_alone_and_every_stream_completes(model_factory):
    """AsyncLLM over two cores: kill -9 one of them once every stream has tokens out; the
    supervisor starts that core alone again and replays only what it held (the other core
    keeps its requests and its process), so each stream ends with the tokens of an
    undisturbed run."""
    path = model_factory("llama")
    args = dict(model=str(path), dtype="float32", num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    reference = [
        o.outputs[0].token_ids for o in LLM(**args).generate(prompts, params, use_tqdm=False)
    ]
    config = EngineConfig.from_kwargs(data_parallel_size=2, **args)

    async def run():
        llm = AsyncLLM.from_config(config, max_restarts=2)
        old = [c.engine_pid for c in llm.client.clients]
        try:

            async def stream(prompt, started: asyncio.Event) -> list[int]:
                tokens: list[int] = []
                async for out in llm.generate(prompt, params):
                    tokens = list(out.outputs[0].token_ids)
                    started.set()
                return tokens

            started = [asyncio.Event() for _ in prompts]
            streams = [
                asyncio.ensure_future(stream(p, e)) for p, e in zip(prompts, started, strict=True)
            ]
            await asyncio.gather(*(e.wait() for e in started))
            os.kill(old[1], signal.SIGKILL)
            texts = await asyncio.gather(*streams)
            return old, [c.engine_pid for c in llm.client.clients], llm.num_restarts, texts
        finally:
            llm.shutdown()

    old, new, num_restarts, got = asyncio.run(run())
    assert num_restarts == 1
    assert new[0] == old[0] and new[1] != old[1]  # the survivor was left alone
    assert got == [list(r) for r in reference]
    for pid in old + new:
        assert not os.path.exists(f"/proc/{pid}")
        assert not [n for n in list_segments() if n.startswith(f"ringllm_{pid}_")]


@pytest.mark.slow  # the same supervisor as AsyncLLM's, whose kill -9 above runs by default
def test_llm_engine_restarts_a_killed_rank_alone(model_factory):
    """LLMEngine (LLM(multiprocess=True) with data_parallel_size=2): kill -9 core 1 once
    every request has tokens out; step() starts that core alone again and replays what it
    held; every request ends as an undisturbed run, and core 0 keeps its process."""
    from ringllm.pipeline.frontend.llm_engine import LLMEngine

    path = model_factory("llama")
    args = dict(model=str(path), dtype="float32", num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    reference = [
        o.outputs[0].token_ids for o in LLM(**args).generate(prompts, params, use_tqdm=False)
    ]
    engine = LLMEngine(EngineConfig.from_kwargs(data_parallel_size=2, **args), multiprocess=True)
    try:
        old = [c.engine_pid for c in engine.core_client.clients]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        final: dict[str, object] = {}
        killed = False
        while engine.has_unfinished_requests():
            for out in engine.step():
                final[out.request_id] = out
            if not killed and len(final) == len(prompts):
                os.kill(old[1], signal.SIGKILL)
                killed = True
        new = [c.engine_pid for c in engine.core_client.clients]
        assert engine.num_restarts == 1 and new[0] == old[0] and new[1] != old[1]
    finally:
        engine.shutdown()
    assert [list(final[f"r{i}"].outputs[0].token_ids) for i in range(6)] == [
        list(r) for r in reference
    ]
    assert not [n for n in list_segments() if n.startswith(f"ringllm_{old[1]}_")]
