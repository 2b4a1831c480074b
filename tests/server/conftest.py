"""A real `ringllm serve` process on a tiny model, shared by the server tests.

The server runs as its own process (`python -m ringllm.tools.cli serve`, the same code as
`ringllm serve`) on 127.0.0.1 with `--port 0`; the fixture reads the URL it prints, and at
the end sends SIGTERM and checks that it exits 0 and leaves no process and no shared
memory behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ringllm.ipc.shm import cleanup_stale
from ringllm.pipeline import LLM

API_KEY = "test-key-5f0c"
MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 2048
MAX_BODY_BYTES = 1 << 20
STARTUP_TIMEOUT_S = 120
URL_LINE = re.compile(r"listening on (http://[\d.]+:(\d+))")
# Engine flags shared by the server and the offline oracle (same numerics).
ENGINE_KWARGS = {
    "dtype": "float32",
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 1024,
    "num_gpu_blocks_override": 2048,
}


@dataclass
class ServerProcess:
    base_url: str
    pid: int
    model_path: Path
    log_path: Path
    api_key: str = API_KEY
    model_name: str = MODEL_NAME
    max_model_len: int = MAX_MODEL_LEN
    max_body_bytes: int = MAX_BODY_BYTES

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def call(
        self,
        method: str,
        path: str,
        body=None,
        data: bytes | None = None,
        headers: dict | None = None,
    ) -> tuple[int, object, str]:
        """One raw HTTP request: (status, JSON body or text, content type). A body goes as
        `Content-Type: application/json` unless `headers` names another."""
        if body is not None:
            data = json.dumps(body).encode()
        headers = dict(self.auth if headers is None else headers)
        if data is not None and not any(k.lower() == "content-type" for k in headers):
            headers["Content-Type"] = "application/json"
        return asyncio.run(self._call(method, path, data, headers))

    async def _call(self, method, path, data, headers) -> tuple[int, object, str]:
        async with aiohttp.ClientSession() as session:
            async with session.request(
                method, self.base_url + path, data=data, headers=headers
            ) as r:
                text = await r.text()
                try:
                    payload = json.loads(text)
                except ValueError:
                    payload = text
                return r.status, payload, r.content_type

    def metrics(self) -> dict[str, float]:
        """Every /metrics sample by name (+ its finished_reason label when it has one)."""
        status, text, _ = self.call("GET", "/metrics")
        assert status == 200
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name
                if "finished_reason" in sample.labels:
                    name += "{" + sample.labels["finished_reason"] + "}"
                values[name] = sample.value
        return values

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _flags(kwargs: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in kwargs.items()]


def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _wait_gone(pids: set[int], timeout_s: float = 10.0) -> list[int]:
    """Children (multiprocessing's resource tracker) exit just after their parent: wait."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _shm_of(pids: set[int]) -> list[str]:
    names = os.listdir("/dev/shm")
    return [n for n in names if any(f"_{pid}_" in n for pid in pids)]


def _wait_for_url(proc: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        match = URL_LINE.search(log_path.read_text(errors="replace"))
        if match:
            return match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server did not start:\n{log_path.read_text(errors='replace')}")


@pytest.fixture(scope="session")
def server_model(model_factory) -> Path:
    return model_factory("llama")


@contextlib.contextmanager
def launched(command_args: list[str], log_dir: Path, stop_signal=signal.SIGTERM, sweep_stale=False):
    """Runs `python -m ringllm.tools.cli serve ARGS`; yields (process, URL, log path); at the end
    sends `stop_signal` and checks a clean exit: code 0, no child left, no shared memory.

    `sweep_stale`: a test that kill -9'd the engine runs what the next instance would
    (`cleanup_stale()`) first, since nothing runs in a kill -9'd process to unlink."""
    log_path = log_dir / "server.log"
    command = [sys.executable, "-m", "ringllm.tools.cli", "serve", *command_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    family = {proc.pid}
    try:
        url = _wait_for_url(proc, log_path)
        yield proc, url, log_path
        family |= _children(proc.pid)
    finally:
        if proc.poll() is None:
            proc.send_signal(stop_signal)
        try:
            returncode = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    assert returncode == 0, log_path.read_text(errors="replace")[-4000:]
    leftovers = _wait_gone(family)
    assert not leftovers, f"processes left running after the server exited: {leftovers}"
    if sweep_stale:
        cleanup_stale()
    assert not _shm_of(family), f"shared memory left behind: {_shm_of(family)}"


# The server must behave the same whether the engine core runs in a thread of the server
# or in its own process over the shared-memory rings: every server test runs on both.
ENGINE_PLACEMENTS = ["--no-engine-process", "--engine-process"]


@pytest.fixture(scope="session", params=ENGINE_PLACEMENTS, ids=["core-thread", "core-process"])
def server(request, server_model, tmp_path_factory):
    args = [
        str(server_model), "--port", "0", "--api-key", API_KEY,
        "--served-model-name", MODEL_NAME, "--max-body-bytes", str(MAX_BODY_BYTES),
        request.param, *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    with launched(args, tmp_path_factory.mktemp("server")) as (proc, url, log_path):
        yield ServerProcess(url, proc.pid, server_model, log_path)


@pytest.fixture(scope="session")
def tool_server(server_model, tmp_path_factory) -> str:
    """The URL of a server that takes tool calls and thinking apart (the shipped hermes
    template and parser, --enable-auto-tool-choice, the qwen3 reasoning parser): the
    structured-output and agent-framework tests share it."""
    args = [
        str(server_model), "--port", "0", "--engine-process", "--chat-template", "hermes",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3", *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    with launched(args, tmp_path_factory.mktemp("tools")) as (_, url, _log):
        yield url


@pytest.fixture(scope="session")
def offline_llm(server_model):
    """The same engine offline, in this process: the oracle for what the server returns."""
    return LLM(server_model, **ENGINE_KWARGS)


@pytest.fixture
def launch_server(tmp_path):
    """`launch_server(args, stop_signal)`: a context manager around one more server process."""

    def launch(args: list[str], stop_signal=signal.SIGTERM, sweep_stale=False):
        return launched(args, tmp_path, stop_signal, sweep_stale)

    return launch


async def stream_greedy_text(session, url: str, prompt: str, max_tokens: int, started=None) -> str:
    """A greedy /v1/completions stream's text (EOS ignored); `started` is set at the first
    chunk; an error chunk fails the test."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
    text = ""
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            if started is not None:
                started.set()
    return text
