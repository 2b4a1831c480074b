"""What each worker rank of a pipeline spends its steps on, in one small shared-memory table
the executor owns and every rank writes its own row of (read by `ringllm bench pp`).

    steps          STEP records this rank carried out
    step_s         seconds inside them (model, sampling, waiting on the other stages)
    recv_wait_s    of which waiting for the previous stage's hidden states (the bubble
                   before this stage, plus the time they take to arrive)
    send_wait_s    of which waiting for the next stage to take the last step's sends
    ring_wait_s    seconds waiting for the engine core's next record (idle between steps)
    bytes_sent     hidden states and residuals handed to the next stage
    bytes_received ... and taken from the previous one

One writer per row, any number of readers: a reader may see a row between two of its
fields' updates, which is fine for figures summed over seconds of steps.
"""

from __future__ import annotations

import numpy as np

from ringllm.ipc.shm import Segment

STAGE_STATS = np.dtype(
    [
        ("steps", np.int64),
        ("step_s", np.float64),
        ("recv_wait_s", np.float64),
        ("send_wait_s", np.float64),
        ("ring_wait_s", np.float64),
        ("bytes_sent", np.int64),
        ("bytes_received", np.int64),
    ]
)


class StageStatsTable:
    def __init__(self, segment: Segment, num_ranks: int) -> None:
        self.segment = segment
        self.rows = np.ndarray((num_ranks,), STAGE_STATS, buffer=segment.buf)

    @classmethod
    def create(cls, num_ranks: int) -> StageStatsTable:
        return cls(Segment.create("pp-stats", num_ranks * STAGE_STATS.itemsize), num_ranks)

    @classmethod
    def attach(cls, name: str) -> StageStatsTable:
        segment = Segment.attach(name)
        return cls(segment, segment.size_bytes // STAGE_STATS.itemsize)

    @property
    def name(self) -> str:
        return self.segment.name

    def snapshot(self) -> list[dict[str, float]]:
        """Every rank's row (global rank order: stage x tensor_parallel_size + rank)."""
        return [{key: row[key].item() for key in STAGE_STATS.names} for row in self.rows.copy()]

    def close(self) -> None:
        self.rows = None
        self.segment.close()
