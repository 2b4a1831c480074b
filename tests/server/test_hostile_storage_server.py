"""A level-1 sleep whose disk is full (issue 30): the sleep answers a 500 `sleep_failed`
that says why, and the engine stays awake and serving, the same greedy text as before."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import urllib.error
import urllib.request

import openai
import pytest

from tests.server.conftest import API_KEY, ENGINE_KWARGS, _flags

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "Story number 7: once upon a time"


@contextlib.contextmanager
def full_tmpfs(path):
    """A 1 MiB tmpfs at `path`, filled to the last byte (root only: else the test skips)."""
    path.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True
    )
    if mount.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.decode(errors='replace')[:200]}")
    try:
        with open(path / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def call(url: str, method: str = "POST") -> tuple[int, dict]:
    request = urllib.request.Request(url, method=method, headers=AUTH)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            body = response.read()
            return response.status, json.loads(body) if body else {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_sleep_whose_disk_is_full_leaves_the_engine_awake(
    server_model, launch_server, tmp_path, monkeypatch
):
    args = [
        str(server_model), "--port", "0", "--api-key", API_KEY, "--enable-sleep-mode",
        "--engine-process", *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    with full_tmpfs(tmp_path / "full") as full:
        monkeypatch.setenv("RINGLLM_SLEEP_DIR", str(full))
        with launch_server(args) as (_, url, log_path):
            client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
            name = client.models.list().data[0].id

            def greedy() -> str:
                completion = client.completions.create(
                    model=name, prompt=PROMPT, max_tokens=16, temperature=0
                )
                return completion.choices[0].text

            before = greedy()
            status, body = call(url + "/sleep?level=1")
            assert status == 500, body
            assert body["error"]["code"] == "sleep_failed"
            message = body["error"]["message"]
            assert f"could not be offloaded to {full}" in message, message
            assert os.strerror(errno.ENOSPC) in message and "stays awake" in message
            assert call(url + "/is_sleeping", "GET") == (
                200,
                {"is_sleeping": False, "sleep_level": 0},
            )
            assert greedy() == before  # every part is there: weights and KV cache
            assert call(url + "/health", "GET")[0] == 200
            # and a sleep that can succeed still does: level 2 writes nothing
            assert call(url + "/sleep?level=2")[0] == 200
            assert call(url + "/wake_up")[0] == 200
            assert greedy() == before
        assert not [p for p in full.iterdir() if p.name != "filler"]  # nothing left there
