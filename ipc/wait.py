"""Waiting for a counter in shared memory to move: spin, yield, then sleep on a futex.

A waiter (a reader waiting for records, a writer waiting for free slots) goes through
three phases, cheapest wake-up first:

    spin   `spin_s` of checks of the counter      catches a peer that answers quickly
    yield  `yield_iters` sched_yield() + check     off by default: see WaitPolicy
    sleep  futex_wait on a word in the segment, in slices of `slice_s`; after each slice
           the caller's `on_slice` runs (liveness check, heartbeat), so a dead peer is
           noticed within one slice and an idle waiter costs a wake-up every `slice_s`

The sleep handshake (no lost wake-up):

    waiter (wait_u64 in _ringops.c)         waker (publish_and_wake in _atomics.h)
    seq = futex word                        store counter (release)
    sleepers += 1                           fence
    fence                                   if sleepers != 0:
    if ready(): sleepers -= 1; done             futex word += 1; futex_wake(all)
    futex_wait(word, expected=seq)
    sleepers -= 1

Either the waiter's re-check sees the new counter, or the waker sees `sleepers != 0` and
bumps the word; futex_wait returns at once if the word no longer equals `seq`. `sleepers`
is a count, not a flag, because several broadcast readers sleep on one word.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ringllm.ipc import _atomics

_FUTEX_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class WaitPolicy:
    """How long to poll before sleeping; `slice_s` bounds how late a dead peer is noticed.

    NOTE: the spin is measured in time, not iterations, and runs in C with the GIL
    released (`_atomics.wait_u64`): a peer that answers within `spin_s` is caught without
    a system call on either side and without the wake-up of a halted CPU (on these
    virtual machines 20-50 us), so a ping-pong whose sides each work a few microseconds
    never sleeps (round trip 2.5 us against 48 us sleeping at once). It does not spin when
    the peer's CPU hint says the peer last ran on the waiter's own CPU: a spinner there
    holds the core its peer is queued for, and sleeping at once is faster (with two
    CPU-bound processes beside a ping-pong on one CPU: 8.6 us against 89-110 us spinning;
    the table is in _ringops.c). `wait_until`, which watches several counters and so has
    no one peer, spins only while no more tasks are runnable than there are CPUs
    (`_atomics.cores_are_free`). Each wait spins at most `spin_s`, so an idle engine costs
    one spin per `slice_s` (0.05 % of a core with the defaults).

    The yield phase is off by default (`yield_iters=0`): on these machines (2 cores,
    more runnable processes than cores) one sched_yield() hands the core to a CPU-bound
    process for its whole slice; measured with two CPU-bound processes beside a
    ping-pong (p50 / p99): 10 Python spins then futex 11 / 14-21 us; 10 spins + 2 yields
    11 / 13,000-16,000 us. It stays for machines with cores to spare.
    """

    spin_s: float = 50e-6
    yield_iters: int = 0
    slice_s: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.spin_s <= 0.01:
            raise ValueError(f"spin_s must be in [0, 0.01] s, got {self.spin_s}")
        if self.yield_iters < 0:
            raise ValueError(f"yield_iters must be >= 0, got {self.yield_iters}")
        if not 0.001 <= self.slice_s <= 1.0:
            raise ValueError(f"slice_s must be in [0.001, 1.0] s, got {self.slice_s}")


def wait_for_change(
    wait_u64: Callable[[int, float, float], int],
    known: int,
    timeout_s: float | None,
    policy: WaitPolicy,
    on_slice: Callable[[], None],
    spin: bool = True,
) -> int:
    """The counter once it differs from `known`; `known` after the timeout.

    The fast form of `wait_until` for the common wait, "has my peer moved this counter":
    spin, handshake and futex sleep happen in one C call per slice. `wait_u64(known,
    spin_s, timeout_s)` is `_atomics.wait_u64` with the ring's offsets bound (the counter,
    sleepers, futex word and the peer's CPU hint; see RingReader). `spin=False` skips the
    spin (a caller that has spun already).
    """
    spin_s = policy.spin_s if spin else 0.0
    if policy.yield_iters:
        value = wait_u64(known, spin_s, 0.0)
        for _ in range(policy.yield_iters):
            if value != known:
                return value
            _atomics.sched_yield()
            value = wait_u64(known, 0.0, 0.0)  # one load: no spin, no sleep
        if value != known:
            return value
        spin_s = 0.0
    deadline_ns = None if timeout_s is None else time.monotonic_ns() + int(timeout_s * 1e9)
    while True:
        slice_s = policy.slice_s
        if deadline_ns is not None:
            slice_s = min(slice_s, max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9))
        value = wait_u64(known, spin_s, slice_s)
        if value != known or slice_s == 0.0:
            return value
        spin_s = 0.0
        on_slice()


def wait_until(
    ready: Callable[[], bool],
    buf: memoryview,
    sleepers_offset: int,
    futex_offset: int,
    timeout_s: float | None,
    policy: WaitPolicy,
    on_slice: Callable[[], None],
) -> bool:
    """Return True once `ready()` holds, False after `timeout_s` (None: no limit).

    For conditions over several counters (a writer waiting for the slowest broadcast
    reader, the MPSC consumer watching every producer). `on_slice` runs after every futex
    slice that ended without `ready()`; it may raise to abort the wait (a dead peer).
    """
    if ready():
        return True
    if policy.spin_s and _atomics.cores_are_free():
        spin_end_ns = time.monotonic_ns() + int(policy.spin_s * 1e9)
        while time.monotonic_ns() < spin_end_ns:
            if ready():
                return True
    for _ in range(policy.yield_iters):
        _atomics.sched_yield()
        if ready():
            return True
    deadline_ns = None if timeout_s is None else time.monotonic_ns() + int(timeout_s * 1e9)
    load, fetch_add, futex_wait = _atomics.load_u64, _atomics.fetch_add_u64, _atomics.futex_wait
    while True:
        seq = load(buf, futex_offset) & _FUTEX_MASK
        fetch_add(buf, sleepers_offset, 1)
        _atomics.fence()
        if ready():
            fetch_add(buf, sleepers_offset, -1)
            return True
        slice_s = policy.slice_s
        if deadline_ns is not None:
            remaining_s = (deadline_ns - time.monotonic_ns()) / 1e9
            if remaining_s <= 0:
                fetch_add(buf, sleepers_offset, -1)
                return False
            slice_s = min(slice_s, remaining_s)
        try:
            futex_wait(buf, futex_offset, seq, slice_s)
        finally:
            fetch_add(buf, sleepers_offset, -1)
        if ready():
            return True
        on_slice()
