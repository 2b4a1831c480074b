"""`bench pp`'s view of the pipeline stages: the ranks' stage-stats table
(pipeline/executor/stage_stats.py) read around a timed run, and what one stage cost.

The counters are cumulative, so a run's figures are the difference of two snapshots. Two
things about when a rank writes its row shape how they are read:

- A rank writes its row after each step, the last stage after it has sent the step's
  answer: the engine may have every answer before the last row is written. A snapshot is
  therefore taken once every stage reports the same step count (every rank runs every
  step) and the rows stop changing (`settled_snapshot`).
- A rank's wait for the engine core's next record (`ring_wait_s`) is added when the record
  arrives. So the idle time before a run would be counted in the run's first step (the
  caller runs a one-token request just before the first snapshot, which keeps it to
  milliseconds), and the idle time after a stage's last step is not in the run at all.

Hence the bubble is computed from what the stage did compute, not from its waits:

    compute_s = step_s - recv_wait_s - send_wait_s     (model, sampling, records)
    bubble    = 1 - compute_s / wall_s                  (wall_s: the run's wall time)

i.e. the share of the run's wall time the stage was not computing: waiting for the
previous stage, for the next to take its sends, for the engine core, or done early.
"""

from __future__ import annotations

import time
from typing import Any

SETTLE_TIMEOUT_S = 2.0
SETTLE_POLL_S = 0.005
COUNTERS = (
    "steps", "step_s", "recv_wait_s", "send_wait_s", "ring_wait_s", "bytes_sent",
    "bytes_received",
)  # fmt: skip


def stage_stats_of(llm) -> Any | None:
    """The executor's `stage_stats` (the engine core in this process); None without stages."""
    core = llm.llm_engine.engine_core
    executor = getattr(core, "executor", None)
    return getattr(executor, "stage_stats", None)


def settled_snapshot(read) -> list[dict[str, float]]:
    """`read()` once every row has the same step count and two reads in a row agree."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last = read()
    while time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_S)
        rows = read()
        if rows == last and len({row["steps"] for row in rows}) == 1:
            return rows
        last = rows
    steps = [row["steps"] for row in last]
    raise RuntimeError(
        f"stage stats: the ranks' step counts {steps} did not agree within "
        f"{SETTLE_TIMEOUT_S:.0f} s of the run's end; a rank is stuck or was lost"
    )


def difference(
    after: list[dict[str, float]], before: list[dict[str, float]]
) -> list[dict[str, float]]:
    """Each rank's counters over the run (`after` minus `before`)."""
    return [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)]


def add_up(runs: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Each rank's counters summed over several runs' differences."""
    return [
        {k: sum(run[rank][k] for run in runs) for k in COUNTERS} for rank in range(len(runs[0]))
    ]


def stage_summary(
    totals: dict[str, float], wall_s: float, num_runs: int, layers: tuple[int, int]
) -> dict[str, Any]:
    """One stage's figures from its counters summed over `num_runs` runs of `wall_s` in all."""
    steps = max(1, int(totals["steps"]))

    def ms_per_step(key: str) -> float:
        return 1e3 * totals[key] / steps

    compute_s = totals["step_s"] - totals["recv_wait_s"] - totals["send_wait_s"]
    return {
        "start_layer": layers[0],
        "end_layer": layers[1],
        **{k: totals[k] for k in COUNTERS},
        "steps_per_run": totals["steps"] / num_runs,
        "step_ms": ms_per_step("step_s"),
        "compute_ms_per_step": 1e3 * compute_s / steps,
        "recv_wait_ms_per_step": ms_per_step("recv_wait_s"),
        "send_wait_ms_per_step": ms_per_step("send_wait_s"),
        "ring_wait_ms_per_step": ms_per_step("ring_wait_s"),
        "sent_kib_per_step": totals["bytes_sent"] / steps / 1024,
        "received_kib_per_step": totals["bytes_received"] / steps / 1024,
        "wall_s": wall_s,
        "compute_s": compute_s,
        "bubble": 1.0 - compute_s / wall_s if wall_s else None,
    }
