"""A poison request (one whose every run kills the engine core) costs that request, not the
server: the supervisor replays it once, finds it in flight at the next death too, and ends it
with 500 `request_failed` while everyone else is served; its two deaths cost a crash-loop
budget of one restart one death, so the poison is isolated before the budget runs out. And an exception (not a crash) in a tensor-parallel rank costs only its
request.

The poison is a real `os._exit` in the core's forward (`RINGLLM_TEST_FAULTS=crash=SEED`,
pipeline/errors.py) for the request with that seed, which a client sends as `seed`."""

from __future__ import annotations

import asyncio

import openai

from tests.conftest import environment
from tests.server.conftest import ENGINE_KWARGS, _flags, launched

POISON_SEED, FAILING_SEED = 7771, 7772


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


def test_a_request_that_kills_the_core_each_time_is_quarantined(server_model, tmp_path):
    args = [
        str(server_model), "--port", "0", "--served-model-name", "m", "--engine-process",
        "--engine-restarts", "1",
        *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    with environment(RINGLLM_TEST_FAULTS=f"crash={POISON_SEED}"):
        with launched(args, tmp_path, sweep_stale=True) as (_, url, log_path):
            poison, others = _served_after(url, POISON_SEED)
    _assert_request_failed(poison)
    assert all(isinstance(text, str) and text for text in others), others
    log = log_path.read_text()
    assert log.count("engine core died 2 times in a row") == 1, log[-3000:]


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
