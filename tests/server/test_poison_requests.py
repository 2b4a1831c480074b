"""A poison request (one whose every run kills the engine core) costs that request, not the
server. Alone, the supervisor replays it once, finds it in flight at the next death too, and
ends it with 500 `request_failed` while everyone else is served. Among busy streams (in
flight with it at every death), the supervisor bisects from the second death on: half the
suspects replayed, half held back, until the one that kills the core is left; the streams
go on with the text of an undisturbed run. Each run of deaths costs the crash-loop budget one death, so both fit a
budget of two. And an exception (not a crash) in a tensor-parallel rank costs only its
request.

The poison is a real `os._exit` in the core's forward (`RINGLLM_TEST_FAULTS=crash=SEED`,
pipeline/errors.py) for the request with that seed, which a client sends as `seed`."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import aiohttp
import openai
import pytest

from ringllm.pipeline import SamplingParams
from tests.conftest import environment
from tests.server.conftest import ENGINE_KWARGS, _flags, launched

POISON_SEED, FAILING_SEED = 7771, 7772
BUSY_PROMPTS = [f"Story number {i}: once upon a time" for i in range(10)]
BUSY_TOKENS = 48


@pytest.fixture(scope="module")
def poison_server(server_model, tmp_path_factory):
    """A server whose core dies each time it runs the request seeded POISON_SEED; yields its
    URL and log."""
    args = [
        str(server_model), "--port", "0", "--served-model-name", "m", "--engine-process",
        "--engine-restarts", "2",
        *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    with environment(RINGLLM_TEST_FAULTS=f"crash={POISON_SEED}"):
        with launched(args, tmp_path_factory.mktemp("poison"), sweep_stale=True) as served:
            _, url, log_path = served
            yield url, log_path


def _log_since(log_path: Path, offset: int) -> str:
    return log_path.read_bytes()[offset:].decode(errors="replace")


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


async def _complete(client: openai.AsyncOpenAI, prompt: str, seed: int | None = None):
    """The completion's text, or the API error it ended with."""
    try:
        out = await client.completions.create(
            model="m", prompt=prompt, max_tokens=8, temperature=0, seed=seed
        )
    except openai.APIStatusError as exc:
        return exc
    return out.choices[0].text


def _served_after(url: str, bad_seed: int) -> tuple[object, list]:
    async def run():
        async with _client(url) as client:
            bad = await _complete(client, "this prompt kills the engine", seed=bad_seed)
            others = await asyncio.gather(
                *(_complete(client, f"Story number {i}: once upon a time") for i in range(20))
            )
            return bad, others

    return asyncio.run(run())


def _assert_request_failed(error: object) -> None:
    assert isinstance(error, openai.InternalServerError), error
    body = error.body if isinstance(error.body, dict) else {}
    assert body.get("code") == "request_failed", body
    assert "seed" not in str(body) and "os._exit" not in str(body)


@pytest.mark.slow  # the single-rank cases above run by default
def test_an_exception_in_a_tensor_parallel_rank_costs_only_its_request(server_model, tmp_path):
    """A rank's exception ends the group (the ranks could be split inside a collective, so
    none goes on alone); the core is restarted and the request, failing again, quarantined."""
    args = [
        str(server_model), "--port", "0", "--served-model-name", "m", "--engine-process",
        "--tensor-parallel-size", "2", *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    with environment(RINGLLM_TEST_FAULTS=f"forward={FAILING_SEED}"):
        with launched(args, tmp_path, sweep_stale=True) as (_, url, _log):
            failed, others = _served_after(url, FAILING_SEED)
    _assert_request_failed(failed)
    assert all(isinstance(text, str) and text for text in others), others


def test_a_request_that_kills_the_core_each_time_is_quarantined(poison_server):
    url, log_path = poison_server
    offset = log_path.stat().st_size
    poison, others = _served_after(url, POISON_SEED)
    _assert_request_failed(poison)
    assert all(isinstance(text, str) and text for text in others), others
    log = _log_since(log_path, offset)
    assert log.count("engine core died 2 times in a row") == 1, log[-3000:]


async def _stream(client: openai.AsyncOpenAI, prompt: str, started: asyncio.Event):
    """A greedy stream's text and its completion tokens (`started` set at its first text)."""
    text, num_tokens = "", None
    stream = await client.completions.create(
        model="m", prompt=prompt, max_tokens=BUSY_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            started.set()
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    return text, num_tokens


def test_a_poison_among_busy_streams_is_found_and_the_streams_go_on(poison_server, offline_llm):
    """Ten streams under way when the poison comes, in flight with it at its deaths:
    replaying every suspect each time (the intersection of the deaths' sets never shrinks)
    would spend the budget or quarantine them all."""
    params = SamplingParams(temperature=0, max_tokens=BUSY_TOKENS, ignore_eos=True)
    generated = offline_llm.generate(BUSY_PROMPTS, params, use_tqdm=False)
    expected = [(o.outputs[0].text, BUSY_TOKENS) for o in generated]
    url, log_path = poison_server
    offset = log_path.stat().st_size

    async def run():
        async with _client(url) as client, aiohttp.ClientSession() as session:
            started = [asyncio.Event() for _ in BUSY_PROMPTS]
            streams = [
                asyncio.ensure_future(_stream(client, p, e))
                for p, e in zip(BUSY_PROMPTS, started, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            poison = await _complete(client, "this prompt kills the engine", seed=POISON_SEED)
            busy = await asyncio.gather(*streams)
            async with session.get(url + "/health") as r:
                health = r.status
            events = [asyncio.Event() for _ in range(3)]
            after = await asyncio.gather(
                *(_stream(client, p, e) for p, e in zip(BUSY_PROMPTS, events, strict=False))
            )
            return poison, busy, health, after

    poison, busy, health, after = asyncio.run(run())
    _assert_request_failed(poison)
    assert busy == expected  # every stream whole: no token lost, none repeated
    assert health == 200
    assert after == expected[:3]
    log = _log_since(log_path, offset)
    assert log.count("quarantined, not replayed") == 1, log[-3000:]
    assert "held back" in log and "a crash loop" not in log, log[-3000:]
    num_deaths = log.count("); restarting it")
    assert 3 <= num_deaths <= 2 + math.ceil(math.log2(len(BUSY_PROMPTS) + 1)), log[-3000:]
