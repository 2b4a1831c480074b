"""Sleep mode through the engine APIs: `LLM.sleep(level)` / `wake_up()` in process, behind the
rings, over data-parallel cores and from `AsyncLLM` with requests under way. Greedy outputs
after waking equal those before sleeping; an asleep engine refuses new requests clearly; the
engine core process gives back the KV cache's and the weights' memory (RSS, from /proc)."""

from __future__ import annotations

import asyncio

import pytest

from ringllm.pipeline import LLM, SamplingParams
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.errors import EngineSleepingError
from ringllm.pipeline.frontend.async_llm import AsyncLLM
from ringllm.pipeline.worker.sleep import rss_bytes

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KV_BYTES = 256 << 20  # large against the tiny model: its coming and going shows in RSS


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("llama")


def args(model, **extra):
    return dict(model=str(model), dtype="float32", enable_sleep_mode=True, **extra)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_sleep_needs_sleep_mode(model):
    llm = LLM(str(model), dtype="float32", num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep(1)
    assert not llm.is_sleeping()
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_in_process_each_level_wakes_to_the_same_outputs(model):
    llm = LLM(**args(model, num_gpu_blocks_override=64))
    expected = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    for level in (1, 2):
        llm.sleep(level)
        assert llm.is_sleeping()
        with pytest.raises(EngineSleepingError, match="asleep"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.wake_up()
        assert not llm.is_sleeping()
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    with pytest.raises(ValueError, match="level 3"):
        llm.sleep(3)
    assert not llm.is_sleeping()
    # vLLM's tags: the weights first, then the KV cache; asleep until both are back
    llm.sleep(1)
    llm.wake_up(["weights"])
    assert llm.is_sleeping()
    with pytest.raises(EngineSleepingError):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping()
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    with pytest.raises(ValueError, match="wake_up tags"):
        llm.wake_up(["all"])


def test_the_engine_process_gives_its_memory_back_and_takes_it_again(model):
    with LLM(**args(model, kv_cache_memory_bytes=KV_BYTES), multiprocess=True) as llm:
        pid = llm.llm_engine.core_client.engine_pid
        expected = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        for level in (1, 2):
            awake = rss_bytes(pid)
            llm.sleep(level)
            asleep = rss_bytes(pid)
            llm.wake_up()
            woken = rss_bytes(pid)
            # most of the KV cache leaves the process, and comes back (zeroed, so resident)
            assert asleep < awake - 0.8 * KV_BYTES, (level, awake, asleep)
            assert woken > asleep + 0.8 * KV_BYTES, (level, asleep, woken)
            assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_data_parallel_cores_all_sleep_and_wake(model):
    with LLM(
        **args(model, num_gpu_blocks_override=64, data_parallel_size=2), multiprocess=True
    ) as llm:
        expected = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        llm.sleep(2)
        assert llm.is_sleeping()
        llm.wake_up()
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_requests_under_way_pause_in_sleep_and_finish_as_if_undisturbed(model):
    """AsyncLLM: a sleep mid-generation preempts what runs (the KV cache goes); after the
    wake those requests are recomputed and finish with the tokens an undisturbed run gives;
    a request sent while asleep is refused with EngineSleepingError."""
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    config = EngineConfig.from_kwargs(**args(model, num_gpu_blocks_override=256))

    async def run() -> tuple[list, list, bool]:
        llm = AsyncLLM.from_config(config)
        try:

            async def generate(prompt: str, started: asyncio.Event | None = None) -> list[int]:
                tokens: list[int] = []
                async for out in llm.generate(prompt, params):
                    tokens = list(out.outputs[0].token_ids)
                    if started is not None:
                        started.set()
                return tokens

            expected = await asyncio.gather(*(generate(p) for p in PROMPTS))
            started = [asyncio.Event() for _ in PROMPTS]
            streams = [
                asyncio.ensure_future(generate(p, e)) for p, e in zip(PROMPTS, started, strict=True)
            ]
            await asyncio.gather(*(e.wait() for e in started))
            await llm.sleep(1)
            unfinished = not any(s.done() for s in streams)
            with pytest.raises(EngineSleepingError):
                await generate("refused while asleep")
            await asyncio.sleep(0.2)
            await llm.wake_up()
            return expected, await asyncio.gather(*streams), unfinished
        finally:
            llm.shutdown()

    expected, got, unfinished = asyncio.run(run())
    assert unfinished  # the sleep did catch them under way
    assert got == expected


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inline", "process"])
def test_llm_engine_sleeping_mid_generation_finishes_as_undisturbed(model, multiprocess):
    """LLMEngine: sleep() while its requests run; the outputs read while waiting for the
    answer are kept for the next step(), nothing is lost, and after the wake every request
    ends with the tokens an undisturbed run gives."""
    from ringllm.pipeline.frontend.llm_engine import LLMEngine

    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    config = EngineConfig.from_kwargs(**args(model, num_gpu_blocks_override=128))
    expected = token_ids(LLM.from_config(config).generate(PROMPTS, params, use_tqdm=False))
    engine = LLMEngine(config, multiprocess=multiprocess)
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
        final: dict[str, object] = {}
        slept = False
        while engine.has_unfinished_requests():
            for out in engine.step():
                final[out.request_id] = out
            if not slept and len(final) == len(PROMPTS):
                engine.sleep(1)
                slept = True
                assert engine.has_unfinished_requests()
                with pytest.raises(EngineSleepingError):
                    engine.add_request("late", PROMPTS[0], params)
                engine.wake_up()
        assert slept
    finally:
        engine.shutdown()
    assert [list(final[f"r{i}"].outputs[0].token_ids) for i in range(len(PROMPTS))] == expected


def test_another_front_end_is_told_the_engine_is_asleep(model):
    """A front end attached to the core by name (the IPC Client) does not know of the sleep:
    the core refuses its request with a message that says why."""
    from ringllm.pipeline import Client

    config = EngineConfig.from_kwargs(**args(model, num_gpu_blocks_override=64))

    async def run():
        llm = AsyncLLM.from_config(config)
        try:
            await llm.sleep(1)
            with Client.connect(llm.instance_name) as client:
                with pytest.raises(ValueError, match="asleep"):
                    list(client.generate(PROMPTS[0], GREEDY))
            await llm.wake_up()
            with Client.connect(llm.instance_name) as client:
                return list(client.generate(PROMPTS[0], GREEDY))[-1].outputs[0].token_ids
        finally:
            llm.shutdown()

    assert (
        list(asyncio.run(run()))
        == token_ids(
            LLM(**args(model, num_gpu_blocks_override=64)).generate(
                PROMPTS[:1], GREEDY, use_tqdm=False
            )
        )[0]
    )
