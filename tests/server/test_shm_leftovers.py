"""`kill -9` of any mix of a server's children (engine core, its tensor-parallel ranks, the
warm standby core) and then SIGTERM of the server: the server exits
cleanly, no child is left and nothing it or its children made is left in /dev/shm (ringllm
segments, and anything else that appeared, the `multiprocessing` resource tracker's
segments and semaphores included). No `cleanup_stale()` by the test: the server sweeps."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from tests.server.conftest import ENGINE_KWARGS, _children, _flags, launched


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _pick(pids: set[int], role: str) -> list[int]:
    marks = {
        "core": lambda c: b"engine_core_proc" in c and b"--standby" not in c,
        "standby": lambda c: b"--standby" in c,
        "rank": lambda c: b"rank_process" in c,
    }
    return sorted(p for p in pids if marks[role](_cmdline(p)))


async def _one_completion(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        body = {"prompt": "Once upon a time", "max_tokens": 2}
        async with session.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.text()


# (the core alone: the "all" case kills it too, and tests/server/test_engine_restart.py
# checks a lone killed core's segments are swept)
@pytest.mark.parametrize(
    "victims",
    [pytest.param(("rank", "standby"), marks=pytest.mark.slow), ("core", "rank", "standby")],
    ids=["rank+standby", "all"],
)
def test_kill_9_of_children_then_sigterm_leaves_nothing(server_model, tmp_path, victims):
    before = set(os.listdir("/dev/shm"))
    args = [
        str(server_model), "--port", "0", "--engine-process", "--tensor-parallel-size", "2",
        *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    with launched(args, tmp_path) as (proc, url, log_path):
        status, text = asyncio.run(_one_completion(url))
        assert status == 200, text
        family = _descendants(proc.pid)
        killed = [pid for role in victims for pid in _pick(family, role)[:1]]
        assert len(killed) == len(victims), (victims, family)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        # SIGTERM (on leaving the block) while the new core is being started
        deadline = time.monotonic() + 10
        while "restarting it" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
    # launched() sent SIGTERM and checked exit 0, no child left, no segment of the children
    # it knew; the core started meanwhile is new: any ringllm segment made since, whose
    # owner is gone, is the server's (others running at once on this machine keep theirs)
    assert not _left_since(before, proc.pid), _left_since(before, proc.pid)


def _left_since(before: set[str], first_pid: int) -> list[str]:
    left = []
    for name in set(os.listdir("/dev/shm")) - before:
        match = re.match(r"ringllm_(\d+)_", name)
        if match is None:
            if name.startswith(("sem.mp-", "psm_", "mp-")):  # multiprocessing's own
                left.append(name)
        elif int(match[1]) >= first_pid and not os.path.exists(f"/proc/{match[1]}"):
            left.append(name)
    return sorted(left)
