"""The real server under concurrent load, and clients that leave mid-request."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai

MODEL_NAME = "tiny-llama"
WAIT_S = 60
RUNNING = "ringllm:num_requests_running"
KV_USAGE = "ringllm:kv_cache_usage_perc"
ABORTS = "ringllm:request_success_total{abort}"
PROMPT_TOKENS = "ringllm:prompt_tokens_total"


def long_request(stream: bool) -> dict:
    return {"prompt": "class Server:", "max_tokens": 2000, "ignore_eos": True, "stream": stream}


async def gauges(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """The running gauge and the prompt-token counter, from one scrape of /metrics."""
    wanted = {RUNNING: 0.0, PROMPT_TOKENS: 0.0}
    async with session.get(base_url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            name = line.split("{", 1)[0]
            if name in wanted:
                wanted[name] = float(line.rsplit(" ", 1)[1])
    return wanted


async def leave_mid_stream(server) -> None:
    async with aiohttp.ClientSession(headers=server.auth) as session:
        url = server.base_url + "/v1/completions"
        async with session.post(url, json=long_request(stream=True)) as response:
            assert response.status == 200
            events = 0
            async for line in response.content:
                events += line.startswith(b"data: ")
                if events == 3:
                    break
            response.close()  # drop the connection


async def leave_while_waiting(server) -> None:
    async with aiohttp.ClientSession(headers=server.auth) as session:
        url = server.base_url + "/v1/completions"
        # The gauges move with engine steps, so the stream left just before may still show
        # as running: this request runs once its own prompt was counted too.
        prompts_before = (await gauges(session, server.base_url))[PROMPT_TOKENS]
        pending = asyncio.ensure_future(session.post(url, json=long_request(stream=False)))
        deadline = time.monotonic() + WAIT_S
        while True:
            now = await gauges(session, server.base_url)
            if now[RUNNING] >= 1 and now[PROMPT_TOKENS] > prompts_before:
                break
            assert time.monotonic() < deadline, "the request never started running"
            await asyncio.sleep(0.02)
        pending.cancel()  # the client gives up: its connection closes


def test_disconnects_free_the_kv_cache(server):
    aborts_before = server.metrics().get(ABORTS, 0)
    asyncio.run(leave_mid_stream(server))
    asyncio.run(leave_while_waiting(server))
    # Stats arrive with engine steps: a one-token request makes one, after the aborts.
    # Each left request had ~2000 tokens to go, so a slot still held would show here.
    deadline = time.monotonic() + WAIT_S
    while True:
        status, _, _ = server.call("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 200
        metrics = server.metrics()
        if (
            metrics[RUNNING] == 0
            and metrics[KV_USAGE] == 0
            and metrics.get(ABORTS, 0) - aborts_before >= 2
        ):
            break
        assert time.monotonic() < deadline, f"still running after the disconnects: {metrics}"
        time.sleep(0.05)
    assert metrics[ABORTS] - aborts_before == 2
    assert metrics["ringllm:num_requests_waiting"] == 0


def test_200_requests_at_concurrency_64(server):
    tok_counts = {}

    async def one(client, sem, i: int) -> None:
        max_tokens = 1 + i % 9
        prompt = [3 + (i * 7 + k) % 400 for k in range(1 + i % 23)]
        async with sem:
            if i % 4 == 3:
                resp = await client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": f"request {i}"}],
                    max_tokens=max_tokens,
                    extra_body={"ignore_eos": True},
                )
                usage = resp.usage
                assert resp.choices[0].finish_reason == "length"
            elif i % 4 == 2:
                stream = await client.completions.create(
                    model=MODEL_NAME,
                    prompt=prompt,
                    max_tokens=max_tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                chunks = [chunk async for chunk in stream]
                usage = chunks[-1].usage
                assert chunks[-2].choices[0].finish_reason == "length"
                assert usage.prompt_tokens == len(prompt)
            else:
                resp = await client.completions.create(
                    model=MODEL_NAME,
                    prompt=prompt,
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                usage = resp.usage
                assert resp.usage.prompt_tokens == len(prompt)
                assert resp.choices[0].finish_reason == "length"
        assert usage.completion_tokens == max_tokens
        assert usage.total_tokens == usage.prompt_tokens + max_tokens
        tok_counts[i] = usage.completion_tokens

    async def main() -> None:
        sem = asyncio.Semaphore(64)
        async with openai.AsyncOpenAI(
            base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=300
        ) as client:
            await asyncio.gather(*(one(client, sem, i) for i in range(200)))

    before = server.metrics()
    asyncio.run(main())
    after = server.metrics()
    assert len(tok_counts) == 200
    generated = after["ringllm:generation_tokens_total"] - before["ringllm:generation_tokens_total"]
    assert generated == sum(tok_counts.values())
    length = "ringllm:request_success_total{length}"
    assert after[length] - before.get(length, 0) == 200
    assert after[RUNNING] == 0 and after[KV_USAGE] == 0
