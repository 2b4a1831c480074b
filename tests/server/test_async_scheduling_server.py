"""`ringllm serve --async-scheduling` through the official `openai` client: concurrent
streams with stop strings and max_tokens end exactly as the offline engine without async
scheduling ends them, the token counts are exact, and the gauges go back to zero (a batch
left in flight after the last stream ended holds nobody)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai

from ringllm.pipeline import LLM, SamplingParams
from tests.server.conftest import API_KEY, ENGINE_KWARGS, _flags

PROMPTS = [f"Story {i}: once upon a time" for i in range(12)]


def test_streams_end_as_without_it(server_model, launch_server):
    oracle = LLM(str(server_model), **ENGINE_KWARGS)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = [o.outputs[0].text for o in oracle.generate(PROMPTS, greedy, use_tqdm=False)]
    stops = [text[8:10] if i % 3 == 0 and len(text) > 10 else None for i, text in enumerate(full)]
    want = []
    for text, stop in zip(full, stops, strict=True):
        want.append(text[: text.index(stop)] if stop else text)

    async def one(client, i: int) -> tuple[str, int, str]:
        extra = {"stop": [stops[i]]} if stops[i] else {}
        stream = await client.completions.create(
            model=str(server_model),
            prompt=PROMPTS[i],
            max_tokens=24,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **extra,
        )
        text, tokens, reason = "", 0, ""
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                reason = choice.finish_reason or reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, tokens, reason

    async def main(url: str):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(len(PROMPTS))))

    args = [str(server_model), "--port", "0", "--engine-process", "--api-key", API_KEY]
    args += ["--async-scheduling", *_flags(ENGINE_KWARGS)]
    with launch_server(args) as (_, url, _):
        got = asyncio.run(main(url))
        for (text, tokens, reason), expected, stop in zip(got, want, stops, strict=True):
            assert text == expected
            assert reason == ("stop" if stop else "length")
            if not stop:
                assert tokens == 24
        deadline = time.monotonic() + 10
        while (load := _load(asyncio.run(_metrics(url)))) != (0, 0):
            assert time.monotonic() < deadline, f"the gauges stay at {load}"
            time.sleep(0.05)


def _load(metrics: dict[str, float]) -> tuple[float, float]:
    return metrics["ringllm:num_requests_running"], metrics["ringllm:num_requests_waiting"]


async def _metrics(url: str) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with (
        aiohttp.ClientSession(headers=headers) as session,
        session.get(url + "/metrics") as r,
    ):
        assert r.status == 200
        text = await r.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values
