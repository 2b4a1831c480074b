"""Test "hosts" on one machine: network namespaces joined by a bridge.

`make_hosts(n)` makes n namespaces, each with its loopback and one veth into a bridge in the
test's own namespace, on a /24 of 10.x.y.0 picked at random (the bridge is .254, host i is
.i+1): each "host" has its own address, its own loopback and its own ports, and reaches
the others (and the test, at .254) only over the bridge. Nothing else is on that network:
no route leaves it. Shared memory (/dev/shm) is still the machine's, as the mount
namespace is: the rings stay per "host" only because their names are unique.

Needs root (CAP_NET_ADMIN) and iproute2's `ip`; `hosts_unavailable()` says why not, for a
skip reason. Everything made is removed on exit, processes started in a namespace first.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field


def hosts_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to make network namespaces (CI runs as root)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip command for network namespaces"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    namespace: str
    address: str
    veth: str  # its link's end in the test's namespace (down: the host drops off the network)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def popen(self, command: list[str], **kwargs) -> subprocess.Popen:
        """`command` in this host's namespace, in a process group of its own."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace, *command], start_new_session=True, **kwargs
        )
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        """SIGKILL to every process started here and to their children (the host dies)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def unplug(self) -> None:
        """The network drops: its link goes down, with no reset sent to anyone."""
        _ip("link", "set", self.veth, "down")

    def plug(self) -> None:
        """The network is back: its link up again."""
        _ip("link", "set", self.veth, "up")


@contextlib.contextmanager
def make_hosts(count: int):
    tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
    subnet = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
    bridge = f"rlb{tag}"
    hosts: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(count):
            namespace, outer, inner = f"rl{tag}h{i}", f"rlv{tag}{i}", f"rli{tag}{i}"
            _ip("netns", "add", namespace)
            hosts.append(Host(namespace, f"{subnet}.{i + 1}", outer))
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", namespace)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            for args in (
                ("addr", "add", f"{subnet}.{i + 1}/24", "dev", inner),
                ("link", "set", inner, "up"),
                ("link", "set", "lo", "up"),
            ):
                _ip("netns", "exec", namespace, "ip", *args)
        yield hosts
    finally:
        for host in hosts:
            host.kill_all()
        for host in hosts:
            # the veth first: a namespace outlives its deletion while sockets made in it
            # linger (a connection cut by unplug() retransmits for minutes), its links too
            for args in (("link", "del", host.veth), ("netns", "del", host.namespace)):
                with contextlib.suppress(subprocess.CalledProcessError):
                    _ip(*args)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", bridge)


def wait_for_line(path, needle: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> str:
    """The first line of the log at `path` holding `needle` (the process must stay up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        for line in text.splitlines():
            if needle in line:
                return line
        if proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {needle!r}:\n{text[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"no {needle!r} within {timeout_s:.0f} s:\n{text[-3000:]}")
