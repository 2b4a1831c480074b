"""The real server against clients that mean harm or just misbehave: other hosts' pages,
clients that hold many requests, never read, flood the engine, or send a request the engine
fails on. Each costs that client, never the others, the event loop or the engine.

The `guarded` server runs without an API key (so the Host check is on), with the engine in
its own process and fault points armed for marked seeds (`RINGLLM_TEST_FAULTS`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.conftest import environment
from tests.server.conftest import ENGINE_KWARGS, _children, _flags, launched

FORWARD_SEED, SAMPLE_SEED = 7771, 7772
RUNNING = "ringllm:num_requests_running"
KV_USAGE = "ringllm:kv_cache_usage_perc"


class Guarded:
    def __init__(self, url: str, pid: int, model_path: Path, log_path: Path) -> None:
        self.url, self.pid, self.model_path, self.log_path = url, pid, model_path, log_path
        self.port = int(url.rsplit(":", 1)[1])

    def get(self, path: str, headers=None):
        return asyncio.run(request("GET", self.url + path, headers=headers))

    def post(self, path: str, body: dict, headers=None):
        return asyncio.run(request("POST", self.url + path, body, headers))

    def metric(self, name: str) -> float:
        status, text, _ = self.get("/metrics")
        assert status == 200
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no {name} in /metrics")

    def aborted(self) -> float:
        """Requests ended as aborted, so far."""
        status, text, _ = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith("ringllm:request_success_total{") and 'reason="abort"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def engine_pid(self) -> int:
        for pid in _children(self.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            standby_unused = b"--standby" in cmdline and not any(
                name.startswith(f"ringllm_{pid}_") for name in os.listdir("/dev/shm")
            )
            if b"engine_core_proc" in cmdline and not standby_unused:
                return pid
        raise AssertionError("no engine core process under the server")


async def request(method: str, url: str, body=None, headers=None):
    """(status, JSON or text, headers)."""
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, json=body, headers=headers) as r:
            text = await r.text()
            try:
                payload = json.loads(text)
            except ValueError:
                payload = text
            return r.status, payload, r.headers


@pytest.fixture(scope="module")
def guarded(server_model, tmp_path_factory):
    args = [
        str(server_model), "--port", "0", "--engine-process",
        "--stream-write-timeout-s", "1", "--max-queued-outputs", "64",
        "--request-ring-wait-s", "0.5", *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    with environment(RINGLLM_TEST_FAULTS=f"forward={FORWARD_SEED},sample={SAMPLE_SEED}"):
        server = launched(args, tmp_path_factory.mktemp("guarded"))
        proc, url, log_path = server.__enter__()
    try:
        yield Guarded(url, proc.pid, server_model, log_path)
    finally:
        server.__exit__(None, None, None)


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def assert_openai_error(body, code: str | None = None) -> None:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    if code is not None:
        assert error["code"] == code, error


# ---- who may ask -------------------------------------------------------------------


def test_without_a_key_only_this_machine_is_answered(guarded):
    for host in ("evil.example", "evil.example:80", "192.0.2.7"):
        status, body, _ = guarded.get("/v1/models", headers={"Host": host})
        assert status == 403, host
        assert_openai_error(body, "host_not_allowed")
    for host in (f"localhost:{guarded.port}", f"127.0.0.1:{guarded.port}", "localhost"):
        assert guarded.get("/v1/models", headers={"Host": host})[0] == 200, host
    # a DNS-rebinding page: right Host (it resolved to us), foreign Origin
    body = {"prompt": "hi", "max_tokens": 1}
    status, error, _ = guarded.post(
        "/v1/completions", body, headers={"Origin": "http://evil.example"}
    )
    assert status == 403
    assert_openai_error(error, "host_not_allowed")
    ok = guarded.post(
        "/v1/completions", body, headers={"Origin": f"http://localhost:{guarded.port}"}
    )
    assert ok[0] == 200


def test_the_model_is_named_by_its_folder_never_its_path(guarded):
    status, body, _ = guarded.get("/v1/models")
    assert status == 200
    assert [m["id"] for m in body["data"]] == [guarded.model_path.name]
    assert str(guarded.model_path.parent) not in json.dumps(body)
    # a client started with the path (as vLLM names it) is still served, under the name
    status, out, _ = guarded.post(
        "/v1/completions", {"model": str(guarded.model_path), "prompt": "hi", "max_tokens": 1}
    )
    assert status == 200 and out["model"] == guarded.model_path.name


# ---- a request the engine fails on ---------------------------------------------------


def test_a_request_the_engine_fails_on_is_a_500_and_the_others_are_served(guarded, offline_llm):
    from ringllm.pipeline import SamplingParams

    prompts = ["The quick brown fox", "Once upon a time", "def main():"]
    expected = [
        o.outputs[0].text
        for o in offline_llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )
    ]

    async def run():
        async with openai.AsyncOpenAI(
            base_url=guarded.url + "/v1", api_key="none", max_retries=0, timeout=120
        ) as client:
            model = guarded.model_path.name

            async def good(prompt):
                out = await client.completions.create(
                    model=model, prompt=prompt, max_tokens=12, temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                return out.choices[0].text

            async def bad(seed, stream):
                try:
                    if stream:
                        async for _ in await client.chat.completions.create(
                            model=model, messages=[{"role": "user", "content": "hi"}],
                            max_tokens=12, seed=seed, stream=True,
                        ):  # fmt: skip
                            pass
                    else:
                        await client.completions.create(
                            model=model, prompt="hi", max_tokens=12, seed=seed
                        )
                except openai.InternalServerError as exc:
                    return exc
                return None

            return await asyncio.gather(
                good(prompts[0]), bad(FORWARD_SEED, False), good(prompts[1]),
                bad(SAMPLE_SEED, True), good(prompts[2]),
            )  # fmt: skip

    got = asyncio.run(run())
    assert [got[0], got[2], got[4]] == expected
    for failed in (got[1], got[3]):
        assert isinstance(failed, openai.InternalServerError), failed
        assert failed.status_code == 500 and failed.body["code"] == "request_failed"
        assert "Injected" not in str(failed.body)  # the cause is in the log, not the answer
    assert guarded.get("/health")[0] == 200
    assert wait_for(lambda: guarded.metric(RUNNING) == 0)


# ---- a client that holds on --------------------------------------------------------


def test_a_stream_nobody_reads_is_dropped_and_its_kv_freed(guarded):
    """A raw socket with a tiny receive window sends a long streaming request and reads
    nothing: the stream's writes stall, the server drops it after --stream-write-timeout-s
    (its request aborted in the engine), while it keeps serving everyone else."""
    body = json.dumps(
        # 16 x 2000 tokens with top-5 logprobs: some 16 MB of events, past any socket buffer
        {
            "prompt": "x",
            "n": 16,
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 5,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{guarded.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    aborted_before = guarded.aborted()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", guarded.port))
    try:
        sock.sendall(head + body)
        # served meanwhile
        status, out, _ = guarded.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        # dropped although its socket is still open: its 16 choices ended as aborted (they
        # would take far longer to run out), nothing runs, no KV held
        assert wait_for(lambda: guarded.aborted() == aborted_before + 16, 30)
        assert wait_for(lambda: guarded.metric(RUNNING) == 0, 10)
        assert wait_for(lambda: guarded.metric(KV_USAGE) == 0, 10)
    finally:
        sock.close()
    assert guarded.get("/health")[0] == 200


def test_a_full_request_ring_is_a_503_and_nothing_is_lost(guarded):
    """The engine stops reading (SIGSTOP): requests fill its request ring, the next ones
    get 503 + Retry-After after --request-ring-wait-s, the event loop answers /health all
    along; once the engine reads again every request that got in completes."""
    engine = guarded.engine_pid()
    body = {"prompt": "hi", "max_tokens": 1, "n": 256}

    async def run():
        async with aiohttp.ClientSession() as session:

            async def one():
                async with session.post(guarded.url + "/v1/completions", json=body) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            tasks = [asyncio.ensure_future(one()) for _ in range(24)]
            await asyncio.sleep(3)  # the ring fills; the rest wait 0.5 s for room, then 503
            start = time.monotonic()
            async with session.get(guarded.url + "/health") as r:
                health = r.status, time.monotonic() - start
            os.kill(engine, signal.SIGCONT)
            return await asyncio.gather(*tasks), health

    os.kill(engine, signal.SIGSTOP)
    try:
        results, (health_status, health_s) = asyncio.run(run())
    finally:
        os.kill(engine, signal.SIGCONT)
    assert health_status == 200 and health_s < 1.0
    statuses = [status for status, _, _ in results]
    assert 200 in statuses and 503 in statuses, statuses
    for status, retry_after, out in results:
        if status == 503:
            assert retry_after is not None
            assert_openai_error(out, "server_busy")
        else:
            assert status == 200 and len(out["choices"]) == 256
    assert wait_for(lambda: guarded.metric(RUNNING) == 0)


def test_the_concurrency_limit_is_a_503_with_retry_after(server_model, launch_server):
    args = [
        str(server_model), "--port", "0", "--no-engine-process",
        "--max-concurrent-requests", "2", *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    long = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}

    async def run(url):
        async with aiohttp.ClientSession() as session:
            held = [await session.post(url + "/v1/completions", json=long) for _ in range(2)]
            for r in held:
                assert r.status == 200
                await r.content.readline()  # it is streaming: it counts
            async with session.post(
                url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}
            ) as r:
                refused = r.status, r.headers.get("Retry-After"), await r.json()
            async with session.get(url + "/health") as r:
                health = r.status  # not a generation: never refused
            for r in held:
                r.close()
            await asyncio.sleep(0.5)
            async with session.post(
                url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}
            ) as r:
                after = r.status
            # background responses hold no connection: the same limit counts them running
            background = {"input": "x", "max_output_tokens": 1500, "background": True}
            for _ in range(2):
                async with session.post(url + "/v1/responses", json=background) as r:
                    assert r.status == 200
            async with session.post(url + "/v1/responses", json=background) as r:
                third = r.status, await r.json()
            return refused, health, after, third

    with launch_server(args) as (_, url, _):
        (status, retry_after, body), health, after, third = asyncio.run(run(url))
    assert status == 503 and retry_after == "1"
    assert_openai_error(body, "server_busy")
    assert "--max-concurrent-requests" in body["error"]["message"]
    assert health == 200 and after == 200
    assert third[0] == 503 and "background responses are running" in third[1]["error"]["message"]


# ---- a client that asks for everything -----------------------------------------------


def test_a_request_of_many_choices_does_not_starve_a_small_one(server_model, launch_server):
    """256 choices that would run to the context, and a 4-token request sent after them:
    the small one completes while the big stream has had under an eighth of its tokens
    (fair share across HTTP requests, not first come first served)."""
    big = {
        "prompt": "Once", "n": 256, "max_tokens": 400, "ignore_eos": True,
        "stream": True, "temperature": 1.0,
    }  # fmt: skip

    async def run(url):
        async with aiohttp.ClientSession() as session:
            tokens = 0
            async with session.post(url + "/v1/completions", json=big) as r:
                assert r.status == 200
                await r.content.readline()
                small = asyncio.ensure_future(
                    request(
                        "POST", url + "/v1/completions",
                        {"prompt": "hi", "max_tokens": 4, "ignore_eos": True},
                    )
                )  # fmt: skip
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        assert "choices" in chunk, chunk
                        tokens += sum(1 for c in chunk["choices"] if c["text"])
                    if small.done():
                        break
                status, out, _ = await small
            return tokens, status, out

    args = [str(server_model), "--port", "0", "--engine-process", *_flags(ENGINE_KWARGS)]
    with launch_server(args) as (_, url, _):
        tokens, status, out = asyncio.run(run(url))
    assert status == 200 and out["usage"]["completion_tokens"] == 4
    # without fair share it would wait for the first 64 choices (max_num_seqs) to end: 1/4
    assert tokens < 256 * 400 // 8, tokens


# ---- a client that sends megabytes ---------------------------------------------------


def test_two_megabyte_prompts_never_stall_the_event_loop(model_factory, launch_server):
    """Two 1.5 MB chat prompts at once on a model served with a 512K-token context: their
    tokenizing (seconds of GIL-holding Python in tokenizers) happens in the tokenizer
    process, so /health keeps answering at once; both are refused by their token count
    (about 1 M tokens each). (The report was of 12 MB prompts: an eighth of
    the size, six times the child tokenizer's 256K-character threshold, is the same path.)"""
    model = model_factory("llama", max_position_embeddings=1 << 20)
    args = [
        str(model), "--port", "0", "--engine-process", "--dtype", "float32",
        "--max-model-len", str(1 << 19), "--num-gpu-blocks-override", "256",
        "--max-body-bytes", str(64 << 20),
    ]  # fmt: skip
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "quick", "lazy"]
    text = " ".join(rng.choice(words) for _ in range(270_000))[:1_500_000]
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}

    async def run(url):
        async with aiohttp.ClientSession() as session:

            async def big():
                start = time.monotonic()
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    return r.status, await r.json(), time.monotonic() - start

            tasks = [asyncio.ensure_future(big()) for _ in range(2)]
            await asyncio.sleep(0.2)
            waits = []
            while not all(t.done() for t in tasks):
                start = time.monotonic()
                async with session.get(url + "/health") as r:
                    assert r.status == 200
                waits.append(time.monotonic() - start)
                await asyncio.sleep(0.05)
            return await asyncio.gather(*tasks), waits

    with launch_server(args) as (_, url, _):
        results, waits = asyncio.run(run(url))
    for status, out, _ in results:
        assert status == 400, out
        assert "tokens leave no room for output within max_model_len" in out["error"]["message"]
    busy_s = min(seconds for _, _, seconds in results)
    # /health was asked all along, and its slowest answer took a small part of the time
    # the big prompts took (ratio measured side by side, not a wall-clock bound)
    assert len(waits) >= 5
    assert max(waits) < busy_s / 10, (max(waits), busy_s)


def test_echo_with_logprobs_survives_preemption(server_model, launch_server):
    """Four echo + logprobs requests that cannot all fit a tiny KV cache: some are preempted
    and recompute their prompt; each answer still has one logprob row per prompt token and
    per output token (the recomputed rows are not sent twice)."""
    args = [
        str(server_model), "--port", "0", "--engine-process", "--dtype", "float32",
        "--max-model-len", "512", "--num-gpu-blocks-override", "24",
    ]  # fmt: skip
    prompt = "The history of the city begins in the old harbour, where the river " * 4
    body = {"prompt": prompt, "max_tokens": 60, "ignore_eos": True, "echo": True, "logprobs": 1}

    async def run(url):
        async with aiohttp.ClientSession() as session:

            async def one():
                async with session.post(url + "/v1/completions", json=body) as r:
                    return r.status, await r.json()

            answers = await asyncio.gather(*(one() for _ in range(4)))
            async with session.post(url + "/tokenize", json={"prompt": prompt}) as r:
                tokens = (await r.json())["count"]
            async with session.get(url + "/metrics") as r:
                metrics = await r.text()
            return answers, tokens, metrics

    with launch_server(args) as (_, url, _):
        answers, num_prompt, metrics = asyncio.run(run(url))
    preemptions = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("ringllm:num_preemptions_total")
    ]
    assert preemptions and preemptions[0] > 0  # the case this test is about happened
    for status, out in answers:
        assert status == 200, out
        rows = out["choices"][0]["logprobs"]["token_logprobs"]
        assert len(rows) == num_prompt + 60
        assert rows[0] is None and all(isinstance(x, float) for x in rows[1:])
        assert out["choices"][0]["text"].startswith(prompt)
