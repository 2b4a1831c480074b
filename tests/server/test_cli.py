"""`ringllm serve` as a command: its flags, its startup lines, and SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ringllm.server.cli import _engine_config, configure_parser


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(argv)


def test_flags_reach_the_engine_config():
    args = parse(["/m", "--port", "0", "--api-key", "k", "--max-num-seqs", "8", "--dtype", "float32",
                  "--served-model-name", "mine", "--no-enable-prefix-caching"])  # fmt: skip
    config = _engine_config(args)
    assert config.model.model == "/m" and config.model.dtype == "float32"
    assert config.model.served_model_name == "mine"
    assert config.scheduler.max_num_seqs == 8
    assert config.cache.enable_prefix_caching is False
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 0, "k")
    assert _engine_config(parse([])).model.model is None  # the demo model


def test_serve_on_a_cpu_schedules_512_tokens_a_step_unless_told():
    assert _engine_config(parse(["--device", "cpu"])).scheduler.max_num_batched_tokens == 512
    given = parse(["--device", "cpu", "--max-num-batched-tokens", "4096"])
    assert _engine_config(given).scheduler.max_num_batched_tokens == 4096
    # without chunked prefill a prompt must fit one step: the engine's own default stays
    whole = _engine_config(parse(["--device", "cpu", "--no-enable-chunked-prefill"]))
    assert whole.scheduler.max_num_batched_tokens == 2048


def test_model_given_twice_differently_is_refused():
    with pytest.raises(SystemExit, match="disagree"):
        _engine_config(parse(["/a", "--model", "/b"]))


@pytest.mark.parametrize(
    "placement,stop_signal",
    [("--no-engine-process", signal.SIGINT), ("--engine-process", signal.SIGINT)],
    ids=["core-thread", "core-process"],
)
def test_prints_url_and_stops_cleanly_on_sigint(
    launch_server, server_model, placement, stop_signal
):
    args = [str(server_model), "--port", "0", placement, "--dtype", "float32",
            "--num-gpu-blocks-override", "64"]  # fmt: skip
    with launch_server(args, stop_signal) as (_, url, log_path):
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url) and not url.endswith(":0")
        with urllib.request.urlopen(url + "/health") as response:
            assert response.status == 200
        # no --api-key: the API is open
        with urllib.request.urlopen(url + "/v1/models") as response:
            assert Path(server_model).name.encode() in response.read()
        log = log_path.read_text()
        instance = re.search(r"engine IPC instance (\S+)", log)
        assert (instance is not None) == (placement == "--engine-process")
    assert "shutting down" in log_path.read_text()
    if instance is not None:
        assert not list(Path("/dev/shm").glob(instance.group(1) + "*"))


def test_killed_engine_process_fails_requests_and_health(launch_server, server_model):
    """Without supervision (--engine-restarts 0; with it, see test_engine_restart.py)."""
    args = [str(server_model), "--port", "0", "--engine-process", "--dtype", "float32",
            "--num-gpu-blocks-override", "64", "--engine-restarts", "0"]  # fmt: skip
    with launch_server(args, sweep_stale=True) as (proc, url, _):
        engine_pids = [
            pid for pid in _children(proc.pid)
            if b"engine_core_proc" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]  # fmt: skip
        assert len(engine_pids) == 1
        os.kill(engine_pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (status := _status(url + "/health")) == 200:
            assert time.monotonic() < deadline, "/health still 200 after the engine was killed"
            time.sleep(0.05)
        assert status == 503
        body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
        request = urllib.request.Request(
            url + "/v1/completions",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(request)
        assert failed.value.code == 503
        error = json.loads(failed.value.read())["error"]
        assert error["code"] == "engine_dead"
        # what died and how is the operator's (the log), not the client's
        assert str(engine_pids[0]) not in error["message"] and "ringllm_" not in error["message"]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare"
)
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_as_pid_1_of_its_own_pid_namespace(server_model, tmp_path, stop):
    """A container without an init: the server is PID 1, so its engine core sees a parent
    pid of 1 from the start, which must not read as "my parent died". It serves, and the
    signal that stops a container stops everything, leaving nothing in /dev/shm."""
    log_path = tmp_path / "server.log"
    command = [
        "unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "ringllm.tools.cli",
        "serve", str(server_model), "--port", "0", "--dtype", "float32",
        "--max-model-len", "256", "--num-gpu-blocks-override", "64",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (match := re.search(r"listening on (http://\S+)", log_path.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        url = match.group(1)
        (server,) = _children(proc.pid)  # PID 1 inside, this pid outside
        with open(f"/proc/{server}/status") as f:
            assert re.search(r"NSpid:\s+\d+\s+1\n", f.read())
        # segment names carry the pids inside the namespace: those of the server's family
        inner = {1} | {_inner_pid(pid) for pid in _children(server)}
        body = json.dumps({"prompt": "hi", "max_tokens": 4, "ignore_eos": True}).encode()
        request = urllib.request.Request(
            url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 4
        os.kill(server, stop)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"ringllm_{p}_") for p in inner)]
    assert not left, left


def _inner_pid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"NSpid:\s+\d+\s+(\d+)", f.read()).group(1))


def test_sigterm_drains_then_ends_what_is_left(server_model, tmp_path):
    """SIGTERM: /health and new requests answer 503 at once; a short stream in flight runs
    to its end; one that cannot end within --shutdown-timeout gets an in-band error; a
    background response is cancelled; the server then exits 0, leaving nothing behind."""
    import asyncio

    import aiohttp

    from tests.server.conftest import launched

    args = [
        str(server_model), "--port", "0", "--engine-process", "--dtype", "float32",
        "--max-model-len", "2048", "--max-num-seqs", "8", "--shutdown-timeout", "4",
    ]  # fmt: skip
    short = {
        "prompt": "a", "max_tokens": 32, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    # 32 choices of 2,000 tokens, 8 at a time: thousands of steps, far past 4 s
    long = {"prompt": "b", "max_tokens": 2000, "n": 32, "ignore_eos": True, "stream": True}

    async def events(response) -> list:
        out = []
        async for line in response.content:
            if line.startswith(b"data: "):
                out.append(line[6:].strip())
        return out

    async def run(url: str, pid: int):
        async with aiohttp.ClientSession() as session:
            long_r = await session.post(url + "/v1/completions", json=long)
            short_r = await session.post(url + "/v1/completions", json=short)
            assert long_r.status == short_r.status == 200
            # a background response, which no connection waits for: it ends with the server
            body = {"input": "c", "max_output_tokens": 1900, "background": True}
            async with session.post(url + "/v1/responses", json=body) as r:
                assert r.status == 200 and (await r.json())["status"] in ("queued", "in_progress")
            await long_r.content.readline()
            os.kill(pid, signal.SIGTERM)
            while True:  # the drain has begun once /health says so
                async with session.get(url + "/health") as r:
                    if r.status == 503:
                        health = await r.json()
                        break
                await asyncio.sleep(0.02)
            async with session.post(url + "/v1/completions", json=short) as r:
                refused = r.status, r.headers.get("Retry-After"), await r.json()
            short_events, long_events = await asyncio.gather(events(short_r), events(long_r))
            return health, refused, short_events, long_events

    with launched(args, tmp_path) as (proc, url, _):
        health, refused, short_events, long_events = asyncio.run(run(url, proc.pid))
        assert proc.wait(timeout=60) == 0  # (launched checks nothing is left behind)
    assert health["error"]["code"] == "server_shutting_down"
    status, retry_after, body = refused
    assert status == 503 and retry_after == "1"
    assert body["error"]["code"] == "server_shutting_down"
    # the short one ran to its end
    assert short_events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in short_events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 32
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1] == "length"
    # the long one was ended, and told why
    assert long_events[-1] == b"[DONE]"
    last = json.loads(long_events[-2])
    assert last["error"]["code"] == "server_shutting_down", last
