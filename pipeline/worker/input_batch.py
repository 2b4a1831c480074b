"""`InputBatch`: the worker's persistent per-request rows (vLLM V1's InputBatch idea).

The scheduler sends only what changed each step (pipeline/core/scheduler_output.py); the
worker keeps the rest here, in preallocated numpy arrays, one row per request it knows:

    row r ─ token_ids[r, :num_tokens[r]]      prompt, then outputs (int32)
          ─ num_prompt_tokens[r], num_computed_tokens[r]
          ─ block_table[r, :num_blocks[r]]    the request's KV blocks, in order
          ─ prompt_logprobs[r]                 top-N asked for the prompt (-1: none)
          ─ sampling[r]                        its SamplingRequestState (seeded generator ...)
          ─ mm_inputs[r]                       its images (offsets, pixel values), if any

A request gets a row when it is first scheduled and keeps it until its id comes back in
`finished_request_ids`; a preempted one keeps its row and its sampling state (a resumed
request only gets new blocks). Arrays double when rows or columns run out.

`prepare(req_ids, num_scheduled)` turns one step's scheduled rows into the model's flat
inputs with whole-array numpy operations (`StepInputs`): decodes first (the attention ops
want them so), every token's id, position and KV slot, the block tables, and which
logits rows each request wants. The only Python loop is over the scheduled ids, to find
their rows.

Speculative decoding: a step's drafts are written past a row's known tokens
(`set_drafts`; `num_tokens` does not count them), computed as its last scheduled tokens,
and the request wants a logits row at each of them and at its last known token
(`StepInputs.num_drafts`); the verified run is then appended (`append_runs`) and the
rejected drafts' blocks let go (`trim_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ringllm.pipeline.core.scheduler_output import CachedRequestData, NewRequestData
from ringllm.pipeline.sample.sampler import SamplingRequestState

_INITIAL_ROWS = 64
_INITIAL_TOKENS = 1024
_INITIAL_BLOCKS = 64


@dataclass
class StepInputs:
    """One step's model inputs, in batch order (decodes first), as numpy arrays."""

    rows: np.ndarray  # [R] InputBatch row of each request
    order: np.ndarray  # [R] index of each batch request in the caller's (scheduled) order
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64; KV groups: [G, T]
    query_start_loc: np.ndarray  # [R + 1] int32
    seq_lens: np.ndarray  # [R] int32
    block_tables: np.ndarray  # [R, max_blocks] int32; KV groups: [G, R, max_blocks]
    num_decodes: int
    logits_indices: np.ndarray  # [N] int64: token rows whose logits the step wants
    logit_starts: np.ndarray  # [R + 1] int64: request i owns logits rows [i], [i + 1]
    samples: np.ndarray  # [R] bool: the request's step reaches its known end (it samples)
    num_drafts: np.ndarray | None = None  # [R] drafts verified (logits rows 1 + k); None: none
    pools: np.ndarray | None = None  # [R] bool: a pooling request (worker/pooler.py)
    lora_ids: np.ndarray | None = None  # [R] int32: each request's adapter (0: none)


class InputBatch:
    def __init__(
        self, block_size: int, max_model_len: int, device: str = "cpu", num_kv_groups: int = 1
    ) -> None:
        """`num_kv_groups` G > 1: a row's blocks interleave G groups' tables (block i of
        group g in column i * G + g: pipeline/core/kv_groups.py)."""
        self.block_size = block_size
        self.num_kv_groups = num_kv_groups
        self.max_model_len = max_model_len
        self.device = device
        self.row_of: dict[str, int] = {}
        self._free: list[int] = []
        self.token_ids = np.zeros((0, _INITIAL_TOKENS), np.int32)
        self.block_table = np.zeros((0, _INITIAL_BLOCKS), np.int32)
        self.num_tokens = np.zeros(0, np.int32)
        self.num_prompt_tokens = np.zeros(0, np.int32)
        self.num_computed_tokens = np.zeros(0, np.int32)
        self.num_blocks = np.zeros(0, np.int32)
        self.prompt_logprobs = np.zeros(0, np.int32)
        self.pools = np.zeros(0, bool)  # a pooling request's row: no token is sampled
        self.lora_ids = np.zeros(0, np.int32)  # a row's LoRA adapter (0: the base model)
        self.sampling: list[SamplingRequestState | None] = []
        self.mm_inputs: list[tuple] = []  # each row's images (messages.ImageInput)
        self._grow_rows(_INITIAL_ROWS)

    # ---- the diff ----------------------------------------------------------------------

    def add(self, new: NewRequestData) -> None:
        """A request's first scheduling: a row with its tokens, blocks and sampling state."""
        if new.request_id in self.row_of:
            raise ValueError(f"request {new.request_id!r} is new twice without finishing")
        if not self._free:
            self._grow_rows(2 * len(self.sampling))
        row = self._free.pop()
        n = len(new.token_ids)
        self._fit_columns(n, len(new.block_ids))
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        params = new.sampling_params
        self.prompt_logprobs[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.pools[row] = params.pooling_type is not None
        self.lora_ids[row] = params.lora_id
        state = SamplingRequestState.create(
            params, new.token_ids[: new.num_prompt_tokens], new.eos_token_ids, self.device
        )
        state.output_token_ids.extend(new.token_ids[new.num_prompt_tokens :])
        self.sampling[row] = state
        self.mm_inputs[row] = tuple(new.mm_inputs)
        self.row_of[new.request_id] = row

    def update(self, cached: CachedRequestData) -> None:
        """A known request scheduled again: its new blocks (all of them when resumed)."""
        row = self.row_of[cached.request_id]
        blocks = cached.new_block_ids
        start = 0 if cached.resumed else int(self.num_blocks[row])
        self._fit_columns(0, start + len(blocks))
        self.block_table[row, start : start + len(blocks)] = blocks
        self.num_blocks[row] = start + len(blocks)
        self.num_computed_tokens[row] = cached.num_computed_tokens

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.sampling[row] = None
            self.mm_inputs[row] = ()
            self._free.append(row)

    def set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Writes each request's drafts past its known tokens (the step computes them)."""
        for rid, tokens in drafts.items():
            row = self.row_of[rid]
            start = int(self.num_tokens[row])
            self._fit_columns(start + len(tokens), 0)
            self.token_ids[row, start : start + len(tokens)] = tokens

    def append_runs(self, rows: Sequence[int], runs: Sequence[Sequence[int]]) -> None:
        """Each row's verified tokens (accepted drafts and one more), after its known ones."""
        for row, run in zip(rows, runs, strict=True):
            start = int(self.num_tokens[row])
            self._fit_columns(start + len(run), 0)
            self.token_ids[row, start : start + len(run)] = run
            self.num_tokens[row] = start + len(run)
            self.sampling[row].output_token_ids.extend(run)

    def trim_blocks(self, row: int, num_blocks: int) -> None:
        """The row keeps its first `num_blocks` blocks, every KV group's (the scheduler
        freed the rest)."""
        columns = num_blocks * self.num_kv_groups
        self.num_blocks[row] = min(int(self.num_blocks[row]), columns)

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Each row's sampled token, after its known tokens (rows distinct)."""
        if rows.size == 0:
            return
        self._fit_columns(int(self.num_tokens[rows].max()) + 1, 0)
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1
        for row, token in zip(rows.tolist(), tokens.tolist(), strict=True):
            self.sampling[row].output_token_ids.append(token)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.row_of

    def __len__(self) -> int:
        return len(self.row_of)

    # ---- one step -----------------------------------------------------------------------

    def prepare(
        self,
        req_ids: Sequence[str],
        num_scheduled: np.ndarray,
        num_drafts: np.ndarray | None = None,
    ) -> StepInputs:
        """The flat inputs of a step scheduling `num_scheduled[i]` tokens of `req_ids[i]`:
        every scheduled request computes its tokens [num_computed, num_computed + n), where
        num_computed is what this step's diff said (add / update). `num_drafts[i]`: how
        many of those are drafts (`set_drafts`), each wanting a logits row."""
        row_of = self.row_of
        sched_rows = np.fromiter((row_of[rid] for rid in req_ids), np.int64, len(req_ids))
        q_sched = np.asarray(num_scheduled, np.int64)
        order = np.argsort(q_sched != 1, kind="stable")  # decodes first, else as scheduled
        rows, q_lens = sched_rows[order], q_sched[order]
        starts = self.num_computed_tokens[rows].astype(np.int64)
        seq_lens = starts + q_lens
        if seq_lens.size and int(seq_lens.max()) > self.max_model_len:
            raise ValueError(
                f"a request reaches {int(seq_lens.max())} tokens, over max_model_len "
                f"{self.max_model_len}"
            )
        num_reqs = len(rows)
        query_start_loc = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        req_of_token = np.repeat(np.arange(num_reqs), q_lens)
        positions = starts[req_of_token] + (np.arange(num_tokens) - query_start_loc[req_of_token])
        token_rows = rows[req_of_token]
        input_ids = self.token_ids[token_rows, positions].astype(np.int64)
        bs = self.block_size
        max_blocks = int(-(-seq_lens.max(initial=1) // bs))
        groups = self.num_kv_groups
        if groups == 1:
            block_tables = self.block_table[rows, :max_blocks]
            slot_mapping = block_tables[req_of_token, positions // bs].astype(np.int64) * bs
        else:  # [R, max_blocks * G] -> [G, R, max_blocks]
            columns = self.block_table[rows, : max_blocks * groups]
            block_tables = np.ascontiguousarray(
                columns.reshape(num_reqs, max_blocks, groups).transpose(2, 0, 1)
            )
            slot_mapping = block_tables[:, req_of_token, positions // bs].astype(np.int64) * bs
        slot_mapping += positions % bs
        drafts = None
        if num_drafts is not None:
            drafts = np.asarray(num_drafts, np.int64)[order]
            seq_lens_known = seq_lens - drafts
        else:
            seq_lens_known = seq_lens
        samples = seq_lens_known >= self.num_tokens[rows]
        wants_prompt = (self.prompt_logprobs[rows] >= 0) & (starts < self.num_prompt_tokens[rows])
        wanted = samples.astype(np.int64) if drafts is None else samples * (1 + drafts)
        per_req = np.where(wants_prompt, q_lens, wanted)
        logit_starts = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(per_req, out=logit_starts[1:])
        # request i's logits rows are its last per_req[i] tokens
        ends = query_start_loc[1:]
        first = np.repeat(ends - per_req - logit_starts[:-1], per_req)
        logits_indices = first + np.arange(int(logit_starts[-1]))
        return StepInputs(
            rows=rows,
            order=order,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            block_tables=block_tables,
            num_decodes=int(np.count_nonzero(q_lens == 1)),
            logits_indices=logits_indices.astype(np.int64),
            logit_starts=logit_starts,
            samples=samples,
            num_drafts=drafts,
            pools=self.pools[rows],
            lora_ids=self.lora_ids[rows],
        )

    # ---- storage --------------------------------------------------------------------------

    def _grow_rows(self, rows: int) -> None:
        old = len(self.sampling)
        if rows <= old:
            return
        extra = rows - old
        self.token_ids = np.concatenate(
            [self.token_ids, np.zeros((extra, self.token_ids.shape[1]), np.int32)]
        )
        self.block_table = np.concatenate(
            [self.block_table, np.zeros((extra, self.block_table.shape[1]), np.int32)]
        )
        for name in ("num_tokens", "num_prompt_tokens", "num_computed_tokens", "num_blocks"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra, np.int32)]))
        self.prompt_logprobs = np.concatenate([self.prompt_logprobs, np.full(extra, -1, np.int32)])
        self.pools = np.concatenate([self.pools, np.zeros(extra, bool)])
        self.lora_ids = np.concatenate([self.lora_ids, np.zeros(extra, np.int32)])
        self.sampling.extend([None] * extra)
        self.mm_inputs.extend([()] * extra)
        self._free.extend(range(rows - 1, old - 1, -1))  # the lowest rows are taken first

    def _fit_columns(self, tokens: int, blocks: int) -> None:
        if tokens > self.token_ids.shape[1]:
            width = max(tokens, 2 * self.token_ids.shape[1])
            grown = np.zeros((self.token_ids.shape[0], width), np.int32)
            grown[:, : self.token_ids.shape[1]] = self.token_ids
            self.token_ids = grown
        if blocks > self.block_table.shape[1]:
            width = max(blocks, 2 * self.block_table.shape[1])
            grown = np.zeros((self.block_table.shape[0], width), np.int32)
            grown[:, : self.block_table.shape[1]] = self.block_table
            self.block_table = grown
