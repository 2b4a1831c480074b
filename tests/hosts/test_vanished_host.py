"""A host that vanishes from under a tensor-parallel group (TP=2: rank 0 on the head, rank 1
on the other "host", tests/hosts/netns.py), engine restarts on as by default.

What a user must see: every request in flight, and every new one, ends within seconds with
503 `host_lost` (never waits for a host that is not there); /health is 503 and says which
host was lost and when; once the host is back (its `ringllm serve --headless` started again
after it died, or its network up again) the group is rebuilt and the same server, never
restarted, answers exactly as the single-process engine does. Stopped while it waits for
the host, the head exits at once and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from ringllm.ipc.shm import cleanup_stale, list_segments
from tests.hosts.conftest import PROMPTS, TwoHosts
from tests.hosts.netns import hosts_unavailable, make_hosts

pytestmark = pytest.mark.skipif(hosts_unavailable() is not None, reason=str(hosts_unavailable()))

# the head's setting, which the other host takes from the spec it publishes
HEARTBEAT_TIMEOUT = ["--host-heartbeat-timeout-s", "2"]
NOTICE_BOUND_S = 8.0  # heartbeat timeout 2 s, polls, the error's way to the client
BACK_BOUND_S = 60.0  # the host back -> the server answers again (ranks restarted, model loaded)


@pytest.fixture(scope="module")
def expected(offline_outputs):
    return [o.text for o in offline_outputs]


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as answer:
            return answer.status, {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


class _LongStream(threading.Thread):
    """A stream that is under way when the host goes: how (and when) it ended."""

    def __init__(self, pair: TwoHosts) -> None:
        super().__init__(daemon=True)
        self.pair = pair
        self.started = threading.Event()
        self.error: openai.APIError | None = None
        self.ended_at = 0.0

    def run(self) -> None:
        try:
            stream = self.pair.client.completions.create(
                model=self.pair.model, prompt="Go on:", max_tokens=480, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for _ in stream:
                self.started.set()
        except openai.APIError as exc:
            self.error = exc
        self.ended_at = time.monotonic()


# a killed host's ranks: also test_multi_host.py's rank lost on the other host; the slow
# variant here kills the whole host
@pytest.mark.parametrize(
    "fault", [pytest.param("host-killed", marks=pytest.mark.slow), "network-dropped"]
)
def test_a_vanished_host_fails_requests_at_once_and_the_group_comes_back(
    model, expected, fault, tmp_path
):
    with make_hosts(2) as hosts:
        pair = TwoHosts(hosts, model, ["--tensor-parallel-size", "2"], tmp_path, HEARTBEAT_TIMEOUT)
        try:
            assert pair.complete(PROMPTS[:1]) == expected[:1]
            stream = _LongStream(pair)
            stream.start()
            assert stream.started.wait(60)
            lost_at = time.monotonic()
            if fault == "host-killed":
                pair.other.kill_all()
            else:
                pair.other.unplug()

            stream.join(timeout=NOTICE_BOUND_S + 5)
            assert not stream.is_alive(), "the stream in flight still waits for the lost host"
            assert stream.error is not None, "the stream ended normally without its host"
            assert stream.error.code == "host_lost", stream.error
            assert stream.ended_at - lost_at < NOTICE_BOUND_S

            asked = time.monotonic()
            with pytest.raises(openai.APIStatusError) as refused:
                pair.complete(PROMPTS[:1])
            assert time.monotonic() - asked < 2.0, "a new request waited for the lost host"
            assert refused.value.status_code == 503
            assert refused.value.code == "host_lost"

            status, body = _health(pair.url)
            assert status == 503
            assert body["error"]["code"] == "host_lost"
            assert "host 1" in body["error"]["message"]
            assert "lost at" in body["error"]["message"]

            if fault == "host-killed":
                pair.start_agent()
            else:
                pair.other.plug()
            back_by = time.monotonic() + BACK_BOUND_S
            while True:
                try:
                    assert pair.complete(PROMPTS) == expected
                    break
                except openai.APIStatusError as exc:
                    assert exc.status_code == 503, exc
                    assert time.monotonic() < back_by, "the group was not rebuilt in time"
                    time.sleep(0.5)
            assert pair.stream(PROMPTS[1]) == expected[1]
            assert _health(pair.url)[0] == 200
            assert pair.server.poll() is None  # the same head served throughout
        finally:
            pair.stop()
    cleanup_stale()  # the killed host's segments


def test_the_head_stops_at_once_while_it_waits_for_a_lost_host(model, tmp_path):
    """SIGTERM while the engine waits for a host cut off: the head exits 0 within seconds
    (the core's start that waits is abandoned) and neither it nor any of its children
    leaves a process or a segment behind."""
    with make_hosts(2) as hosts:
        pair = TwoHosts(hosts, model, ["--tensor-parallel-size", "2"], tmp_path, HEARTBEAT_TIMEOUT)
        try:
            pair.other.unplug()
            lost_by = time.monotonic() + NOTICE_BOUND_S
            while _health(pair.url)[0] == 200:
                assert time.monotonic() < lost_by, "the cut-off host was not noticed"
                time.sleep(0.2)
            time.sleep(1.0)  # the new core is up, waiting for the host
            head = [pair.server.pid, *_descendants(pair.server.pid)]
            pair.server.send_signal(signal.SIGTERM)
            assert pair.server.wait(timeout=15) == 0
        finally:
            pair.stop()
    gone_by = time.monotonic() + 10  # the abandoned core may still be removing its rings
    while any(map(_running, head)) and time.monotonic() < gone_by:
        time.sleep(0.2)
    assert not [pid for pid in head if _running(pid)]
    assert not [n for n in list_segments() if int(n.split("_")[1]) in head]


def _running(pid: int) -> bool:
    """Not exited (an orphan that exited may wait a while for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
