"""LoRA adapters over HTTP: `ringllm serve --enable-lora --lora-modules`, adapters loaded and
unloaded at run time (/v1/load_lora_adapter, behind the API key), listed by /v1/models with
their parent, requests for different adapters and the base model served together, and
adapters that do not fit refused with a clear 4xx while the server goes on.

Oracle: the offline `LLM` with the same adapter (tests/pipeline/frontend/test_lora_engine.py
checks that one against PEFT)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request

import openai
import pytest

from ringllm.pipeline import LLM, LoRARequest, SamplingParams
from ringllm.server.lora_adapters import parse_lora_modules
from tests.conftest import make_peft_adapter
from tests.server.conftest import _flags
from tests.server.test_engine_restart import engine_pid, new_engine_pid
from tests.server.test_model_router import run_with_router

ENGINE = {"dtype": "float32", "max_model_len": 256, "num_gpu_blocks_override": 128}
PROMPT = "The capital of"
MAX_TOKENS = 8
KEY = "k"


def _make_adapter(base, out, seed: int, **config) -> None:
    make_peft_adapter(base, out, seed, b_std=0.2, **config)


@pytest.fixture(scope="module")
def adapters(model_factory, tmp_path_factory):
    base = model_factory("llama")
    root = tmp_path_factory.mktemp("http_adapters")
    _make_adapter(base, root / "sql", 1, r=8, lora_alpha=16, target_modules="all-linear")
    _make_adapter(base, root / "poet", 2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    _make_adapter(base, root / "big", 3, r=32, target_modules=["q_proj"])
    other = model_factory("llama", hidden_size=96)
    _make_adapter(other, root / "other", 4, r=4, target_modules=["q_proj"])
    return base, root


@pytest.fixture(scope="module")
def oracle(adapters):
    base, root = adapters
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = {}
    with LLM(str(base), enable_lora=True, max_lora_rank=16, **ENGINE) as llm:
        for i, name in enumerate((None, "sql", "poet")):
            lora = None if name is None else LoRARequest(name, i, str(root / name))
            out = llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)
            texts[name] = out[0].outputs[0].text
    assert len(set(texts.values())) == 3  # each adapter changes the text
    return texts


def test_lora_modules_spellings():
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == [
        ("a", "/x", None),
        ("b", "/y", "m"),
    ]
    for bad in ("a", "=/x", '{"name": "b"}', "{nope"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])


def test_serve_adapters_with_the_openai_client(adapters, oracle, launch_server):
    base, root = adapters
    args = [
        "--model", str(base), "--port", "0", "--api-key", KEY, "--engine-process",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"sql={root / 'sql'}", *_flags(ENGINE),
    ]  # fmt: skip
    with launch_server(args) as (proc, url, _log):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        models = {m.id: m for m in client.models.list()}
        assert set(models) == {base.name, "sql"}
        assert models["sql"].model_extra["parent"] == base.name
        assert str(root) not in json.dumps([m.model_dump() for m in models.values()])

        def complete(model):
            return client.completions.create(
                model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        out = complete("sql")
        assert out.choices[0].text == oracle["sql"] and out.model == "sql"
        assert complete(base.name).choices[0].text == oracle[None]

        # loading at run time needs the key; then the adapter is a model
        load = {"lora_name": "poet", "lora_path": str(root / "poet")}
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).post(
                "/load_lora_adapter", body=load, cast_to=str
            )
        text = client.post("/load_lora_adapter", body=load, cast_to=str)
        assert "added successfully" in text
        assert {m.id for m in client.models.list()} == {base.name, "sql", "poet"}

        async def together():
            aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            names = ["poet", base.name, "sql", "poet", "sql", base.name]
            outs = await asyncio.gather(
                *(
                    aclient.completions.create(
                        model=name,
                        prompt=PROMPT,
                        max_tokens=MAX_TOKENS,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    for name in names
                )
            )
            await aclient.close()
            return names, outs

        names, outs = asyncio.run(together())
        for name, out in zip(names, outs, strict=True):
            assert out.choices[0].text == oracle[None if name == base.name else name], name

        chat = client.chat.completions.create(
            model="poet", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.model == "poet" and chat.usage.completion_tokens == 4

        # bad input: clear 4xx, the server goes on
        cases = [
            ({"lora_name": "x", "lora_path": str(root / "missing")}, "not a folder"),
            ({"lora_name": "x", "lora_path": str(root / "big")}, "above max_lora_rank 16"),
            ({"lora_name": "x", "lora_path": str(root / "other")}, "another base model"),
            ({"lora_name": "sql", "lora_path": str(root / "poet")}, "is taken"),
            ({"lora_name": base.name, "lora_path": str(root / "poet")}, "is taken"),
            ({"lora_name": "x"}, "lora_path: must be a non-empty string"),
            ({"lora_name": "x", "lora_path": str(root / "poet"), "base_model_name": "nope"},
             "not a model this server serves"),
        ]  # fmt: skip
        for body, message in cases:
            with pytest.raises(openai.BadRequestError, match=message):
                client.post("/load_lora_adapter", body=body, cast_to=str)
        with pytest.raises(openai.NotFoundError, match="does not exist here"):
            complete("x")
        with pytest.raises(openai.NotFoundError, match="cannot be found"):
            client.post("/unload_lora_adapter", body={"lora_name": "x"}, cast_to=str)
        with pytest.raises(openai.BadRequestError, match="does not pool"):
            client.embeddings.create(model="sql", input="hello")

        text = client.post("/unload_lora_adapter", body={"lora_name": "poet"}, cast_to=str)
        assert "removed successfully" in text
        with pytest.raises(openai.NotFoundError, match="does not exist here"):
            complete("poet")
        assert complete("sql").choices[0].text == oracle["sql"]
        # loaded again under a new id: the same text, no stale cache of the old one
        client.post("/load_lora_adapter", body=load, cast_to=str)
        assert complete("poet").choices[0].text == oracle["poet"]

        # the engine core killed: its replacement loads the adapters the old one held
        killed = engine_pid(proc.pid)
        os.kill(killed, signal.SIGKILL)

        def poke():
            with contextlib.suppress(Exception):
                urllib.request.urlopen(url + "/health", timeout=5).read()

        new_engine_pid(proc.pid, killed, poke)
        for name in ("sql", "poet", base.name):
            out = client.with_options(max_retries=5).completions.create(
                model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert out.choices[0].text == oracle[None if name == base.name else name], name


def test_a_bad_lora_module_stops_the_start_with_the_reason(adapters):
    base, root = adapters
    command = [
        sys.executable, "-m", "ringllm.tools.cli", "serve", "--model", str(base), "--port", "0",
        "--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"big={root / 'big'}",
        *_flags(ENGINE),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "LoRA adapter 'big'" in done.stderr and "above max_lora_rank 16" in done.stderr
    assert "Traceback" not in done.stderr


def test_adapters_of_the_second_of_two_models(adapters, oracle, model_factory):
    """Several base models: an adapter names its base (`base_model_name`); loading it
    loads that model (the first request for it would); a model started without
    --enable-lora refuses adapters; an adapter's request wakes its sleeping model."""
    from ringllm.pipeline.config import EngineConfig
    from ringllm.pipeline.frontend.async_llm import AsyncLLM
    from ringllm.server.model_router import ModelRouter, ModelSpec, RouterPolicy

    base, root = adapters
    lora = {"enable_lora": True, "max_lora_rank": 16}
    specs = [
        ModelSpec("qwen", EngineConfig.from_kwargs(model=str(model_factory("qwen2")),
                                                   enable_sleep_mode=True, **ENGINE), frozenset()),
        ModelSpec("llama", EngineConfig.from_kwargs(model=str(base), enable_sleep_mode=True,
                                                    **lora, **ENGINE), frozenset()),
    ]  # fmt: skip
    router = ModelRouter(
        specs, lambda config: AsyncLLM.from_config(config, multiprocess=False), RouterPolicy()
    )

    async def scenario(client):
        async def complete(model):
            body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            response = await client.post("/v1/completions", json=body)
            return response.status, await response.json()

        load = {"lora_name": "sql", "lora_path": str(root / "sql")}
        response = await client.post("/v1/load_lora_adapter", json=load)  # the first: qwen
        assert response.status == 400
        assert "takes no LoRA adapters" in (await response.json())["error"]["message"]
        assert router.models["llama"].llm is None  # not loaded yet
        response = await client.post(
            "/v1/load_lora_adapter", json={**load, "base_model_name": "llama"}
        )
        assert response.status == 200, await response.text()
        assert router.models["llama"].llm is not None
        status, body = await complete("sql")
        assert status == 200 and body["choices"][0]["text"] == oracle["sql"]
        assert body["model"] == "sql"
        await router.sleep_model(router.models["llama"], 2)
        status, body = await complete("sql")  # wakes llama; the adapter is still there
        assert status == 200 and body["choices"][0]["text"] == oracle["sql"]
        cards = (await (await client.get("/v1/models")).json())["data"]
        assert {c["id"]: c["parent"] for c in cards} == {
            "qwen": None,
            "llama": None,
            "sql": "llama",
        }

    run_with_router(router, scenario)
