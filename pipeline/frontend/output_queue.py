"""`OutputQueue`: one request's outputs waiting for its reader, bounded in count and bytes.

A reader that stops reading (a streaming client that never reads its socket) must not make
its outputs pile up in this process: the engine goes on producing them at its own pace,
and with n > 1 and logprobs one step's output is kilobytes of Python objects. Each queue
counts what it holds (`output_bytes`: an estimate of the objects' size, calibrated with
tracemalloc) and refuses an output past its limits; the queues of one front end share a
`QueuedBytes` ledger with a limit of its own. `AsyncLLM` ends a request whose queue is
refused with SlowReaderError, and while the ledger is over, the one `longest_stalled`
picks: of the queues holding bytes, the one whose reader has taken nothing the longest. A
reader that reads takes an output whenever one waits; one that stopped reading has taken
none since it stopped. Neither the queue holding the most (a reading client of a big
request holds more than a silent one of a small request) nor the one with the oldest
unread output (a reader that reads but writes slowly has a backlog of many steps) would
tell them apart as well. A queue is picked only once its reader has taken nothing for
`STALL_GRACE_S` plus the time the event loop took to dispatch the batch: when the loop
itself is behind (many heavy streams on few cores) every reader waits its turn, nobody
stopped reading, and dropping the one whose turn came last would abort a client that
reads. The ledger may then pass its limit by what the engine makes in that time.

Long before a limit, a queue whose reader has fallen behind pauses its request in the
engine (`should_pause`: PAUSE_OUTPUTS outputs or PAUSE_BYTES bytes waiting, at most half
of its limits, and its reader has taken none for PAUSE_GRACE_S), so
a stream nobody reads stops holding a sequence slot, KV blocks and the engine's time
while the clients that read wait behind it; once its reader has taken the queue down to
half of that (`should_resume`), the request is resumed. A pause costs little and is
undone at the reader's next reads (the request's full blocks are usually still in the
prefix cache), so its grace is shorter than a drop's. What silent streams hold here is
then about their number times the pause watermark; the limits catch what comes past a
pause (a core restarted meanwhile), and the server's write timeout
(--stream-write-timeout-s) ends a paused stream whose client never reads again.

    engine outputs ──> OutputQueue (count <= max_outputs, bytes <= max_bytes) ──> reader
                        │  └── QueuedBytes: the sum over all queues <= max_total_bytes
                        └── past the pause watermark, reader stalled: paused in the
                            engine; down to half of it: resumed
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterable
from dataclasses import dataclass

from ringllm.pipeline.outputs import RequestOutput

# What the Python objects of an output cost, in bytes (measured with tracemalloc on
# CPython 3.12): a RequestOutput with its list, each CompletionOutput, each token id (an
# int and its list slot), each logprob entry (dict slot, Logprob, its float and text).
_OUTPUT_BYTES = 512
_COMPLETION_BYTES = 256
_TOKEN_BYTES = 40
_LOGPROB_BYTES = 280

# a reader that reads takes an output within this (plus the loop's lag) of its coming
STALL_GRACE_S = 0.5
# A queue holding this many outputs or bytes (at most half its limits) whose reader has
# taken none for PAUSE_GRACE_S pauses its request in the engine.
PAUSE_OUTPUTS = 256
PAUSE_BYTES = 256 << 10
PAUSE_GRACE_S = 0.1


def output_bytes(out: RequestOutput) -> int:
    """About how many bytes `out` holds that nothing else does. Its prompt ids and prompt
    logprobs are the request's state's own lists, shared by all its outputs (counted per
    output, an echoed long prompt's logprobs would pass the caps in a few outputs)."""
    size = _OUTPUT_BYTES
    for completion in out.outputs:
        size += _COMPLETION_BYTES + len(completion.text) + _TOKEN_BYTES * len(completion.token_ids)
        size += _logprobs_bytes(completion.logprobs)
    return size


def _logprobs_bytes(positions) -> int:
    if not positions:
        return 0
    return _LOGPROB_BYTES * sum(len(p) + 1 for p in positions if p is not None)


@dataclass
class QueuedBytes:
    """What every queue of one front end holds together, and how much it may."""

    max_total_bytes: int
    total_bytes: int = 0

    @property
    def over(self) -> bool:
        return self.total_bytes > self.max_total_bytes


class OutputQueue:
    """FIFO of a request's outputs (RequestOutput) and, last, at most one error."""

    def __init__(self, max_outputs: int, max_bytes: int, ledger: QueuedBytes) -> None:
        self.max_outputs = max_outputs
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._ledger = ledger
        # since when (monotonic s) its outputs have waited with none taken: the time its
        # reader last took one, or the time one came to an empty queue
        self.stalled_since = time.monotonic()
        self._items: collections.deque = collections.deque()  # (item, bytes)
        self._ready = asyncio.Event()
        self.pause_outputs = max(1, min(PAUSE_OUTPUTS, max_outputs // 2))
        self.pause_bytes = min(PAUSE_BYTES, max_bytes // 2)
        # None: its request runs; else the engine was asked to pause it (AsyncLLM sets
        # it) when the core had restarted this many times
        self.paused_after_restarts: int | None = None

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, out: RequestOutput) -> bool:
        """Queues `out`; False (nothing queued) if it would pass a limit. An empty queue
        takes one output of any size: a reader that reads must get it (echoed prompt
        logprobs of a long prompt pass 4 MiB), and what the request asked bounds it."""
        size = output_bytes(out)
        if not self._items:
            self.stalled_since = time.monotonic()
        elif len(self._items) >= self.max_outputs or self.num_bytes + size > self.max_bytes:
            return False
        self._items.append((out, size))
        self._add_bytes(size)
        self._ready.set()
        return True

    def should_pause(self, num_restarts: int) -> bool:
        """Whether its request should be paused now: past the pause watermark, its reader
        stalled (`PAUSE_GRACE_S`), not paused in this core (the core's `num_restarts`: a
        new core knows nothing of an older one's pauses).

        NOTE: unlike a drop, a pause does not wait out the event loop's lag: a loop that
        is behind (its output batches queue up faster than it handles them) is one more
        reason to make the engine produce less, and a reader that reads resumes its
        request as soon as it has taken its queue down."""
        if self.paused_after_restarts == num_restarts:
            return False
        if len(self._items) < self.pause_outputs and self.num_bytes < self.pause_bytes:
            return False
        return time.monotonic() - self.stalled_since > PAUSE_GRACE_S

    def should_resume(self) -> bool:
        """Whether its paused request should run again: its reader took it down to half
        of the pause watermark."""
        return self.paused_after_restarts is not None and (
            2 * len(self._items) <= self.pause_outputs and 2 * self.num_bytes <= self.pause_bytes
        )

    def end(self, error: BaseException, drop_unread: bool) -> None:
        """Ends the queue with `error` (its reader raises it after what is still queued;
        `drop_unread`: nothing else, the unread outputs freed now)."""
        if drop_unread:
            self.clear()
        self._items.append((error, 0))
        self._ready.set()

    def clear(self) -> None:
        self._items.clear()
        self._add_bytes(-self.num_bytes)

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item, size = self._items.popleft()
        self._add_bytes(-size)
        self.stalled_since = time.monotonic()
        return item

    def _add_bytes(self, size: int) -> None:
        self.num_bytes += size
        self._ledger.total_bytes += size


def longest_stalled(
    queues: Iterable[tuple[str, OutputQueue]], loop_lag_s: float = 0.0
) -> tuple[str, OutputQueue] | None:
    """The (request id, queue) holding bytes whose reader has taken nothing the longest, if
    that is longer than `STALL_GRACE_S` + `loop_lag_s`; None if there is no such queue."""
    holding = [item for item in queues if item[1].num_bytes]
    stalled = min(holding, key=lambda item: item[1].stalled_since, default=None)
    if stalled is None:
        return None
    if time.monotonic() - stalled[1].stalled_since <= STALL_GRACE_S + loop_lag_s:
        return None
    return stalled
