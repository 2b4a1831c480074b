"""Batch and result records of tensor parallelism: every field round-trips, through a real
broadcast ring, over many seeded random steps; bad blobs are refused with a clear error."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from ringllm.ipc.ring import Ring
from ringllm.pipeline.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from ringllm.pipeline.executor import batch_records as br
from ringllm.pipeline.messages import LogprobRow
from ringllm.pipeline.sampling_params import MAX_SEED, MIN_SEED, RequestOutputKind, SamplingParams

IDS = ["0", "1_chat-42", "", "ü-ñ-日本-" * 9, "x" * 301]


def random_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.choice([None, rng.randint(1, 5000)])
    return SamplingParams(
        n=rng.randint(1, 4),
        presence_penalty=rng.uniform(-2, 2),
        frequency_penalty=rng.uniform(-2, 2),
        repetition_penalty=rng.uniform(0.1, 3.0),
        temperature=rng.choice([0.0, rng.uniform(0, 3), 0.7]),
        top_p=rng.uniform(0.01, 1.0),
        top_k=rng.choice([-1, 0, rng.randint(1, 100)]),
        min_p=rng.uniform(0, 1),
        seed=rng.choice([None, 0, MIN_SEED, MAX_SEED, -5, rng.randint(0, 2**40)]),
        stop_token_ids=[rng.randint(0, 50000) for _ in range(rng.randint(0, 3))],
        ignore_eos=rng.random() < 0.5,
        max_tokens=max_tokens,
        min_tokens=rng.randint(0, max_tokens or 10),
        logprobs=rng.choice([None, 0, rng.randint(1, 20)]),
        prompt_logprobs=rng.choice([None, 0, rng.randint(1, 20)]),
        skip_special_tokens=rng.random() < 0.5,
        spaces_between_special_tokens=rng.random() < 0.5,
        include_stop_str_in_output=rng.random() < 0.5,
        logit_bias=rng.choice(
            [None, {rng.randint(0, 9999): rng.uniform(-100, 100) for _ in range(rng.randint(1, 4))}]
        ),
        output_kind=rng.choice(list(RequestOutputKind)),
    )


class StepMaker:
    """Seeded random scheduler outputs that respect the protocol: a request is cached only
    after it was sent new, and finished ids may include ones the workers never saw."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.live: list[str] = []
        self.count = 0

    def next_id(self) -> str:
        self.count += 1
        return f"{self.rng.choice(IDS)}#{self.count}"

    def new_request(self, rid: str) -> NewRequestData:
        rng = self.rng
        num_prompt = rng.randint(1, 3000)
        token_ids = [rng.randint(0, 2**31 - 1) for _ in range(num_prompt + rng.randint(0, 5))]
        return NewRequestData(
            request_id=rid,
            token_ids=token_ids,
            num_prompt_tokens=num_prompt,
            sampling_params=random_params(rng),
            eos_token_ids=tuple(rng.randint(0, 60000) for _ in range(rng.randint(0, 3))),
            block_ids=[rng.randint(0, 2**20) for _ in range(rng.randint(0, 200))],
            num_computed_tokens=rng.randint(0, num_prompt),
        )

    def step(self) -> SchedulerOutput:
        rng = self.rng
        finished = set(rng.sample(self.live, k=min(len(self.live), rng.randint(0, 2))))
        self.live = [r for r in self.live if r not in finished]
        finished |= {f"never-scheduled-{self.count}"} if rng.random() < 0.3 else set()
        cached = [
            CachedRequestData(
                rid,
                [rng.randint(0, 9999) for _ in range(rng.randint(0, 4))],
                rng.randint(0, 2**31 - 1),
                resumed=rng.random() < 0.2,
                new_token_ids=[rng.randint(0, 2**31 - 1) for _ in range(rng.randint(0, 2))]
                if rng.random() < 0.5
                else [],
            )
            for rid in self.live
            if rng.random() < 0.7
        ]
        new = [self.new_request(self.next_id()) for _ in range(rng.randint(0, 3))]
        self.live += [n.request_id for n in new]
        scheduled = [c.request_id for c in cached] + [n.request_id for n in new]
        rng.shuffle(scheduled)
        return SchedulerOutput(
            new_requests=new,
            cached_requests=cached,
            num_scheduled_tokens={rid: rng.randint(1, 2048) for rid in scheduled},
            finished_request_ids=finished,
            num_preempted=rng.randint(0, 3),
            scheduled_spec_tokens={
                rid: [rng.randint(0, 2**31 - 1) for _ in range(rng.randint(1, 16))]
                for rid in scheduled
                if rng.random() < 0.4
            },
        )


def as_rank_sees(sched: SchedulerOutput, seen: set[str]) -> SchedulerOutput:
    """The step as a rank must rebuild it: stop strings stay on the front end, and finished
    ids of requests the ranks were never sent are not sent."""
    new = [
        dataclasses.replace(n, sampling_params=dataclasses.replace(n.sampling_params, stop=[]))
        for n in sched.new_requests
    ]
    finished = {rid for rid in sched.finished_request_ids if rid in seen}
    return dataclasses.replace(sched, new_requests=new, finished_request_ids=finished)


def test_scheduler_outputs_round_trip_through_a_broadcast_ring():
    maker = StepMaker(seed=7)
    encoder = br.BatchEncoder()
    decoders = [br.BatchDecoder(), br.BatchDecoder()]
    seen: set[str] = set()
    with Ring.create(
        "test-batch", br.BATCH, 256, num_readers=2, blob_bytes_field="blob_bytes"
    ) as ring:
        writer = ring.writer()
        readers = [ring.reader(0), ring.reader(1)]
        for _ in range(40):
            sched = maker.step()
            expected = as_rank_sees(sched, seen)
            seen |= {n.request_id for n in sched.new_requests}
            seen -= sched.finished_request_ids
            for record, blob in encoder.encode(sched):
                writer.write_with_blob(record, blob)  # 40 steps wrap the ring many times
                for reader, decoder in zip(readers, decoders, strict=True):
                    got = reader.read_with_blobs(1, timeout_s=1.0)
                    rec, rec_blob = got[0][0], got[1][0]
                    if int(rec["kind"]) == br.KIND_NEW:
                        decoder.add_new(rec, rec_blob)
                    else:
                        assert decoder.finish_step(rec, rec_blob) == expected
            # Handles are dropped on both sides once their request finished.
            assert set(encoder.handle_of) == seen
            for decoder in decoders:
                assert set(decoder.id_of.values()) == seen
                assert sorted(decoder.id_of) == sorted(encoder.handle_of.values())


def test_sampling_fields_are_exact_not_rounded_to_float32():
    params = SamplingParams(temperature=0.7, top_p=0.9, logit_bias={3: 0.1}, seed=-(2**63))
    sched = SchedulerOutput(
        new_requests=[NewRequestData("r", [1, 2], 2, params, (0,), [4], 0)],
        num_scheduled_tokens={"r": 2},
    )
    (rec, blob), (step, step_blob) = br.BatchEncoder().encode(sched)
    decoder = br.BatchDecoder()
    decoder.add_new(rec[0], blob.view(np.uint8))
    got = decoder.finish_step(step[0], step_blob.view(np.uint8)).new_requests[0].sampling_params
    assert got.temperature == 0.7 and got.top_p == 0.9 and got.logit_bias == {3: 0.1}
    assert got.seed == -(2**63)


def random_output(rng: random.Random, req_ids: list[str]) -> ModelRunnerOutput:
    def row() -> LogprobRow:
        n = rng.randint(1, 21)
        values = np.float32(np.random.default_rng(rng.randint(0, 99)).normal(size=n) * 5).tolist()
        return LogprobRow(
            [rng.randint(0, 150000) for _ in range(n)], values, rng.randint(1, 150000)
        )

    tokens = [rng.choice([None, rng.randint(0, 2**31 - 1)]) for _ in req_ids]
    logprobs = [row() if t is not None and rng.random() < 0.6 else None for t in tokens]
    prompt = {
        rid: [row() for _ in range(rng.randint(0, 5))] for rid in req_ids if rng.random() < 0.4
    }
    out = ModelRunnerOutput(list(req_ids), tokens, logprobs, prompt)
    for rid, token, lp in zip(req_ids, tokens, logprobs, strict=True):
        if token is not None and rng.random() < 0.5:  # verified drafts, accepted ones first
            run = [rng.randint(0, 2**31 - 1) for _ in range(rng.randint(1, 16))]
            out.accepted_token_ids[rid] = run
            if lp is not None:
                out.accepted_logprobs[rid] = [row() for _ in run]
        if token is not None and rng.random() < 0.5:
            out.spec_token_ids[rid] = [rng.randint(0, 2**31 - 1) for _ in range(rng.randint(1, 16))]
    return out


@pytest.mark.parametrize("seed", range(20))
def test_runner_outputs_round_trip(seed):
    rng = random.Random(seed)
    req_ids = [f"r{i}" for i in range(rng.randint(0, 12))]
    out = random_output(rng, req_ids)
    record, blob = br.encode_output(out)
    assert br.decode_output(record[0], blob.view(np.uint8), req_ids) == out


def test_runner_output_through_the_result_ring_and_the_control_records():
    out = random_output(random.Random(3), ["a", "b", "c"])
    with Ring.create("test-result", br.RESULT, 64, blob_bytes_field="blob_bytes") as ring:
        writer, reader = ring.writer(), ring.reader()
        writer.write_with_blob(*br.encode_output(out))
        writer.write(br.encode_value(br.KIND_NUM_BLOCKS, 12345678901))
        writer.write_with_blob(*br.encode_error("rank 1: boom ✗"))
        records, blobs = reader.read_with_blobs(3, timeout_s=1.0)
    assert br.decode_output(records[0], blobs[0], ["a", "b", "c"]) == out
    assert int(records[1]["kind"]) == br.KIND_NUM_BLOCKS and int(records[1]["value"]) == 12345678901
    assert int(records[2]["kind"]) == br.KIND_ERROR
    assert blobs[2].tobytes().decode() == "rank 1: boom ✗"
    assert int(br.encode_init_kv(77)[0]["value"]) == 77
    assert int(br.encode_shutdown()[0]["kind"]) == br.KIND_SHUTDOWN


def test_bad_blobs_and_protocol_errors_are_refused_by_name():
    sched = StepMaker(seed=1)
    step = sched.step()
    while not step.new_requests:
        step = sched.step()
    encoder = br.BatchEncoder()
    (rec, blob), *_ = encoder.encode(step)
    with pytest.raises(ValueError, match=r"NEW record: blob has \d+ ints, its counts say \d+"):
        br.BatchDecoder().add_new(rec[0], blob[:-1])
    with pytest.raises(ValueError, match="sent as new twice"):
        encoder.encode(SchedulerOutput(new_requests=step.new_requests[:1]))
    out = ModelRunnerOutput(["a"], [5], [None])
    record, out_blob = br.encode_output(out)
    with pytest.raises(ValueError, match="answers 1 requests, the step scheduled 2"):
        br.decode_output(record[0], out_blob, ["a", "b"])
    with pytest.raises(ValueError, match="blob has 7 ints, its rows used 6"):
        br.decode_output(record[0], np.concatenate([out_blob, np.zeros(1, np.int32)]), ["a"])
