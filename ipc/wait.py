"""Waiting for a counter in shared memory to move: spin, yield, then sleep on a futex.

A waiter (a reader waiting for records, a writer waiting for free slots) goes through
three phases, cheapest wake-up first:

    spin   `spin_iters` checks of the counter      ~1 us, catches a peer mid-publish
    yield  sched_yield() + check for `yield_s`     lets the peer run on a shared core
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

    NOTE: the poll phase yields rather than spins. On a machine with more runnable
    processes than cores (2 cores here, tests and benchmarks beside the engine) a spinning
    waiter steals the core its peer needs to publish: measured ping-pong p50 went from
    ~9 us with yields to ~50 us with 400 spins and ~430 us with 4000. With idle cores a
    sched_yield() returns at once, so it is nearly as fast as a spin.
    """

    spin_iters: int = 10
    yield_s: float = 100e-6
    slice_s: float = 0.1

    def __post_init__(self) -> None:
        if self.spin_iters < 0:
            raise ValueError(f"spin_iters must be >= 0, got {self.spin_iters}")
        if not 0 <= self.yield_s <= 0.01:
            raise ValueError(f"yield_s must be in [0, 0.01] s, got {self.yield_s}")
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
    if policy.yield_s:
        yield_until_ns = time.perf_counter_ns() + int(policy.yield_s * 1e9)
        while time.perf_counter_ns() < yield_until_ns:
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
