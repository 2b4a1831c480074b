"""One way to start ranks and wait for their READY, for every executor that runs them: the
multiproc executor (this host's ranks), the headless host agent (another host's) and the
Ray executor (rank actors).

    start_rank   one rank process (a fresh interpreter) and the read end of its ready pipe
    wait_ready   each rank's KV block count, once every rank said "ready <num_blocks>"; a
                 rank's "error <type>: <message>" is raised as soon as it is read
    pipe_lines   the ready-line poller of ranks that are child processes (select on pipes)

A rank's own error wins over the death it causes elsewhere: the lines are read first and
the caller's liveness check (`after`) runs only on a poll that read nothing.
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Callable

from ringllm.pipeline.child_process import child_env, start_child

POLL_S = 0.1  # every wait wakes at least this often to check the ranks
START_TIMEOUT_S = 600.0  # a rank loads its weights and sizes its KV cache within this

RANK_MODULE = "ringllm.pipeline.executor.rank_process"


def start_rank(spec, env: dict[str, str]):
    """Starts one rank (a fresh interpreter): (its process, the read end of its ready pipe).
    `spec` is a rank_process.RankSpec."""
    read_fd, write_fd = os.pipe()
    pipe = os.fdopen(read_fd, "r")
    try:
        proc = start_child(
            [sys.executable, "-m", RANK_MODULE, spec.to_json(), str(write_fd)],
            pass_fds=(write_fd,),
            env=child_env(env),
        )
    except BaseException:
        pipe.close()
        raise
    finally:
        os.close(write_fd)
    return proc, pipe


def parse_ready(rank: int, line: str) -> int:
    """A rank's ready line: its KV block count, or its start-up error raised (a ValueError
    for a config the ranks refused: the caller's fault)."""
    if line.startswith("ready "):
        return int(line.split()[1])
    message = line.removeprefix("error ") or "exited before saying it was ready"
    if message.startswith("ValueError: "):
        raise ValueError(message.removeprefix("ValueError: "))
    raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {message}")


def pipe_lines(pipes: list) -> Callable[[list[int]], dict[int, str]]:
    """The poller of ranks' ready pipes: waits up to POLL_S, returns {index: line} read."""

    def poll(waiting: list[int]) -> dict[int, str]:
        readable = select.select([pipes[i] for i in waiting], [], [], POLL_S)[0]
        return {pipes.index(pipe): pipe.readline().strip() for pipe in readable}

    return poll


def wait_ready(
    poll: Callable[[list[int]], dict[int, str]],
    num_ranks: int,
    expired: Callable[[list[int]], str],
    *,
    rank_of: Callable[[int], int] = int,
    before: Callable[[], None] = lambda: None,
    after: Callable[[bool], None] = lambda read_any: None,
    others_ready: Callable[[], bool] = lambda: True,
    timeout_s: float = START_TIMEOUT_S,
) -> list[int]:
    """The KV block count of ranks 0..num_ranks-1 (indices into the caller's list), once
    every one said ready and `others_ready()` (other hosts) holds.

    poll(waiting)    {index: ready line} of the ranks that answered; waits up to POLL_S
    rank_of(index)   the rank an index names, for errors
    before()         each round first (the other hosts' start-up, say)
    after(read_any)  each round last: a liveness check or a heartbeat
    expired(missing) the TimeoutError's message, with the indices that never answered
    """
    blocks: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        before()
        waiting = [index for index in range(num_ranks) if index not in blocks]
        if not waiting and others_ready():
            break
        lines = poll(waiting) if waiting else {}
        if not waiting:
            time.sleep(POLL_S)
        for index, line in lines.items():
            blocks[index] = parse_ready(rank_of(index), line)
        after(bool(lines))
        if time.monotonic() > deadline:
            missing = [index for index in range(num_ranks) if index not in blocks]
            raise TimeoutError(expired(missing))
    return [blocks[index] for index in range(num_ranks)]


def check_model(model: str | None, tensor_parallel_size: int = 1) -> None:
    """ValueError (one line) unless `model` is a model the ranks can load: its path, then
    its config.json or GGUF metadata, then its architecture and its split over
    `tensor_parallel_size` ranks, read in the caller's process before any rank starts (a
    rank's failure to load would reach the user as a traceback, after seconds)."""
    from ringllm.pipeline.models.gguf_model import resolve_model_path
    from ringllm.pipeline.models.hf_config import check_tensor_parallel_split, load_arch_config
    from ringllm.pipeline.models.registry import check_architecture

    try:
        arch = load_arch_config(resolve_model_path(model))
    except OSError as exc:  # missing, or unreadable
        raise ValueError(str(exc)) from None
    check_architecture(arch.architecture)
    check_tensor_parallel_split(arch, tensor_parallel_size)
