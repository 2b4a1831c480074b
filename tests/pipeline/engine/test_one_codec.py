"""One codec for SamplingParams on every wire: a request samples identically in process,
over the request ring (the engine core in its own process) and over the batch ring (the
tensor-parallel ranks), because every ring carries the same float64 fields
(pipeline/wire.py). Before, the request ring carried float32: temperature 0.7 arrived as
0.699999988."""

from __future__ import annotations

import numpy as np

from ringllm.pipeline import LLM, SamplingParams, wire
from ringllm.pipeline.core.scheduler_output import NewRequestData, SchedulerOutput
from ringllm.pipeline.engine import records
from ringllm.pipeline.executor import batch_records
from ringllm.pipeline.messages import EngineCoreRequest

PROMPTS = [[5, 6, 7, 8], list(range(30, 60)), [9, 10] * 8]


def seeded(i: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.7, top_p=0.93, seed=1234 + i, max_tokens=16, ignore_eos=True
    )


def test_every_ring_decodes_the_exact_floats():
    params = SamplingParams(
        temperature=0.7, top_p=0.93, min_p=0.1, repetition_penalty=1.1, logit_bias={3: 0.3}
    )
    request = EngineCoreRequest("r", [1, 2], params, (0,), 1.0)
    record, blob = records.encode_add(1, request)
    over_requests = records.decode_add(record[0], blob.view(np.uint8)).sampling_params
    new = NewRequestData("r", [1, 2], 2, params, (0,), [0], 0)
    messages = batch_records.BatchEncoder().encode(SchedulerOutput(new_requests=[new]))
    decoder = batch_records.BatchDecoder()
    decoder.add_new(messages[0][0][0], messages[0][1])
    over_batch = decoder._pending[0].sampling_params
    for got in (over_requests, over_batch):
        assert got.temperature == 0.7 and got.top_p == 0.93 and got.logit_bias == {3: 0.3}
        assert got == params  # every field, bit for bit
    assert wire.SAMPLING_NAMES == tuple(
        n for n in records.REQUEST.names if n in wire.SAMPLING_NAMES
    )
    assert set(wire.SAMPLING_NAMES) <= set(batch_records.BATCH.names)


def test_seeded_sampling_is_the_same_in_process_over_the_rings_and_over_the_tp_ranks(
    model_factory,
):
    path = model_factory("llama")  # heads and MLP divide by 2
    args = dict(model=str(path), dtype="float32", num_gpu_blocks_override=64)
    params = [seeded(i) for i in range(len(PROMPTS))]

    def tokens(llm: LLM) -> list[list[int]]:
        with llm:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    in_process = tokens(LLM(**args))
    over_request_ring = tokens(LLM(multiprocess=True, **args))
    over_batch_ring = tokens(LLM(tensor_parallel_size=2, **args))
    assert in_process == over_request_ring == over_batch_ring
    assert len({tuple(t) for t in in_process}) == len(PROMPTS)  # really sampled, per seed
