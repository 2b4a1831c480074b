"""What the workers hold of each request, and what a step tells them of it.

Only what changed is sent (scheduler_output.py): a request's full data the first time it
is scheduled (`NewRequestData`), then its new blocks and computed-token count
(`CachedRequestData`). So the engine core remembers which requests the workers hold
(`record`), and tells them on the next step that runs when one of those ends or must be
dropped (`forget`, `take_finished`).
"""

from __future__ import annotations

from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.core.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)


class WorkerView:
    def __init__(self, sync_sampled_tokens: bool) -> None:
        """`sync_sampled_tokens`: each step carries the tokens sampled since a request's
        last step (pipeline stages that do not sample need them)."""
        self.sync_sampled_tokens = sync_sampled_tokens
        self._held: set[str] = set()  # ids whose full data the workers have
        self.finished_ids: set[str] = set()  # to tell the workers next step

    def record(
        self,
        out: SchedulerOutput,
        request: Request,
        num_new: int,
        new_blocks: list[int],
        kv: KVCacheManager,
        resumed: bool = False,
    ) -> None:
        """`request` computes `num_new` tokens in the step `out`; `new_blocks`: its blocks
        allocated for them (`kv` has its whole block list)."""
        rid = request.request_id
        sampled = (
            request.all_token_ids[request.num_tokens_synced :] if self.sync_sampled_tokens else []
        )
        request.num_tokens_synced = request.num_tokens
        if rid not in self._held:
            self._held.add(rid)
            out.new_requests.append(
                NewRequestData(
                    request_id=rid,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    eos_token_ids=tuple(request.eos_token_ids),
                    block_ids=kv.block_ids(rid).tolist(),
                    num_computed_tokens=request.num_computed_tokens,
                    mm_inputs=request.mm_inputs,
                )
            )
        elif request.swapped_in:  # back from the host tier: its whole new block list
            request.swapped_in = False
            out.cached_requests.append(
                CachedRequestData(
                    rid, kv.block_ids(rid).tolist(), request.num_computed_tokens, True, sampled
                )
            )
        else:
            out.cached_requests.append(
                CachedRequestData(
                    rid, list(new_blocks), request.num_computed_tokens, resumed, sampled
                )
            )
        out.num_scheduled_tokens[rid] = num_new
        request.num_computed_tokens += num_new

    def forget(self, request_id: str) -> None:
        """The workers are to drop the request (it ended, or is taken back), if they hold it."""
        if request_id in self._held:
            self._held.discard(request_id)
            self.finished_ids.add(request_id)

    def take_finished(self) -> set[str]:
        """The ids to drop that the next step carries."""
        ids, self.finished_ids = self.finished_ids, set()
        return ids
