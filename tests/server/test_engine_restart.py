"""A supervised engine core: `kill -9` it under load and the server restarts it and
replays every unfinished request, so each stream goes on where it stopped (greedy: the text
of an undisturbed run); a crash loop ends in today's 503 engine_dead."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aiohttp

from ringllm.pipeline import SamplingParams
from tests.server.conftest import (
    ENGINE_KWARGS,
    _children,
    _flags,
    launched,
    stream_greedy_text,
)

PROMPTS = [f"Story number {i}: once upon a time" for i in range(32)]  # the shape
MAX_TOKENS = 64


def engine_pid(server_pid: int) -> int:
    (pid,) = [pid for pid in _children(server_pid) if is_core(pid)]
    return pid


def new_engine_pid(server_pid: int, old: int, poke, timeout_s: float = 120.0) -> int:
    """The engine core that replaced `old`, once there is one. An idle server notices a
    death at a health check (`poke`), and one right after the kill may still answer 200 from
    before it, so this pokes until the new core is there."""
    deadline = time.monotonic() + timeout_s
    while True:
        poke()
        cores = [p for p in _children(server_pid) if p != old and is_core(p)]
        if len(cores) == 1:
            return cores[0]
        assert time.monotonic() < deadline, f"no new engine core after {timeout_s} s: {cores}"
        time.sleep(0.05)


def is_core(pid: int) -> bool:
    """An engine core: started as one, or a standby (`--standby` on its command line) that
    became one (it then has the core's segments, named by its pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return False
    if b"engine_core_proc" not in cmdline:
        return False
    return b"--standby" not in cmdline or bool(segments_of(pid))


def segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"ringllm_{pid}_")]


def restarts(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("ringllm:engine_restarts_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no ringllm:engine_restarts_total in /metrics")


def test_kill_9_mid_stream_every_stream_completes_as_if_nothing_happened(
    server_model, offline_llm, tmp_path
):
    expected = [
        o.outputs[0].text
        for o in offline_llm.generate(
            PROMPTS,
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    ]
    args = [str(server_model), "--port", "0", "--engine-process", *_flags(ENGINE_KWARGS)]

    async def run(url: str, server_pid: int):
        async with aiohttp.ClientSession() as session:
            started = [asyncio.Event() for _ in PROMPTS]
            streams = [
                asyncio.ensure_future(stream_greedy_text(session, url, p, MAX_TOKENS, e))
                for p, e in zip(PROMPTS, started, strict=True)
            ]
            await asyncio.gather(*(e.wait() for e in started))
            killed = engine_pid(server_pid)
            os.kill(killed, signal.SIGKILL)
            # a request sent while the core is down waits for the new one
            late = asyncio.ensure_future(
                session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            )
            health = []
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                async with session.get(url + "/health") as r:
                    body = await r.text()
                    health.append((r.status, json.loads(body)["error"]["code"] if body else ""))
                    if r.status == 200 and len(health) > 1:
                        break
                await asyncio.sleep(0.05)
            texts = await asyncio.gather(*streams)
            late_response = await late
            late_status = late_response.status
            late_response.release()
            async with session.get(url + "/metrics") as r:
                metrics = await r.text()
            return killed, texts, health, late_status, metrics

    with launched(args, tmp_path) as (proc, url, log_path):
        killed, texts, health, late_status, metrics = asyncio.run(run(url, proc.pid))
        assert engine_pid(proc.pid) != killed
    assert "standby 1" in log_path.read_text()  # the warm spare took over (the default)
    assert texts == expected  # no token lost, none repeated, greedy as undisturbed
    assert (503, "engine_restarting") in health and health[-1][0] == 200
    assert late_status == 200
    assert restarts(metrics) == 1
    assert not segments_of(killed)  # the supervisor swept what the killed core left


def test_a_crash_loop_ends_in_engine_dead(server_model, tmp_path):
    args = [
        str(server_model), "--port", "0", "--engine-process", "--engine-restarts", "1",
        *_flags(ENGINE_KWARGS),
    ]  # fmt: skip

    async def health(url: str) -> tuple[int, str]:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as r:
                body = await r.text()
                return r.status, json.loads(body)["error"]["code"] if body else ""

    def wait_for(url: str, wanted: tuple[int, str]) -> None:
        deadline = time.monotonic() + 120
        while (got := asyncio.run(health(url))) != wanted:
            assert time.monotonic() < deadline, got
            time.sleep(0.05)

    with launched(args, tmp_path, sweep_stale=True) as (proc, url, _):
        first = engine_pid(proc.pid)
        os.kill(first, signal.SIGKILL)
        second = new_engine_pid(proc.pid, first, lambda: asyncio.run(health(url)))
        wait_for(url, (200, ""))  # restarted once
        os.kill(second, signal.SIGKILL)  # two deaths within the window: a crash loop
        wait_for(url, (503, "engine_dead"))
        time.sleep(1.0)
        assert asyncio.run(health(url)) == (503, "engine_dead")  # and it stays down
        assert not [
            p
            for p in _children(proc.pid)
            if b"engine_core_proc" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]


def test_kill_9_of_a_tensor_parallel_rank_restarts_the_group(server_model, offline_llm, tmp_path):
    """--tensor-parallel-size 2: rank 1 killed mid-stream ends its engine core; the server
    starts the whole group again (core and ranks) and every stream completes as undisturbed."""
    prompts = PROMPTS[:8]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline_llm.generate(prompts, params, use_tqdm=False)]
    args = [
        str(server_model), "--port", "0", "--engine-process", "--tensor-parallel-size", "2",
        *_flags(ENGINE_KWARGS),
    ]  # fmt: skip

    def rank_pids(server_pid: int) -> list[int]:
        core = engine_pid(server_pid)
        return sorted(
            p for p in _children(core)
            if b"rank_process" in Path(f"/proc/{p}/cmdline").read_bytes()
        )  # fmt: skip

    async def run(url: str, server_pid: int):
        async with aiohttp.ClientSession() as session:
            started = [asyncio.Event() for _ in prompts]
            streams = [
                asyncio.ensure_future(stream_greedy_text(session, url, p, MAX_TOKENS, e))
                for p, e in zip(prompts, started, strict=True)
            ]
            await asyncio.gather(*(e.wait() for e in started))
            old_core, old_ranks = engine_pid(server_pid), rank_pids(server_pid)
            os.kill(old_ranks[1], signal.SIGKILL)
            texts = await asyncio.gather(*streams)
            async with session.get(url + "/metrics") as r:
                metrics = await r.text()
            return old_core, old_ranks, texts, metrics

    with launched(args, tmp_path) as (proc, url, _):
        old_core, old_ranks, texts, metrics = asyncio.run(run(url, proc.pid))
        new_ranks = rank_pids(proc.pid)
        assert engine_pid(proc.pid) != old_core and len(new_ranks) == 2
        assert not set(new_ranks) & set(old_ranks)
    assert texts == expected
    assert restarts(metrics) == 1
    for pid in [old_core, *old_ranks]:
        assert not os.path.exists(f"/proc/{pid}")
