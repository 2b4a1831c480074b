"""Waiting for a counter in shared memory to move: spin, yield, then sleep on a futex.

A waiter (a reader waiting for records, a writer waiting for free slots) goes through
three phases, cheapest wake-up first:

    spin   `spin_iters` checks of the counter      ~1 us, catches a peer mid-publish
    yield  `yield_iters` sched_yield() + check     off by default: see WaitPolicy
    sleep  futex_wait on a word in the segment, in slices of `slice_s`; after each slice
           the caller's `on_slice` runs (liveness check, heartbeat), so a dead peer is
           noticed within one slice and an idle waiter costs a wake-up every `slice_s`

The sleep handshake (no lost wake-up):

    waiter                                  waker (publish_u64 in _atomics.c)
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

    NOTE: short on purpose. These machines run more processes than cores (2 cores:
    tests, benchmarks and the engine side by side). A waiter that keeps polling, by
    spinning or by sched_yield(), is charged CPU time, so the scheduler treats it as a
    hog and its peer waits a whole tick behind it, while a waiter asleep in the futex is
    woken with priority. Even one sched_yield() hands the core to a CPU-bound process for
    its whole slice. Ping-pong with two CPU-bound processes running (p50 / p99): 10 spins
    then futex 11 / 14-21 us; 10 spins + 2 yields 11 / 13,000-16,000 us; 10 spins + 100 us
    of yields 10 / 9,000-16,000 us; 200 spins 33 / 3,500 us. So the yield phase is off by
    default (`yield_iters=0`); it stays for machines with cores to spare.
    """

    spin_iters: int = 10
    yield_iters: int = 0
    slice_s: float = 0.1

    def __post_init__(self) -> None:
        if self.spin_iters < 0 or self.yield_iters < 0:
            raise ValueError(
                "spin_iters and yield_iters must be >= 0, "
                f"got {self.spin_iters} and {self.yield_iters}"
            )
        if not 0.001 <= self.slice_s <= 1.0:
            raise ValueError(f"slice_s must be in [0.001, 1.0] s, got {self.slice_s}")


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

    `on_slice` runs after every futex slice that ended without `ready()`; it may raise to
    abort the wait (a dead peer).
    """
    for _ in range(policy.spin_iters):
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
