"""Ranks on two "hosts" (network namespaces on a bridge, tests/hosts/netns.py): the head
(`ringllm serve --nnodes 2`, the engine core, its ranks, the HTTP server) in one, a
`ringllm serve --headless --node-rank 1` in the other.

Oracle: the offline single-process engine. PP=2 across the hosts gives its greedy tokens
through the HTTP server and the official `openai` client, streamed and not (TP=2 does in
test_vanished_host.py, before and after its host is lost). A host
that dies (every process of it SIGKILLed) or drops off the network (its link down: no
reset reaches anyone) is noticed within a few seconds and ends the requests with a clear
error; a dead rank on the other host, with engine restarts on, is a restart of the whole
group after which the server serves again.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from ringllm.ipc.shm import cleanup_stale
from tests.hosts.conftest import PROMPTS, TwoHosts
from tests.hosts.netns import hosts_unavailable, make_hosts

pytestmark = pytest.mark.skipif(hosts_unavailable() is not None, reason=str(hosts_unavailable()))

NOTICE_BOUND_S = 6.0  # heartbeat timeout 3 s, polls, the error's way to the client


@pytest.fixture(scope="module")
def expected(offline_outputs):
    return [o.text for o in offline_outputs]


# slow: test_vanished_host.py holds the same bound by default (TP=2, a dropped network,
# restarts on); this is its PP=2 twin with restarts off
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["network-dropped"])
def test_a_lost_host_is_noticed_within_seconds(model, fault, tmp_path):
    """A long stream is under way when the other host goes: it ends with an error within
    the bound, and the server says the engine is dead (restarts off)."""
    with make_hosts(2) as hosts:
        pair = TwoHosts(
            hosts, model, ["--pipeline-parallel-size", "2"], tmp_path, ["--engine-restarts", "0"]
        )
        try:
            outcome: dict = {}
            started = threading.Event()

            def long_stream():
                try:
                    stream = pair.client.completions.create(
                        model=pair.model, prompt="Go on:", max_tokens=400, temperature=0,
                        stream=True, extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    for _ in stream:
                        started.set()
                    outcome["ended"] = "normally"
                except openai.APIError as exc:
                    outcome["ended"] = str(exc)
                outcome["at"] = time.monotonic()

            thread = threading.Thread(target=long_stream)
            thread.start()
            assert started.wait(60)
            lost_at = time.monotonic()
            if fault == "host-killed":
                pair.other.kill_all()
            else:
                pair.other.unplug()
            thread.join(timeout=30)
            assert outcome.get("ended") not in (None, "normally"), outcome
            assert outcome["at"] - lost_at < NOTICE_BOUND_S
            log = pair.head_log.read_text(errors="replace")
            assert "a worker host is gone: host 1" in log
            with pytest.raises(openai.APIStatusError) as refused:
                pair.complete(PROMPTS[:1])
            assert refused.value.status_code == 503
        finally:
            pair.other.kill_all()
            pair.server.send_signal(signal.SIGTERM)
            assert pair.server.wait(timeout=30) == 0
    cleanup_stale()  # the killed host's segments


def test_a_rank_lost_on_the_other_host_restarts_the_group(model, expected, tmp_path):
    """PP=2 across two hosts answers as one process does (completions and streams; TP=2
    across hosts: test_vanished_host.py). Then its rank SIGKILLed, the other host's agent
    tells the head, the supervisor restarts the engine core, the agent serves the new
    engine: the server answers exactly again."""
    with make_hosts(2) as hosts:
        pair = TwoHosts(hosts, model, ["--pipeline-parallel-size", "2"], tmp_path)
        try:
            assert pair.complete(PROMPTS) == expected
            assert [pair.stream(p) for p in PROMPTS[:2]] == expected[:2]
            rank = _rank_pid(pair.agent.pid)
            os.kill(rank, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while True:
                try:
                    assert pair.complete(PROMPTS[:2]) == expected[:2]
                    break
                except openai.APIStatusError as exc:
                    assert exc.status_code == 503, exc
                    assert time.monotonic() < deadline, "the group did not come back"
                    time.sleep(0.5)
            assert "ranks [1] ready" in pair.other_log.read_text(errors="replace")
        finally:
            pair.stop()
    cleanup_stale()


def _rank_pid(agent_pid: int) -> int:
    """The rank process the headless agent started (its one child running a rank)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == agent_pid and b"rank_process" in cmdline:
            return int(entry)
    raise AssertionError("no rank process under the headless agent")
