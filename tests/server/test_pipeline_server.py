"""`ringllm serve --pipeline-parallel-size 2` (two stage processes behind the engine
process, batches in flight): through the official `openai` client, a batch of greedy
completions and concurrent streams equal the offline single-process engine's, and the
server exits clean (no rank process, no shared memory left: `launched` checks)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from ringllm.pipeline import SamplingParams
from tests.server.conftest import ENGINE_KWARGS, ServerProcess, _flags, launched

PROMPTS = [f"Tell me about the number {i}: it is" for i in range(8)]


@pytest.fixture(scope="module")
def pp_server(server_model, tmp_path_factory):
    args = [
        str(server_model), "--port", "0", "--engine-process", "--pipeline-parallel-size", "2",
        *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    with launched(args, tmp_path_factory.mktemp("pp")) as (proc, url, log_path):
        yield ServerProcess(url, proc.pid, server_model, log_path, api_key="")


def test_completions_through_two_stages(pp_server, offline_llm):
    client = openai.OpenAI(base_url=pp_server.v1, api_key="unused")
    model = client.models.list().data[0].id
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].text for o in offline_llm.generate(PROMPTS, params, use_tqdm=False)]
    got = client.completions.create(
        model=model, prompt=PROMPTS, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want


def test_concurrent_streams_through_two_stages(pp_server, offline_llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].text for o in offline_llm.generate(PROMPTS, params, use_tqdm=False)]

    async def one(client, model, prompt) -> str:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=20, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=pp_server.v1, api_key="unused") as client:
            model = (await client.models.list()).data[0].id
            return await asyncio.gather(*(one(client, model, p) for p in PROMPTS))

    assert asyncio.run(main()) == want
