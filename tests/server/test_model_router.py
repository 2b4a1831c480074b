"""Several models behind one server (server/model_router.py): requests routed by `model`,
models loaded at their first request, put to sleep when idle or to make room, and woken by
the next request, which waits for the wake and is never refused for it.

Oracle: each model's greedy text from the offline `LLM` on the same folder; a model gives
the same text before its sleep and after its wake (level 1: weights back from the file;
level 2: loaded again from the folder)."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time
import urllib.request

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from ringllm.pipeline import LLM, SamplingParams
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.frontend.async_llm import AsyncLLM
from ringllm.server.app import create_app
from ringllm.server.cli import _engine_config, configure_parser, model_specs, models_in
from ringllm.server.model_router import (
    CORE_PROCESS_BASE_BYTES,
    ModelRouter,
    ModelSpec,
    RouterPolicy,
    estimate_bytes,
)
from tests.server.conftest import _flags

WAIT_S = 60
ENGINE = {"dtype": "float32", "max_model_len": 512, "num_gpu_blocks_override": 256}
PROMPT = "The capital of"
MAX_TOKENS = 8


def config_of(path, sleep: bool = True) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(path), enable_sleep_mode=sleep, **ENGINE)


@pytest.fixture(scope="module")
def folders(model_factory):
    """Two different tiny models (a Llama and a Qwen2)."""
    return {"llama": model_factory("llama"), "qwen": model_factory("qwen2")}


@pytest.fixture(scope="module")
def oracle(folders):
    """Each model's greedy text, offline."""
    texts = {}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name, path in folders.items():
        llm = LLM(str(path), **ENGINE)
        texts[name] = llm.generate([PROMPT], params)[0].outputs[0].text
        llm.shutdown()
    assert texts["llama"] != texts["qwen"]
    return texts


def load_in_thread(config: EngineConfig) -> AsyncLLM:
    return AsyncLLM.from_config(config, multiprocess=False)


def router_of(folders, **policy) -> ModelRouter:
    specs = [ModelSpec(name, config_of(path), frozenset()) for name, path in folders.items()]
    return ModelRouter(specs, load_in_thread, RouterPolicy(**policy))


def run_with_router(router: ModelRouter, scenario) -> None:
    async def main():
        app = create_app(router, None)
        try:
            await router.start()
            async with TestClient(TestServer(app)) as client:
                await scenario(client)
        finally:
            await router.stop()
            router.shutdown()

    asyncio.run(main())


async def complete(client, model: str | None) -> tuple[int, dict]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    response = await client.post("/v1/completions", json=body)
    return response.status, await response.json()


async def states(client) -> dict[str, str]:
    listing = await (await client.get("/v1/models")).json()
    return {card["id"]: card["status"]["state"] for card in listing["data"]}


async def wait_for_state(client, model: str, state: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while (await states(client))[model] != state:
        assert time.monotonic() < deadline, f"{model} never became {state}"
        await asyncio.sleep(0.05)


def test_requests_go_to_their_model_which_loads_sleeps_when_idle_and_wakes(folders, oracle):
    router = router_of(folders, idle_s=0.5, sleep_level=1)

    async def scenario(client):
        assert await states(client) == {"llama": "awake", "qwen": "unloaded"}  # the first loads
        status, body = await complete(client, "qwen")  # loaded by its first request
        assert status == 200 and body["model"] == "qwen"
        assert body["choices"][0]["text"] == oracle["qwen"]
        status, body = await complete(client, None)  # no model: the first one
        assert status == 200 and body["model"] == "llama"
        assert body["choices"][0]["text"] == oracle["llama"]
        await wait_for_state(client, "llama", "asleep")
        await wait_for_state(client, "qwen", "asleep")
        # (llama may have slept once already, while qwen loaded: that is the machine's speed)
        wakes = router.models["llama"].num_wakes
        listing = await (await client.get("/v1/models")).json()
        assert [card["status"]["sleep_level"] for card in listing["data"]] == [1, 1]
        # the first request to a sleeping model waits for its wake: never a 503
        for model in ("llama", "qwen"):
            status, body = await complete(client, model)
            assert status == 200, body
            assert body["choices"][0]["text"] == oracle[model]
        assert (await states(client))["llama"] == "awake"
        assert router.models["llama"].num_wakes == wakes + 1

    run_with_router(router, scenario)


def test_at_most_n_awake_the_least_recently_used_sleeps_first(folders, oracle):
    router = router_of(folders, max_awake=1, sleep_level=2)

    async def scenario(client):
        for model, other in (("qwen", "llama"), ("llama", "qwen"), ("qwen", "llama")):
            status, body = await complete(client, model)
            assert status == 200, body
            assert body["choices"][0]["text"] == oracle[model]  # level 2: loaded again
            assert await states(client) == {model: "awake", other: "asleep"}
        # requests to both at once: each waits for the other's to finish, none refused
        results = await asyncio.gather(*(complete(client, m) for m in ["llama", "qwen"] * 4))
        for model, (status, body) in zip(["llama", "qwen"] * 4, results, strict=True):
            assert status == 200, body
            assert body["choices"][0]["text"] == oracle[model]
        assert list((await states(client)).values()).count("awake") == 1

    run_with_router(router, scenario)


def test_a_busy_model_drains_so_the_other_is_not_starved(folders, oracle):
    """max 1 awake: a request for the sleeping model while the awake one streams. The
    stream runs to its end; a request for the streaming model that comes meanwhile waits
    for that model's next wake instead of keeping it awake; every request is answered."""
    router = router_of(folders, max_awake=1)
    long_body = {"model": "llama", "prompt": PROMPT, "max_tokens": 450, "ignore_eos": True,
                 "temperature": 0, "stream": True}  # fmt: skip

    async def scenario(client):
        stream = await client.post("/v1/completions", json=long_body)
        assert stream.status == 200
        await stream.content.readline()  # it is under way
        other = asyncio.create_task(complete(client, "qwen"))
        deadline = time.monotonic() + WAIT_S
        while (await states(client))["llama"] != "draining":
            assert time.monotonic() < deadline and not other.done()
            await asyncio.sleep(0.01)
        again = asyncio.create_task(complete(client, "llama"))
        text = (await stream.read()).decode()
        assert text.rstrip().endswith("data: [DONE]")  # the stream was not cut
        for task, model in ((other, "qwen"), (again, "llama")):
            status, body = await task
            assert status == 200 and body["choices"][0]["text"] == oracle[model]
        assert router.models["qwen"].num_wakes == 1 and router.models["llama"].num_wakes == 2

    run_with_router(router, scenario)


def test_a_memory_budget_for_one_model_puts_the_other_to_sleep(folders, oracle):
    # the engines run in this process: each model's size is its estimate, asleep the base
    one_awake = max(estimate_bytes(config_of(p)) for p in folders.values())
    router = router_of(folders, memory_bytes=one_awake + CORE_PROCESS_BASE_BYTES)

    async def scenario(client):
        status, _ = await complete(client, "qwen")
        assert status == 200
        assert await states(client) == {"llama": "asleep", "qwen": "awake"}
        status, body = await complete(client, "llama")
        assert status == 200 and body["choices"][0]["text"] == oracle["llama"]
        assert await states(client) == {"llama": "awake", "qwen": "asleep"}

    run_with_router(router, scenario)


def test_bad_model_names_and_a_model_that_cannot_load_leave_the_others_serving(
    folders, oracle, tmp_path
):
    broken = tmp_path / "broken"
    shutil.copytree(folders["qwen"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    specs = [
        ModelSpec("llama", config_of(folders["llama"]), frozenset()),
        ModelSpec("broken", config_of(broken), frozenset()),
    ]
    router = ModelRouter(specs, load_in_thread, RouterPolicy(idle_s=60))

    async def scenario(client):
        response = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        error = (await response.json())["error"]
        assert response.status == 404 and error["code"] == "model_not_found"
        assert "'llama', 'broken'" in error["message"]
        response = await client.post("/v1/chat/completions", json={"model": 7, "messages": []})
        assert response.status == 400 and "model: must be a string" in await response.text()
        status, body = await complete(client, "broken")
        assert status == 503 and body["error"]["code"] == "model_unavailable"
        assert "'broken' could not be loaded" in body["error"]["message"]
        assert (await states(client))["broken"] == "unloaded"
        status, body = await complete(client, "llama")
        assert status == 200 and body["choices"][0]["text"] == oracle["llama"]
        assert (await client.get("/health")).status == 200

    run_with_router(router, scenario)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(argv)


def test_cli_names_models_from_their_paths_or_as_given(folders, tmp_path):
    llama, qwen = str(folders["llama"]), str(folders["qwen"])
    args = parse(["--model", llama, "--model", f"coder={qwen}", "--model-idle-s", "30"])
    specs = model_specs(args, _engine_config(args))
    assert [s.name for s in specs] == [folders["llama"].name, "coder"]
    assert [s.config.model.model for s in specs] == [llama, qwen]
    assert all(s.config.model.enable_sleep_mode for s in specs)
    assert specs[1].aliases == {qwen}
    # a models folder: its .gguf files and model folders, by name
    shutil.copytree(folders["qwen"], tmp_path / "b-model")
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "notes").mkdir()
    assert [p.name for p in models_in(str(tmp_path))] == ["a.gguf", "b-model"]
    with pytest.raises(SystemExit, match="holds no model"):
        models_in(str(tmp_path / "notes"))
    with pytest.raises(SystemExit, match="--served-model-name names one model"):
        args = parse(["--model", llama, "--model", qwen, "--served-model-name", "x"])
        model_specs(args, _engine_config(args))
    with pytest.raises(ValueError, match="given to two models"):
        args = parse(["--model", f"m={llama}", "--model", f"m={qwen}"])
        ModelRouter(model_specs(args, _engine_config(args)), load_in_thread)
    with pytest.raises(SystemExit, match="idle time: must be above 0"):
        args = parse(["--model", llama, "--model-idle-s", "0"])
        model_specs(args, _engine_config(args))


def test_serve_several_models_with_the_openai_client(folders, oracle, launch_server):
    """`ringllm serve --model A --model NAME=B`: each engine core in its own process; the
    server exits cleanly with no process and no shared memory left."""
    args = [
        "--model", str(folders["llama"]), "--model", f"qwen={folders['qwen']}",
        "--port", "0", "--api-key", "k", "--engine-process", "--model-idle-s", "1",
        *_flags(ENGINE),
    ]  # fmt: skip
    with launch_server(args) as (_, url, log_path):
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list()] == [folders["llama"].name, "qwen"]
        for name, key in ((folders["llama"].name, "llama"), ("qwen", "qwen"), ("qwen", "qwen")):
            completion = client.completions.create(
                model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert completion.choices[0].text == oracle[key]
            assert completion.model == name
        deadline = time.monotonic() + WAIT_S
        while "model 'qwen' sleeps" not in log_path.read_text():
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        completion = client.completions.create(
            model="qwen", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert completion.choices[0].text == oracle["qwen"]
        with pytest.raises(openai.NotFoundError, match="does not exist here"):
            client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
        # /metrics: one exposition, each family once, samples of both models
        request = urllib.request.Request(url + "/metrics", headers={"Authorization": "Bearer k"})
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
        assert text.count("# TYPE ringllm:generation_tokens_total counter") == 1
        for name in (folders["llama"].name, "qwen"):
            assert f'ringllm:generation_tokens_total{{model_name="{name}"}}' in text
