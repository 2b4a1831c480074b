"""Shared fixtures of the ipc tests: no test may leave a ringllm segment in /dev/shm."""

from __future__ import annotations

import pytest

from ringllm.ipc.shm import cleanup_stale, list_segments


@pytest.fixture(scope="session", autouse=True)
def no_segments_left_behind():
    # Other engineers' processes may own segments while these tests run: only the ones
    # that appear during this session are ours to account for.
    cleanup_stale()
    before = set(list_segments())
    yield
    left = sorted(set(list_segments()) - before)
    assert not left, f"ringllm segments left in /dev/shm after the ipc tests: {left}"
