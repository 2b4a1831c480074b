"""The collectives a tensor-parallel model calls (`Communicator`), as an interface only.

The models (pipeline/models/llama.py) are written against it; the implementations live
with the processes that run them: gloo over loopback in pipeline/executor/process_groups.py
(CPU), NCCL through cupy.cuda.nccl in cuda/nccl_comm.py (GPU), which satisfies it by shape
without importing it (cuda/ imports nothing of pipeline/).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place when `x` is contiguous; returns the result."""
        ...

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order."""
        ...

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` on every rank, in place; returns it."""
        ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


def check_rank(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1 rank, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank: must be in [0, {world_size}) for world_size {world_size}, got {rank}"
        )
