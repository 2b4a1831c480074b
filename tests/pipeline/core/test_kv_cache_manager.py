"""KVCacheManager: chained block hashes, prefix hits and their stats, allocate_slots, free,
the preallocated block-table rows."""

from __future__ import annotations

import numpy as np
import pytest

from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.sampling_params import SamplingParams

BS = 4  # block size in tokens: small so a few tokens make several blocks


def make_request(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params))


def make_kv(num_blocks: int = 16, max_model_len: int = 64, max_num_seqs: int = 4, **kw):
    return KVCacheManager(num_blocks, BS, max_model_len, max_num_seqs, **kw)


def admit(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """What the scheduler does for a waiting request: prefix lookup, then the whole rest."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return hits, num_hit_tokens


def test_block_hashes_chain_through_the_prefix():
    kv = make_kv()
    base = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = make_request("a", base)
    b = make_request("b", base[:4] + [7, 7, 7, 7] + base[8:])  # block 1 differs
    c = make_request("c", [1, 1, 1, 1] + base[4:])  # block 0 differs, block 1 equal
    for request in (a, b, c):
        kv.get_computed_blocks(request)
    # Only full blocks among the first num_tokens - 1 are hashed.
    assert len(a.block_hashes) == 2
    assert b.block_hashes[0] == a.block_hashes[0]
    assert b.block_hashes[1] != a.block_hashes[1]
    # Same tokens in block 1, different parent: a different block.
    assert c.block_hashes[1] != a.block_hashes[1]
    assert len(set(a.block_hashes + b.block_hashes + c.block_hashes)) == 5


def test_second_request_reuses_cached_full_blocks():
    kv = make_kv()
    prompt = list(range(50, 61))  # 11 tokens: blocks [0..3] [4..7] + 3 tokens
    a = make_request("a", prompt)
    assert admit(kv, a) == ([], 0)
    a_blocks = kv.block_ids("a").tolist()
    assert len(a_blocks) == 3
    b = make_request("b", prompt[:9] + [999, 998])  # shares both full blocks
    hits, num_hit_tokens = admit(kv, b)
    assert hits == a_blocks[:2] and num_hit_tokens == 8
    assert kv.block_ids("b").tolist()[:2] == a_blocks[:2]
    assert kv.block_ids("b")[2] not in a_blocks
    assert kv.pool.ref_counts[a_blocks[:2]].tolist() == [2, 2]
    c = make_request("c", prompt[:6] + [1, 2, 3])  # shares block 0 only
    assert kv.get_computed_blocks(c) == ([a_blocks[0]], 4)
    assert kv.get_computed_blocks(c) == ([a_blocks[0]], 4)
    # Only admissions count: a lookup that is not followed by an allocation (a request
    # left waiting) is repeated every step and must not inflate the queries.
    stats = kv.prefix_stats.take()
    assert (stats.queries, stats.hits) == (11 + 11, 0 + 8)
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (0, 0)
    admit(kv, c)
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (9, 4)


def test_a_hit_always_leaves_one_token_to_compute():
    kv = make_kv()
    prompt = list(range(8))  # exactly 2 full blocks
    admit(kv, make_request("a", prompt))
    hits, num_hit_tokens = kv.get_computed_blocks(make_request("b", prompt))
    assert len(hits) == 1 and num_hit_tokens == 4
    hits, num_hit_tokens = kv.get_computed_blocks(make_request("c", prompt + [9]))
    assert len(hits) == 2 and num_hit_tokens == 8


def test_no_hits_with_caching_off_or_prompt_logprobs():
    prompt = list(range(30, 43))
    for kv, params in ((make_kv(enable_caching=False), {}), (make_kv(), {"prompt_logprobs": 1})):
        admit(kv, make_request("a", prompt, **params))
        assert kv.get_computed_blocks(make_request("b", prompt, **params)) == ([], 0)
        assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (0, 0)  # no lookup made


def test_allocate_slots_grows_block_by_block():
    kv = make_kv()
    r = make_request("r", list(range(6)))
    new = kv.allocate_slots(r, 6)
    assert len(new) == 2 and kv.block_ids("r").tolist() == new
    r.num_computed_tokens = 6
    r.append_output_token(6)
    assert kv.allocate_slots(r, 1) == []  # position 6 still fits in block 1
    r.num_computed_tokens = 7
    r.append_output_token(7)
    assert kv.allocate_slots(r, 1) == []  # position 7: block 1 is now full
    r.num_computed_tokens = 8
    r.append_output_token(8)
    third = kv.allocate_slots(r, 1)
    assert len(third) == 1 and kv.block_ids("r").tolist() == new + third
    assert kv.pool.num_free_blocks == 16 - 3
    # Every full block was identified as soon as its tokens were known.
    assert len(r.block_hashes) == 2
    assert [kv.pool.get_cached_block(h) for h in r.block_hashes] == new


def test_chunked_allocation_caches_only_full_blocks():
    kv = make_kv()
    r = make_request("r", list(range(10)))
    kv.allocate_slots(r, 6)  # chunk 1: tokens 0..5
    assert kv.pool.num_cached_blocks == 1
    r.num_computed_tokens = 6
    kv.allocate_slots(r, 4)  # chunk 2: tokens 6..9
    assert kv.pool.num_cached_blocks == 2 and len(kv.block_ids("r")) == 3


def test_short_pool_returns_none_and_changes_nothing():
    kv = make_kv(num_blocks=4)
    a = make_request("a", list(range(12)))
    admit(kv, a)
    kv.free(a)  # 3 free cached blocks + 1 empty
    b = make_request("b", list(range(12)) + [50] * 8)  # hits 3 blocks, needs 2 more
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 12
    before = (kv.pool.ref_counts.copy(), kv.pool.num_free_blocks, dict(kv.rows))
    # The hit blocks are free, so they count against the free blocks too: 3 + 2 > 4.
    assert kv.allocate_slots(b, 8, hits) is None
    assert (kv.pool.ref_counts == before[0]).all()
    assert (kv.pool.num_free_blocks, kv.rows) == before[1:]
    assert kv.pool.num_cached_blocks == 3
    c = make_request("c", list(range(12)) + [50] * 4)  # hits 3, needs 1: fits exactly
    hits, _ = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 4, hits) is not None
    assert kv.pool.num_free_blocks == 0


def test_free_releases_last_block_first():
    """The tail of a freed prompt is evicted before its head (it is the least shared)."""
    kv = make_kv(num_blocks=4)
    a = make_request("a", list(range(13)))  # 3 full blocks + 1 token
    admit(kv, a)
    blocks = kv.block_ids("a").tolist()
    hashes = list(a.block_hashes)
    kv.free(a)
    assert kv.rows == {} and kv.pool.num_free_blocks == 4
    other = make_request("x", [900, 901])
    kv.allocate_slots(other, 2)
    assert kv.block_ids("x").tolist() == [blocks[3]]  # the partial block: never cached
    y = make_request("y", [800, 801])
    kv.allocate_slots(y, 2)
    assert kv.block_ids("y").tolist() == [blocks[2]]  # then the last full block
    assert kv.pool.get_cached_block(hashes[2]) is None
    assert [kv.pool.get_cached_block(h) for h in hashes[:2]] == blocks[:2]
    # A new request with a's prompt still reuses the surviving head.
    assert kv.get_computed_blocks(make_request("a2", list(range(13))))[1] == 8


def test_shared_blocks_free_only_when_last_owner_leaves():
    kv = make_kv()
    prompt = list(range(9))
    a, b = make_request("a", prompt), make_request("b", prompt)
    admit(kv, a)
    admit(kv, b)
    shared = kv.block_ids("a").tolist()[:2]
    assert kv.pool.ref_counts[shared].tolist() == [2, 2]
    kv.free(a)
    assert kv.pool.ref_counts[shared].tolist() == [1, 1]
    kv.free(b)
    assert not kv.pool.ref_counts.any() and kv.pool.num_free_blocks == 16
    kv.free(b)  # a second free of the same request is a no-op, not a double free
    assert kv.pool.num_free_blocks == 16


def test_block_table_rows_are_preallocated_and_reused():
    kv = make_kv(max_model_len=30, max_num_seqs=2)
    table = kv.block_tables
    assert table.shape == (2, 8) and table.dtype == np.int32  # ceil(30 / 4) blocks per row
    a, b, c = (make_request(r, [1, 2, 3]) for r in "abc")
    assert kv.allocate_slots(a, 3) is not None and kv.allocate_slots(b, 3) is not None
    assert kv.allocate_slots(c, 3) is None  # no row left
    assert "c" not in kv.rows and kv.pool.num_free_blocks == 14
    assert len(kv.block_ids("c")) == 0
    kv.free(a)
    assert kv.allocate_slots(c, 3) is not None
    assert kv.rows["c"] != kv.rows["b"]
    assert kv.block_tables is table
    row = kv.rows["c"]
    assert kv.block_tables[row, : kv.num_blocks_of_row[row]].tolist() == kv.block_ids("c").tolist()


def test_reset_prefix_cache_stops_hits():
    kv = make_kv()
    prompt = list(range(9))
    a = make_request("a", prompt)
    admit(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    assert kv.pool.num_cached_blocks == 0


@pytest.mark.parametrize("used", [0, 5, 16])
def test_usage_is_fraction_of_referenced_blocks(used):
    kv = make_kv()
    if used:
        kv.allocate_slots(make_request("a", [1] * (used * BS)), used * BS)
    assert kv.usage == pytest.approx(used / 16)


def test_reset_while_running_forgets_old_blocks_caches_new_ones():
    kv = make_kv()
    r = make_request("r", list(range(8)))  # 2 full blocks
    admit(kv, r)
    kv.reset_prefix_cache()
    for t in range(8, 12):  # decode until block 2 is full
        r.append_output_token(t)
        kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    blocks = kv.block_ids("r").tolist()
    # Only the block filled after the reset is identified again.
    assert [kv.pool.get_cached_block(h) for h in r.block_hashes] == [None, None, blocks[2]]
    assert kv.get_computed_blocks(make_request("s", list(range(12)) + [0]))[1] == 0
