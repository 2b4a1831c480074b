"""InputBatch: persistent rows updated from the diffs, and the step inputs built from them
with array operations, against the same inputs built request by request in Python."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringllm.pipeline.core.scheduler_output import CachedRequestData, NewRequestData
from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.worker.input_batch import InputBatch

BS = 4


def new(rid, tokens, computed, blocks, num_prompt=None, **params):
    return NewRequestData(
        rid,
        list(tokens),
        len(tokens) if num_prompt is None else num_prompt,
        SamplingParams(**params),
        (0,),
        list(blocks),
        computed,
    )


def reference(batch: InputBatch, req_ids, counts):
    """The step inputs written out one request at a time (decodes first, stable)."""
    order = sorted(range(len(req_ids)), key=lambda i: counts[i] != 1)
    ids, pos, slots, tables, logits = [], [], [], [], []
    max_blocks = 1
    for i in order:
        row = batch.row_of[req_ids[i]]
        start = int(batch.num_computed_tokens[row])
        max_blocks = max(max_blocks, -(-(start + counts[i]) // BS))
    token = 0
    for i in order:
        row = batch.row_of[req_ids[i]]
        start, n = int(batch.num_computed_tokens[row]), counts[i]
        for p in range(start, start + n):
            ids.append(int(batch.token_ids[row, p]))
            pos.append(p)
            slots.append(int(batch.block_table[row, p // BS]) * BS + p % BS)
        tables.append(batch.block_table[row, :max_blocks].tolist())
        samples = start + n >= batch.num_tokens[row]
        prompt = batch.prompt_logprobs[row] >= 0 and start < batch.num_prompt_tokens[row]
        if prompt:
            logits += list(range(token, token + n))
        elif samples:
            logits.append(token + n - 1)
        token += n
    return order, ids, pos, slots, tables, logits


def test_step_inputs_match_the_request_by_request_reference():
    rng = np.random.default_rng(0)
    batch = InputBatch(BS, max_model_len=512)
    req_ids, counts = [], []
    for i in range(40):
        length = int(rng.integers(1, 60))
        tokens = rng.integers(0, 1000, length).tolist()
        computed = int(rng.integers(0, length))
        blocks = rng.permutation(400)[: -(-length // BS)].tolist()
        prompt_lp = 2 if i % 7 == 0 else None
        batch.add(new(f"r{i}", tokens, computed, blocks, prompt_logprobs=prompt_lp))
        req_ids.append(f"r{i}")
        counts.append(1 if i % 3 == 0 else int(rng.integers(1, length - computed + 1)))
    counts = [
        min(c, int(batch.num_tokens[batch.row_of[r]] - batch.num_computed_tokens[batch.row_of[r]]))
        for r, c in zip(req_ids, counts, strict=True)
    ]
    step = batch.prepare(req_ids, np.array(counts))
    order, ids, pos, slots, tables, logits = reference(batch, req_ids, counts)
    assert step.order.tolist() == order
    assert step.input_ids.tolist() == ids and step.positions.tolist() == pos
    assert step.slot_mapping.tolist() == slots and step.block_tables.tolist() == tables
    assert step.logits_indices.tolist() == logits
    assert step.num_decodes == sum(1 for c in counts if c == 1)
    assert step.query_start_loc[-1] == len(ids) and step.seq_lens.dtype == np.int32


def test_rows_follow_the_diff_and_are_reused():
    batch = InputBatch(BS, max_model_len=4096)
    batch.add(new("a", [1, 2, 3, 4, 5], 0, [7, 8]))
    batch.add(new("b", [9] * 3, 0, [2]))
    row_a = batch.row_of["a"]
    batch.append_tokens(np.array([row_a]), np.array([6], np.int32))
    assert batch.token_ids[row_a, :6].tolist() == [1, 2, 3, 4, 5, 6]
    assert batch.sampling[row_a].output_token_ids == [6]
    batch.update(CachedRequestData("a", [11], 5))
    assert (
        batch.block_table[row_a, :3].tolist() == [7, 8, 11]
        and batch.num_computed_tokens[row_a] == 5
    )
    batch.update(CachedRequestData("a", [3, 4], 0, resumed=True))  # preempted, then resumed
    assert batch.num_blocks[row_a] == 2 and batch.block_table[row_a, :2].tolist() == [3, 4]
    assert batch.sampling[row_a].output_token_ids == [6]  # the sampling state survives
    batch.remove("a")
    batch.add(new("c", [5], 0, [1]))
    assert batch.row_of["c"] == row_a and len(batch) == 2  # the freed row is taken again
    with pytest.raises(ValueError, match="new twice"):
        batch.add(new("c", [5], 0, [1]))


def test_rows_and_columns_grow_on_demand():
    batch = InputBatch(BS, max_model_len=1 << 16)
    long = list(range(3000))  # wider than the first token columns
    for i in range(150):  # more than the first rows
        batch.add(
            new(
                f"r{i}",
                long if i == 149 else [i],
                0,
                list(range(-(-len(long if i == 149 else [i]) // BS))),
            )
        )
    row = batch.row_of["r149"]
    assert batch.token_ids[row, :3000].tolist() == long
    assert batch.num_blocks[row] == 750 and batch.block_table[row, 749] == 749
    step = batch.prepare(["r149", "r3"], np.array([3000, 1]))
    assert step.input_ids[0] == 3 and step.input_ids[1:].tolist() == long  # decode first


def test_a_step_over_the_context_is_refused():
    batch = InputBatch(BS, max_model_len=8)
    batch.add(new("a", list(range(9)), 0, [0, 1, 2]))
    with pytest.raises(ValueError, match="over max_model_len 8"):
        batch.prepare(["a"], np.array([9]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_inputs_go_through_pinned_buffers_kept_across_steps():
    from ringllm.pipeline.worker.model_runner import _Staging

    staging = _Staging("cuda")
    first = staging.put("ids", np.arange(10, dtype=np.int64))
    buffer = staging._pinned["ids"]
    assert buffer.is_pinned() and first.device.type == "cuda"
    torch.cuda.synchronize()  # as a step's sampling does before the next step's put
    assert first.cpu().tolist() == list(range(10))
    second = staging.put("ids", np.arange(5, dtype=np.int64) * 3)
    assert staging._pinned["ids"] is buffer  # no new pinned allocation for a smaller step
    torch.cuda.synchronize()
    assert second.cpu().tolist() == [0, 3, 6, 9, 12]
