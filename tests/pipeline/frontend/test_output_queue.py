"""OutputQueue and QueuedBytes: what waits for a reader is counted in bytes, the count goes
down as it is read and to zero when the queue is cleared or ended, and `longest_stalled`
picks the reader that stopped reading, not one that reads."""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest

from ringllm.pipeline.frontend import output_queue
from ringllm.pipeline.frontend.output_queue import (
    OutputQueue,
    QueuedBytes,
    longest_stalled,
    output_bytes,
)
from ringllm.pipeline.outputs import CompletionOutput, Logprob, RequestOutput


def step_output(n: int = 8, num_logprobs: int = 20, step: int = 0) -> RequestOutput:
    """One step of a request with `n` sequences, each with a token and its top logprobs."""
    completions = [
        CompletionOutput(
            index=i,
            text=f" tok{step}-{i}",
            token_ids=[1000 + step],
            cumulative_logprob=-1.5,
            logprobs=[
                {
                    token: Logprob(
                        -0.1 * token - 0.01 * i, rank=token + 1, decoded_token=f"t{token}"
                    )
                    for token in range(num_logprobs + 1)
                }
            ],
        )
        for i in range(n)
    ]
    return RequestOutput("req", None, [1, 2, 3], None, completions, finished=False)


def read(queue: OutputQueue):
    return asyncio.run(queue.get())


@pytest.fixture
def clock(monkeypatch):
    """output_queue's monotonic clock, moved by hand."""
    now = [100.0]
    monkeypatch.setattr(output_queue.time, "monotonic", lambda: now[0])
    return now


def test_output_bytes_is_near_what_python_allocates():
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = step_output()
        allocated = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert allocated / 2 < output_bytes(out) < allocated * 2
    # logprobs are what make an output big
    assert output_bytes(out) > 5 * output_bytes(step_output(num_logprobs=0))


def test_bytes_go_down_as_read_and_to_zero_when_cleared():
    ledger = QueuedBytes(max_total_bytes=1 << 30)
    queue = OutputQueue(max_outputs=16, max_bytes=1 << 30, ledger=ledger)
    outs = [step_output(step=s) for s in range(3)]
    for out in outs:
        assert queue.offer(out)
    sizes = [output_bytes(out) for out in outs]
    assert queue.num_bytes == ledger.total_bytes == sum(sizes)
    assert read(queue) is outs[0]
    assert queue.num_bytes == ledger.total_bytes == sum(sizes[1:])
    queue.clear()
    assert (len(queue), queue.num_bytes, ledger.total_bytes) == (0, 0, 0)


def test_ending_a_queue_frees_its_bytes_or_hands_them_over_first():
    ledger = QueuedBytes(max_total_bytes=1 << 30)
    dropped = OutputQueue(16, 1 << 30, ledger)
    kept = OutputQueue(16, 1 << 30, ledger)
    dropped.offer(step_output())
    out = step_output()
    kept.offer(out)
    error = RuntimeError("ended")
    dropped.end(error, drop_unread=True)
    assert dropped.num_bytes == 0 and ledger.total_bytes == kept.num_bytes
    assert read(dropped) is error
    kept.end(error, drop_unread=False)  # its reader gets what waits, then the error
    assert read(kept) is out and ledger.total_bytes == 0
    assert read(kept) is error


def test_an_output_past_a_limit_is_refused_and_not_counted():
    ledger = QueuedBytes(max_total_bytes=1 << 30)
    size = output_bytes(step_output())
    by_bytes = OutputQueue(max_outputs=16, max_bytes=2 * size, ledger=ledger)
    assert by_bytes.offer(step_output()) and by_bytes.offer(step_output())
    assert not by_bytes.offer(step_output())
    by_count = OutputQueue(max_outputs=1, max_bytes=1 << 30, ledger=ledger)
    assert by_count.offer(step_output()) and not by_count.offer(step_output())
    assert ledger.total_bytes == 3 * size and len(by_bytes) == 2 and len(by_count) == 1


def test_an_empty_queue_takes_one_output_past_its_byte_limit():
    """Echoed prompt logprobs of a long prompt come in one output bigger than the limit:
    a reader that reads gets it; one that does not is dropped at the next output."""
    ledger = QueuedBytes(max_total_bytes=1 << 30)
    queue = OutputQueue(max_outputs=16, max_bytes=output_bytes(step_output()) // 2, ledger=ledger)
    first = step_output()
    assert queue.offer(first) and not queue.offer(step_output())
    assert read(queue) is first and queue.offer(step_output())


def test_the_ledger_sums_every_queue():
    size = output_bytes(step_output())
    ledger = QueuedBytes(max_total_bytes=2 * size)
    queues = [OutputQueue(16, 1 << 30, ledger) for _ in range(3)]
    for queue in queues[:2]:
        queue.offer(step_output())
    assert not ledger.over
    queues[2].offer(step_output())
    assert ledger.over and ledger.total_bytes == 3 * size
    read(queues[2])
    assert not ledger.over


def test_the_reader_that_stopped_reading_is_picked_not_one_that_reads(clock):
    ledger = QueuedBytes(max_total_bytes=1 << 30)
    silent, reader, backlogged, waiting, empty = (
        OutputQueue(4096, 1 << 30, ledger) for _ in "12345"
    )
    queues = {"silent": silent, "reader": reader, "backlogged": backlogged, "waiting": waiting}
    queues["empty"] = empty
    for step in range(50):
        clock[0] += 1.0
        for queue in (silent, reader, backlogged):
            queue.offer(step_output(step=step))
        read(reader)  # reads each step
        if step % 2:
            read(backlogged)  # reads, but falls behind: half its outputs still wait
        if step < 40:
            read(silent)  # then stops reading
    # `waiting` waited for its first output since the start (queued behind the others)
    # and got it only now, in the same batch as the check: it has read all it was given
    clock[0] += 0.5
    waiting.offer(step_output())
    # `backlogged` holds more than `silent`, and its oldest unread output is older
    assert (len(backlogged), len(silent)) == (25, 10)
    assert longest_stalled(queues.items()) == ("silent", silent)
    # a queue holding nothing is never picked: dropping it would free nothing
    assert longest_stalled([("reader", reader), ("empty", empty)]) is None


def test_no_reader_is_picked_while_every_one_took_an_output_within_the_grace(clock):
    """A loop that is behind makes every reader wait its turn: none of them stopped reading,
    so none is dropped until one has taken nothing for the grace plus the loop's lag."""
    ledger = QueuedBytes(max_total_bytes=1)
    first, second = OutputQueue(4096, 1 << 30, ledger), OutputQueue(4096, 1 << 30, ledger)
    first.offer(step_output())
    clock[0] += 0.1
    second.offer(step_output())
    assert ledger.over
    clock[0] += output_queue.STALL_GRACE_S - 0.2
    assert longest_stalled([("first", first), ("second", second)]) is None
    clock[0] += 0.2
    assert longest_stalled([("first", first), ("second", second)]) == ("first", first)
    # the same wait is no stall when the loop took that long to hand the batch over
    assert longest_stalled([("first", first), ("second", second)], loop_lag_s=1.0) is None
    clock[0] += 1.0
    assert longest_stalled([("first", first), ("second", second)], loop_lag_s=1.0) == (
        "first",
        first,
    )


def test_a_stalled_queue_past_the_watermark_pauses_and_resumes_once_read_down(clock):
    ledger = QueuedBytes(max_total_bytes=1 << 30)
    queue = OutputQueue(4096, 1 << 30, ledger)
    size = output_bytes(step_output())
    count = -(-output_queue.PAUSE_BYTES // size)  # outputs that reach the byte watermark
    for step in range(count - 1):
        queue.offer(step_output(step=step))
    clock[0] += 1.0
    assert not queue.should_pause(num_restarts=0)  # stalled, but under the watermark
    queue.offer(step_output())
    assert queue.should_pause(num_restarts=0)
    # a reader that took an output just now is not stalled, whatever waits
    read(queue)
    queue.offer(step_output())
    assert not queue.should_pause(num_restarts=0)
    clock[0] += output_queue.PAUSE_GRACE_S + 0.05
    assert queue.should_pause(num_restarts=0)
    queue.paused_after_restarts = 0  # AsyncLLM asked the core to pause it
    assert not queue.should_pause(num_restarts=0) and not queue.should_resume()
    assert queue.should_pause(num_restarts=1)  # a new core runs it unpaused: again
    while 2 * queue.num_bytes > queue.pause_bytes:
        assert not queue.should_resume()
        read(queue)
    assert queue.should_resume()


def test_the_watermark_is_at_most_half_of_a_small_queues_limits(clock):
    ledger = QueuedBytes(max_total_bytes=1 << 30)
    size = output_bytes(step_output())
    by_bytes = OutputQueue(4096, 4 * size, ledger)
    by_count = OutputQueue(4, 1 << 30, ledger)
    for queue in (by_bytes, by_count):
        queue.offer(step_output())
        clock[0] += 1.0
        assert not queue.should_pause(num_restarts=0)
        queue.offer(step_output())
        assert queue.should_pause(num_restarts=0)  # long before its limit drops it


def test_prompt_logprobs_shared_by_every_output_are_not_counted_in_each():
    prompt_logprobs = step_output().outputs[0].logprobs * 400  # the request state's list
    out = step_output()
    out.prompt_logprobs = prompt_logprobs
    assert output_bytes(out) == output_bytes(step_output())
