"""executor/launch.py: the one wait for ranks' READY that every executor uses."""

from __future__ import annotations

import os

import pytest

from ringllm.pipeline.executor.launch import parse_ready, pipe_lines, wait_ready


def _answers(script: dict[int, list[tuple[int, str]]]):
    """A poller that answers, on round r, the (index, line) pairs script[r] names."""
    rounds = iter(range(1000))

    def poll(waiting: list[int]) -> dict[int, str]:
        round_number = next(rounds)
        return {i: line for i, line in script.get(round_number, []) if i in waiting}

    return poll


def _never(missing):
    raise AssertionError(f"timed out with {missing} missing")


def test_block_counts_come_back_in_rank_order_whatever_order_ranks_answer():
    poll = _answers({0: [(2, "ready 30")], 1: [(0, "ready 10")], 3: [(1, "ready 20")]})
    assert wait_ready(poll, 3, _never) == [10, 20, 30]


def test_before_and_after_run_each_round_and_after_is_told_whether_a_line_came():
    seen = []
    poll = _answers({1: [(0, "ready 5")]})
    wait_ready(
        poll,
        1,
        _never,
        before=lambda: seen.append("before"),
        after=lambda read_any: seen.append(read_any),
    )
    assert seen == ["before", False, "before", True, "before"]


def test_other_hosts_are_waited_for_after_the_local_ranks():
    answers = iter([False, False, True])
    blocks = wait_ready(
        _answers({0: [(0, "ready 7")]}), 1, _never, others_ready=lambda: next(answers)
    )
    assert blocks == [7]


def test_a_ranks_error_is_raised_with_its_rank_and_a_refused_config_as_value_error():
    with pytest.raises(RuntimeError, match="rank 5 failed to start: OSError: no"):
        wait_ready(_answers({0: [(1, "error OSError: no")]}), 2, _never, rank_of=lambda i: 4 + i)
    with pytest.raises(ValueError, match="^bad shape$"):
        parse_ready(0, "error ValueError: bad shape")
    with pytest.raises(RuntimeError, match="exited before saying it was ready"):
        parse_ready(0, "")


def test_the_deadline_names_the_ranks_that_never_answered():
    poll = _answers({0: [(1, "ready 1")]})
    with pytest.raises(TimeoutError, match=r"missing \[0, 2\]"):
        wait_ready(poll, 3, lambda missing: f"missing {missing}", timeout_s=0.0)


def test_pipe_lines_reads_the_ready_line_of_each_pipe_that_has_one():
    fds = [os.pipe() for _ in range(2)]
    pipes = [os.fdopen(read_fd, "r") for read_fd, _ in fds]
    try:
        os.write(fds[1][1], b"ready 42\n")
        assert pipe_lines(pipes)([0, 1]) == {1: "ready 42"}
        os.close(fds[0][1])  # a rank that died before its line: its pipe ends, empty
        with pytest.raises(RuntimeError, match="rank 0 failed to start: exited before"):
            wait_ready(pipe_lines(pipes), 1, _never)
    finally:
        for pipe in pipes:
            pipe.close()
        os.close(fds[1][1])
