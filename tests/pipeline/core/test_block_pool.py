"""BlockPool: free-queue order (LRU), reference counts, the prefix-cache index, usage.

The oracle for the randomized test is a plain `collections.OrderedDict` model of the same
rules (allocate from the front, free to the back, a hit pulls a block out of the middle).
"""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

from ringllm.pipeline.core.block_pool import BlockPool


def free_queue(pool: BlockPool) -> list[int]:
    """Walks the intrusive free list from head to tail (the sentinel is index num_blocks)."""
    sentinel = pool.num_blocks
    order, block = [], int(pool._next[sentinel])
    while block != sentinel:
        order.append(block)
        assert len(order) <= pool.num_blocks, "free list has a cycle"
        block = int(pool._next[block])
    # The backward links must describe the same list.
    back, block = [], int(pool._prev[sentinel])
    while block != sentinel:
        back.append(block)
        block = int(pool._prev[block])
        assert len(back) <= pool.num_blocks, "free list has a backward cycle"
    assert back[::-1] == order
    return order


def check_invariants(pool: BlockPool) -> None:
    order = free_queue(pool)
    assert len(order) == len(set(order)) == pool.num_free_blocks
    assert set(order) == set(np.flatnonzero(pool.ref_counts == 0).tolist())
    assert (pool.ref_counts >= 0).all()
    for block_hash, block in pool._cached.items():
        assert pool.block_hashes[block] == block_hash


def test_starts_all_free_in_id_order():
    pool = BlockPool(5)
    assert free_queue(pool) == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 5 and pool.usage == 0.0 and pool.num_cached_blocks == 0
    assert pool.get_new_blocks(5) == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    assert pool.ref_counts.tolist() == [1] * 5
    check_invariants(pool)


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks: need at least 1 KV block, got 0"):
        BlockPool(0)


def test_over_allocation_names_counts_and_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(RuntimeError, match="asked for 2 KV blocks, only 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1 and free_queue(pool) == [3]
    check_invariants(pool)


def test_freed_blocks_are_reused_in_free_order():
    pool = BlockPool(4)
    pool.get_new_blocks(4)
    pool.free_blocks([2, 0, 3, 1])
    assert free_queue(pool) == [2, 0, 3, 1]
    assert pool.get_new_blocks(3) == [2, 0, 3]
    assert free_queue(pool) == [1]
    check_invariants(pool)


def test_usage_counts_referenced_blocks_only():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)
    assert pool.usage == pytest.approx(3 / 8)
    pool.cache_block(blocks[0], 111)
    pool.free_blocks(blocks)
    # A free block that still holds a cached prefix counts as free.
    assert pool.num_cached_blocks == 1
    assert pool.usage == 0.0


def test_shared_block_ref_counts():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.touch([block])
    assert pool.ref_counts[block] == 3
    pool.free_blocks([block])
    pool.free_blocks([block])
    assert pool.ref_counts[block] == 1 and block not in free_queue(pool)
    pool.free_blocks([block])
    assert pool.ref_counts[block] == 0 and free_queue(pool)[-1] == block
    check_invariants(pool)


def test_double_free_is_an_error():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError, match=f"KV block {blocks[0]} freed more often"):
        pool.free_blocks(blocks)


def test_cached_free_blocks_are_evicted_lru():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for block in blocks:
        pool.cache_block(block, 1000 + block)
    pool.free_blocks([1, 3, 0, 2])  # 1 freed first: least recently used
    assert pool.num_cached_blocks == 4
    # Every freed cached block is still reusable until it is handed out again.
    for block in blocks:
        assert pool.get_cached_block(1000 + block) == block
    assert pool.get_new_blocks(2) == [1, 3]
    assert pool.get_cached_block(1001) is None and pool.get_cached_block(1003) is None
    assert pool.get_cached_block(1000) == 0 and pool.get_cached_block(1002) == 2
    assert pool.block_hashes[1] is None and pool.block_hashes[3] is None
    assert pool.num_cached_blocks == 2
    check_invariants(pool)


def test_hit_on_free_block_pulls_it_out_of_the_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_block(blocks[1], 77)
    pool.free_blocks(blocks)
    assert free_queue(pool) == [0, 1, 2, 3]
    pool.touch([pool.get_cached_block(77)])
    assert free_queue(pool) == [0, 2, 3] and pool.num_free_blocks == 3
    assert pool.ref_counts[1] == 1
    # Freed again, it goes to the tail: now the most recently used.
    pool.free_blocks([1])
    assert free_queue(pool) == [0, 2, 3, 1]
    assert pool.get_cached_block(77) == 1
    check_invariants(pool)


def test_a_block_keeps_its_first_hash():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 5)
    pool.cache_block(a, 6)  # already identified: a block's contents do not change
    assert pool.block_hashes[a] == 5 and pool.get_cached_block(6) is None
    # A second copy of the same contents: the index keeps pointing at the first.
    pool.cache_block(b, 5)
    assert pool.get_cached_block(5) == a and pool.num_cached_blocks == 1
    pool.free_blocks([b, a])
    pool.get_new_blocks(1)  # evicts b, which the index does not point at
    assert pool.get_cached_block(5) == a
    pool.get_new_blocks(1)  # evicts a
    assert pool.get_cached_block(5) is None and pool.num_cached_blocks == 0


def test_caching_disabled_never_indexes():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], 9)
    assert pool.get_cached_block(9) is None and pool.num_cached_blocks == 0


def test_reset_prefix_cache_forgets_everything_keeps_allocations():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    for i, block in enumerate(blocks):
        pool.cache_block(block, i)
    pool.free_blocks(blocks[:2])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert all(pool.get_cached_block(i) is None for i in range(3))
    assert all(h is None for h in pool.block_hashes)
    assert pool.ref_counts[blocks[2]] == 1 and pool.num_free_blocks == 3
    check_invariants(pool)


def test_queue_arrays_are_preallocated():
    """Allocation and freeing rewrite links in place: no array is rebuilt per call."""
    pool = BlockPool(16)
    arrays = (pool._next, pool._prev, pool.ref_counts)
    for _ in range(5):
        blocks = pool.get_new_blocks(7)
        pool.touch(blocks[:2])
        pool.free_blocks(blocks[::-1])
        pool.free_blocks(blocks[:2])
    assert all(
        a is b for a, b in zip(arrays, (pool._next, pool._prev, pool.ref_counts), strict=True)
    )
    check_invariants(pool)


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_ordered_dict_model(seed):
    """Random allocate / touch / free / cache against an OrderedDict model of the LRU rules."""
    rng = random.Random(seed)
    num_blocks = 12
    pool = BlockPool(num_blocks)
    free = OrderedDict((b, None) for b in range(num_blocks))  # head first
    refs = [0] * num_blocks
    hash_of: dict[int, int] = {}  # block -> hash (model of block_hashes)
    index: dict[int, int] = {}  # hash -> block
    owned: list[int] = []  # one entry per reference held
    next_hash = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.35:
            count = rng.randint(0, 4)
            if count > len(free):
                with pytest.raises(RuntimeError):
                    pool.get_new_blocks(count)
                continue
            expected = [free.popitem(last=False)[0] for _ in range(count)]
            for block in expected:
                if block in hash_of:
                    h = hash_of.pop(block)
                    if index.get(h) == block:
                        del index[h]
                refs[block] = 1
            assert pool.get_new_blocks(count) == expected
            owned += expected
        elif op < 0.5 and index:
            block = pool.get_cached_block(rng.choice(list(index)))
            assert block is not None
            if refs[block] == 0:
                del free[block]
            refs[block] += 1
            pool.touch([block])
            owned.append(block)
        elif op < 0.65 and owned:
            block = rng.choice(owned)
            if block not in hash_of:
                hash_of[block] = next_hash
                index.setdefault(next_hash, block)
                next_hash += 1
            pool.cache_block(block, hash_of[block])
        elif owned:
            rng.shuffle(owned)
            count = rng.randint(1, len(owned))
            released, owned = owned[:count], owned[count:]
            for block in released:
                refs[block] -= 1
                if refs[block] == 0:
                    free[block] = None
            pool.free_blocks(released)
        assert free_queue(pool) == list(free)
        assert pool.ref_counts.tolist() == refs
        assert pool._cached == index
        check_invariants(pool)
    pool.free_blocks(owned)
    assert pool.num_free_blocks == num_blocks and not pool.ref_counts.any()
