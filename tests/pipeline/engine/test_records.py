"""The request / output record codecs: struct layouts equal the dtypes, fields round-trip."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ringllm.pipeline.engine import records
from ringllm.pipeline.messages import EngineCoreOutput, EngineCoreRequest, LogprobRow
from ringllm.pipeline.sampling_params import SamplingParams


@pytest.mark.parametrize("dtype", [records.REQUEST, records.OUTPUT])
def test_struct_of_writes_the_same_bytes_as_numpy(dtype):
    packer = records.struct_of(dtype)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, dtype.itemsize * 3, dtype=np.uint8).tobytes()
    as_numpy = np.frombuffer(raw, dtype)
    # The bytes numpy stores survive unpack -> pack unchanged, field for field.
    unpacked = list(packer.iter_unpack(raw))
    assert b"".join(packer.pack(*fields) for fields in unpacked) == raw
    first = dict(zip(_flat_names(dtype), unpacked[0], strict=True))
    for name in dtype.names:
        value = as_numpy[0][name]
        if np.ndim(value):
            assert [first[f"{name}[{i}]"] for i in range(value.size)] == value.tolist()
        elif isinstance(value, np.floating) and math.isnan(value):
            assert math.isnan(first[name])
        else:
            assert first[name] == value


def _flat_names(dtype: np.dtype) -> list[str]:
    names = []
    for name in dtype.names:
        shape = dtype.fields[name][0].shape
        names += [f"{name}[{i}]" for i in range(shape[0])] if shape else [name]
    return names


def test_struct_of_refuses_a_field_without_a_struct_code():
    with pytest.raises(ValueError, match="record field 'z' of type complex64 has no struct code"):
        records.struct_of(np.dtype([("a", "<i4"), ("z", "<c8")]))


def test_add_request_round_trips_every_field():
    params = SamplingParams(
        temperature=0.5,
        top_p=0.75,
        top_k=20,
        min_p=0.125,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        repetition_penalty=1.5,
        seed=2**63 + 5,
        ignore_eos=True,
        max_tokens=77,
        min_tokens=3,
        logprobs=2,
        prompt_logprobs=1,
        stop_token_ids=[9, 8],
        logit_bias={5: -1.5, 6: 2.0},
        skip_special_tokens=False,
    )
    request = EngineCoreRequest("x é", list(range(100, 140)), params, (2, 1), 1234.5, -3)
    record, blob = records.encode_add(42, request)
    assert record.dtype == records.REQUEST and record.shape == (1,)
    assert record["kind"][0] == records.KIND_ADD and record["seq"][0] == 42
    assert record["blob_bytes"][0] == 0  # set by write_with_blob
    back = records.decode_add(record[0], blob.view(np.uint8))
    assert back.request_id == "x é"  # the request's own id, once on the wire
    assert back.prompt_token_ids == request.prompt_token_ids
    assert back.eos_token_ids == (2, 1)
    assert back.priority == -3 and back.arrival_time == 1234.5
    # every float exactly as it was (float64 on the wire): what the request samples with
    assert back.sampling_params == params
    got = back.sampling_params
    assert (got.top_k, got.seed, got.ignore_eos, got.max_tokens) == (20, 2**63 + 5, True, 77)
    assert (got.min_tokens, got.logprobs, got.prompt_logprobs) == (3, 2, 1)
    assert got.stop_token_ids == [9, 8] and got.logit_bias == {5: -1.5, 6: 2.0}


def test_add_request_without_optional_fields_and_a_short_blob():
    request = EngineCoreRequest("y", [7], SamplingParams(max_tokens=None, seed=-5), (), 0.0)
    record, blob = records.encode_add(1, request)
    back = records.decode_add(record[0], blob.view(np.uint8))
    got = back.sampling_params
    assert back.prompt_token_ids == [7]
    assert (got.seed, got.max_tokens, got.logprobs, got.logit_bias) == (-5, None, None, None)
    with pytest.raises(ValueError, match="blob has 0 ints, its counts say 2"):
        records.decode_add(record[0], np.zeros(0, np.uint8))


def test_outputs_split_over_records_and_unpack_to_the_same_fields():
    outputs = [
        EngineCoreOutput("a", list(range(10)), finish_reason="stop", stop_reason=0, queued_s=0.5),
        EngineCoreOutput("b", [], num_cached_tokens=16),
        EngineCoreOutput("c", [5], new_logprobs=[LogprobRow([5, 6], [-0.5, -1.0], 1)]),
    ]
    recs, blobs = records.encode_outputs([11, 12, 13], outputs)
    assert len(recs) == 5 and blobs[:4] == [None] * 4 and blobs[4] is not None
    np.testing.assert_array_equal(recs["seq"], [11, 11, 11, 12, 13])
    np.testing.assert_array_equal(recs["more"], [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(recs["num_tokens"], [4, 4, 2, 0, 1])
    np.testing.assert_array_equal(recs["tokens"][:3].ravel()[:10], list(range(10)))
    assert recs["has_stop_token"][2] == 1 and recs["stop_token"][2] == 0
    assert recs["finish_reason"][2] == 1 and recs["queued_s"][2] == 0.5
    assert np.isnan(recs["queued_s"][3]) and recs["num_cached_tokens"][3] == 16
    rows = list(records.unpack_outputs(recs))
    assert [row[7] for row in rows] == [11, 11, 11, 12, 13]  # seq
    assert rows[4][10:11] == (5,)  # the tokens follow stop_token
    sample, prompt, pooled = records.decode_blob(blobs[4])
    assert pooled is None
    assert sample[0].token_ids == [5, 6] and prompt == []


def test_stats_round_trip_through_a_stats_record():
    from ringllm.pipeline.stats import PrefixCacheStats, SchedulerStats

    stats = SchedulerStats(
        num_running=3,
        num_waiting=4,
        kv_cache_usage=0.25,
        prefix_cache=PrefixCacheStats(10, 7),
        num_preemptions_total=2,
    )
    (row,) = records.unpack_outputs(records.encode_stats(stats))
    assert row[0] == records.KIND_STATS
    assert records.decode_stats(row) == stats


def test_stats_records_read_together_keep_every_count():
    """Counts in a STATS record cover only its own interval: a front end that reads several
    at once must add them up (gauges: the latest)."""
    from ringllm.pipeline.engine.ring_client import merge_stats
    from ringllm.pipeline.stats import (
        KVTierStats,
        PrefixCacheStats,
        SchedulerStats,
        SpecDecodingStats,
        TierStats,
    )

    def stats(running, queries, hits, drafts, tier_hits):
        return SchedulerStats(
            num_running=running,
            prefix_cache=PrefixCacheStats(queries, hits),
            spec_decoding=SpecDecodingStats(drafts, 2 * drafts, drafts, [drafts]),
            kv_tiers=KVTierStats(host=TierStats(100, running, tier_hits, tier_hits, 1, 1)),
        )

    rows = [records.decode_stats(next(records.unpack_outputs(records.encode_stats(s))))
            for s in (stats(1, 10, 4, 2, 3), stats(5, 20, 6, 1, 7))]  # fmt: skip
    merged = merge_stats(merge_stats(None, rows[0]), rows[1])
    assert merged.num_running == 5
    assert (merged.prefix_cache.queries, merged.prefix_cache.hits) == (30, 10)
    assert merged.spec_decoding.num_drafts == 3 and merged.spec_decoding.accepted_per_pos == [3]
    host = merged.kv_tiers.host
    assert (host.queries, host.hits, host.blocks_in, host.blocks_used) == (10, 10, 2, 5)
