"""The worker's pooling: one vector per pooling request, from the step's final hidden
states (pipeline/pooling.py says what each type takes).

A prompt may be computed over several steps (chunked prefill), so `mean` keeps a running
sum and count per request, and `cls` the first position's state, until the step that
reaches the prompt's end. A chunk that starts at position 0 starts over: a request
recomputed after preemption (mean and cls pooling never start from a cached prefix, see
core/kv_cache_manager.py) pools its prompt once.
"""

from __future__ import annotations

import numpy as np
import torch

from ringllm.pipeline.worker.input_batch import StepInputs


class Pooler:
    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}

    def drop(self, request_id: str) -> None:
        self._sums.pop(request_id, None)
        self._counts.pop(request_id, None)

    def pool(
        self, req_ids: list[str], step: StepInputs, hidden: torch.Tensor, params_of
    ) -> dict[str, np.ndarray]:
        """The vectors of the pooling requests whose prompt this step ends (float32),
        by request id; the others' partial sums kept. `params_of(row)`: a batch row's
        SamplingParams; `hidden`: [T, H] in batch order."""
        pooled = {}
        for b in np.flatnonzero(step.pools).tolist():
            rid = req_ids[int(step.order[b])]
            params = params_of(int(step.rows[b]))
            start, end = int(step.query_start_loc[b]), int(step.query_start_loc[b + 1])
            self._take(rid, params.pooling_type, hidden, start, end, step)
            if step.samples[b]:
                vector = self._finish(rid, params.pooling_type, hidden, end)
                if params.pooling_normalize:
                    vector = torch.nn.functional.normalize(vector, dim=0)
                pooled[rid] = vector.cpu().numpy().astype(np.float32, copy=False)
        return pooled

    def _take(self, rid: str, kind: str, hidden, start: int, end: int, step) -> None:
        starts_over = int(step.positions[start]) == 0
        if kind == "mean":
            chunk = hidden[start:end].float().sum(0)
            if starts_over or rid not in self._sums:
                self._sums[rid], self._counts[rid] = chunk, end - start
            else:
                self._sums[rid] += chunk
                self._counts[rid] += end - start
        elif kind == "cls" and starts_over:
            self._sums[rid] = hidden[start].float().clone()

    def _finish(self, rid: str, kind: str, hidden, end: int) -> torch.Tensor:
        if kind == "last":
            return hidden[end - 1].float()
        total = self._sums.pop(rid)
        count = self._counts.pop(rid, 1)
        return total / count if kind == "mean" else total
