"""Sleep mode through the server: POST /sleep?level=N, POST /wake_up and GET /is_sleeping,
behind the API key, only with --enable-sleep-mode (else 404). Asleep, a generation request
is a 503 `engine_sleeping` with Retry-After, a stream under way pauses and goes on after the
wake with the text of an undisturbed run, and the official client gets the same greedy text
before and after."""

from __future__ import annotations

import asyncio
import urllib.request

import aiohttp
import openai
import pytest

from tests.server.conftest import (
    API_KEY,
    ENGINE_KWARGS,
    ENGINE_PLACEMENTS,
    _flags,
    stream_greedy_text,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "Story number 7: once upon a time"


def test_without_the_flag_the_endpoints_do_not_exist(server):
    async def run() -> list[int]:
        async with aiohttp.ClientSession(headers=AUTH) as session:
            statuses = []
            for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
                async with session.request(method, server.base_url + path) as r:
                    statuses.append(r.status)
            return statuses

    assert asyncio.run(run()) == [404, 404, 404]


def post(url: str) -> int:
    request = urllib.request.Request(url, method="POST", headers=AUTH)
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.status


# the engine's sleep is the same wherever the core runs: the in-thread placement is a slow
# variant (pytest -m slow)
@pytest.mark.parametrize(
    "placement",
    [pytest.param(ENGINE_PLACEMENTS[0], marks=pytest.mark.slow), ENGINE_PLACEMENTS[1]],
    ids=["core-thread", "core-process"],
)
def test_sleep_and_wake_over_http(server_model, launch_server, placement):
    args = [
        str(server_model), "--port", "0", "--api-key", API_KEY, "--enable-sleep-mode",
        placement, *_flags(ENGINE_KWARGS),
    ]  # fmt: skip

    async def run(url: str) -> dict:
        seen: dict = {}
        async with aiohttp.ClientSession() as anonymous:
            async with anonymous.post(url + "/sleep") as r:
                seen["no key"] = r.status
        async with aiohttp.ClientSession(headers=AUTH) as session:
            async with session.post(url + "/sleep?level=3") as r:
                seen["bad level"] = (r.status, (await r.json())["error"]["param"])
            started = asyncio.Event()
            under_way = asyncio.ensure_future(
                stream_greedy_text(session, url, PROMPT, 300, started)
            )
            await started.wait()
            async with session.post(url + "/sleep?level=1") as r:
                seen["sleep"] = r.status
            async with session.get(url + "/is_sleeping") as r:
                seen["asleep"] = await r.json()
            body = {"prompt": "hi", "max_tokens": 4}
            async with session.post(url + "/v1/completions", json=body) as r:
                seen["refused"] = (
                    r.status, (await r.json())["error"]["code"], r.headers.get("Retry-After")
                )  # fmt: skip
            async with session.get(url + "/health") as r:
                seen["health"] = r.status
            async with session.get(url + "/metrics") as r:
                seen["gauge"] = next(
                    line for line in (await r.text()).splitlines()
                    if line.startswith("ringllm:engine_sleep_level{")
                )  # fmt: skip
            seen["paused"] = not under_way.done()
            async with session.post(url + "/wake_up?tags=bogus") as r:
                seen["bad tag"] = (r.status, (await r.json())["error"]["param"])
            async with session.post(url + "/wake_up?tags=weights") as r:
                seen["weights back"] = r.status
            async with session.get(url + "/is_sleeping") as r:
                seen["still asleep"] = (await r.json())["is_sleeping"]
            async with session.post(url + "/wake_up?tags=kv_cache") as r:
                seen["wake"] = r.status
            async with session.get(url + "/is_sleeping") as r:
                seen["awake"] = await r.json()
            seen["resumed"] = await under_way
            seen["undisturbed"] = await stream_greedy_text(session, url, PROMPT, 300)
        return seen

    with launch_server(args) as (_, url, _log):
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
        name = client.models.list().data[0].id

        def greedy() -> str:
            return (
                client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0)
                .choices[0]
                .text
            )

        before = greedy()
        seen = asyncio.run(run(url))
        after = greedy()
        assert post(url + "/sleep?level=2") == 200
        try:
            client.completions.create(model=name, prompt="hi", max_tokens=2)
            raise AssertionError("an asleep engine took a request")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503
        assert post(url + "/wake_up") == 200
        after_level_2 = greedy()
    assert seen["no key"] == 401
    assert seen["bad level"] == (400, "level")
    assert seen["sleep"] == 200 and seen["asleep"] == {"is_sleeping": True, "sleep_level": 1}
    assert seen["refused"] == (503, "engine_sleeping", "5")
    assert seen["health"] == 200  # asleep is not broken: a load balancer keeps it
    assert seen["gauge"].endswith(" 1.0")
    assert seen["paused"]
    assert seen["bad tag"] == (400, "tags")
    assert seen["weights back"] == 200 and seen["still asleep"] is True
    assert seen["wake"] == 200 and seen["awake"] == {"is_sleeping": False, "sleep_level": 0}
    assert seen["resumed"] == seen["undisturbed"]
    assert before == after == after_level_2
