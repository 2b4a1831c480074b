"""KV groups (sliding-window layers freeing their blocks): the grouping, the manager's
columns, freeing, prefix hits across both kinds of group, and the capacity they buy."""

from __future__ import annotations

import pytest

from ringllm.pipeline.core.kv_cache_manager import TIER_BLOCK, KVCacheManager
from ringllm.pipeline.core.kv_groups import NULL_BLOCK, kv_groups
from ringllm.pipeline.core.kv_tiers import DiskTier, HostTier
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.sampling_params import SamplingParams

BS = 4


def gemma3_windows(num_layers: int, window: int, pattern: int = 6) -> list[int]:
    return [0 if (i + 1) % pattern == 0 else window for i in range(num_layers)]


def test_gemma3_270m_groups():
    groups = kv_groups(gemma3_windows(18, 512))
    assert groups.num_slots == 3 and groups.num_groups == 6
    assert groups.windows == (512,) * 5 + (0,)
    # the global layers 5, 11, 17 share the last group, a slot each
    assert [groups.group_of_layer[i] for i in (5, 11, 17)] == [5, 5, 5]
    assert [groups.slot_of_layer[i] for i in (5, 11, 17)] == [0, 1, 2]
    # no two layers of one group share a slot; every (group, slot) pair is one layer
    pairs = set(zip(groups.group_of_layer, groups.slot_of_layer, strict=True))
    assert len(pairs) == 18
    assert "6 groups of 3 layers (5 x window 512, 1 x global)" == groups.describe()


def test_uneven_kinds_pad_the_last_group():
    # Gemma 3 1B: 26 layers, 4 global -> groups of 4; 22 sliding -> 6 groups, the last of 2
    groups = kv_groups(gemma3_windows(26, 512))
    assert groups.num_slots == 4
    assert groups.windows == (512,) * 6 + (0,)
    assert sorted(groups.group_of_layer).count(5) == 2


def test_no_window_or_disabled_is_one_group():
    assert kv_groups([0] * 4).windows == (0,)
    off = kv_groups(gemma3_windows(12, 8), enabled=False)
    assert (off.windows, off.num_slots, off.slot_of_layer) == ((0,), 12, tuple(range(12)))
    every = kv_groups([8] * 4)  # Mistral: one group, sliding
    assert (every.windows, every.num_slots) == ((8,), 4)
    with pytest.raises(ValueError, match="negative window"):
        kv_groups([4, -1])


def _request(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64, **params), (), max_tokens=64)


def _manager(windows, num_blocks: int, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, 256, 8, groups=kv_groups(windows), **kwargs)


def _run(kv: KVCacheManager, request: Request, num_tokens: int, chunk: int) -> None:
    """Computes the request's first num_tokens (prompt, then tokens it 'samples'), `chunk`
    at a time, as the scheduler would."""
    while request.num_computed_tokens < num_tokens:
        n = min(chunk, num_tokens - request.num_computed_tokens)
        while request.num_tokens < request.num_computed_tokens + n:
            request.append_output_token(5)
        assert kv.allocate_slots(request, n) is not None
        request.num_computed_tokens += n


def test_sliding_groups_free_blocks_outside_their_window():
    # layers: 2 sliding (window 6) + 1 global... grouped by the fewest kind: groups of 1
    kv = _manager([6, 6, 0], num_blocks=200)
    assert kv.num_groups == 3
    request = _request("a", list(range(10, 50)))  # 40 tokens
    _run(kv, request, 40, chunk=8)
    row = kv.rows["a"]
    table = kv.block_tables[row, : kv.num_blocks_of_row[row]].reshape(-1, 3)
    assert table.shape == (10, 3)
    # the next query at 40 sees keys 35..40: blocks 8.. of the sliding groups are kept,
    # and so is every block freed only at the allocation that computed the last chunk
    # (its first query, 32, saw 27.. = block 6 on)
    assert (table[:6, :2] == NULL_BLOCK).all() and (table[6:, :2] != NULL_BLOCK).all()
    assert (table[:, 2] != NULL_BLOCK).all()
    held = 200 - 1 - kv.pool.num_free_blocks  # the null block is never free
    assert held == 10 + 2 * 4
    kv.free(request)
    assert kv.pool.num_free_blocks == 199


def test_prefix_hit_holds_every_groups_window():
    kv = _manager([6, 6, 0], num_blocks=200)
    prompt = list(range(100, 140))
    first = _request("a", prompt)
    _run(kv, first, 40, chunk=8)
    kv.free(first)
    # every block is cached: the hit is 39 tokens' full blocks (one token left to compute)
    hit, tokens = kv.get_computed_blocks(_request("b", prompt))
    assert tokens == 36
    columns = [hit[i : i + 3] for i in range(0, len(hit), 3)]
    # the first query after the hit (36) sees 31..: sliding blocks before block 7 are null
    assert all(c[0] == c[1] == NULL_BLOCK for c in columns[:7])
    assert all(NULL_BLOCK not in c for c in columns[7:])
    assert all(c[2] != NULL_BLOCK for c in columns)
    # the hit is taken: the blocks it names are referenced, the nulls are not touched
    second = _request("b", prompt)
    assert kv.allocate_slots(second, 4, hit) is not None
    assert kv.num_blocks_of_row[kv.rows["b"]] == 30
    kv.free(second)
    assert kv.pool.num_free_blocks == 199


def test_prefix_hit_shrinks_to_a_point_whose_window_is_cached():
    kv = _manager([6, 0], num_blocks=200)
    prompt = list(range(200, 240))
    first = _request("a", prompt)
    _run(kv, first, 40, chunk=8)
    row = kv.rows["a"]
    # the sliding group's block 8 is lost (evicted as another prompt's would be)
    kv.pool.uncache(int(kv.block_tables[row, 8 * 2 + 0]))
    kv.free(first)
    hit, tokens = kv.get_computed_blocks(_request("b", prompt))
    # a hit of 9 blocks needs sliding blocks 7 and 8: the longest that does not is 8
    # blocks (its window: blocks 6, 7)
    assert tokens == 32
    assert hit[6 * 2] != NULL_BLOCK and hit[5 * 2] == NULL_BLOCK
    # a global group's miss cuts every group's hit
    kv2 = _manager([6, 0], num_blocks=200)
    first = _request("a", prompt)
    _run(kv2, first, 40, chunk=8)
    kv2.pool.uncache(int(kv2.block_tables[kv2.rows["a"], 3 * 2 + 1]))
    kv2.free(first)
    assert kv2.get_computed_blocks(_request("b", prompt))[1] == 12


def _evict_all(kv: KVCacheManager, per_step: int = 1 << 30) -> None:
    """Takes every free block, `per_step` a step (their cached contents offloaded to the
    tiers behind, as other requests' allocations would), then gives them back."""
    taken = []
    while kv.pool.num_free_blocks:
        taken += kv.pool.get_new_blocks(min(per_step, kv.pool.num_free_blocks))
        kv.take_transfers()
    kv.pool.free_blocks(taken)


def _columns_of(kv: KVCacheManager, rid: str) -> list[int]:
    row = kv.rows[rid]
    return kv.block_tables[row, : kv.num_blocks_of_row[row]].tolist()


def test_every_groups_prefix_comes_back_from_the_host_tier():
    """Evicted from the device, each group's blocks go to host memory under the group's
    key; the hit is the one the device cache gave (the same null columns), every other
    column loaded into a new block, which is then cached on the device again."""
    prompt = list(range(100, 140))
    device = _manager([6, 6, 0], num_blocks=200)
    first = _request("a", prompt)
    _run(device, first, 40, chunk=8)
    device.free(first)
    want, want_tokens = device.get_computed_blocks(_request("b", prompt))

    host = HostTier(200)
    kv = _manager([6, 6, 0], num_blocks=40, host=host)
    first = _request("a", prompt)
    _run(kv, first, 40, chunk=8)
    kv.free(first)
    _evict_all(kv)
    assert kv.pool.num_cached_blocks == 0 and host.take_stats().blocks_used > 0
    second = _request("b", prompt)
    hit, tokens = kv.get_computed_blocks(second)
    assert tokens == want_tokens == 36
    nulls = [c == NULL_BLOCK for c in want]
    assert [c == NULL_BLOCK for c in hit] == nulls
    assert all(c == TIER_BLOCK for c, null in zip(hit, nulls, strict=True) if not null)
    assert len(hit.tier_hashes) == nulls.count(False)
    sources = [host.lookup(key) for key in hit.tier_hashes]
    assert kv.allocate_slots(second, 4, hit) is not None
    columns = _columns_of(kv, "b")
    loaded = [c for c, null in zip(columns[: len(hit)], nulls, strict=True) if not null]
    transfers = kv.take_transfers()
    assert transfers.to_device == list(zip(sources, loaded, strict=True))
    assert [c == NULL_BLOCK for c in columns[: len(hit)]] == nulls
    # loaded, the blocks are the device cache's again, each under its group's key
    for i, block_hash in enumerate(second.block_hashes[:9]):
        for g in range(3):
            if columns[i * 3 + g] != NULL_BLOCK:
                assert kv.pool.get_cached_block(kv._key(g, block_hash)) == columns[i * 3 + g]
    kv.free(second)
    assert kv.pool.num_free_blocks == 39


def test_a_hit_mixes_device_blocks_and_tier_loads():
    """Part of the prefix still on the device (the blocks freed last), part in host
    memory: the device's are referenced, the others loaded, the columns in place."""
    host = HostTier(200)
    kv = _manager([6, 0], num_blocks=40, host=host)
    prompt = list(range(300, 340))
    first = _request("a", prompt)
    _run(kv, first, 40, chunk=8)
    kv.free(first)
    taken = kv.pool.get_new_blocks(kv.pool.num_free_blocks - 6)  # the 6 freed last stay
    kv.pool.free_blocks(taken)
    kv.take_transfers()
    second = _request("b", prompt)
    hit, tokens = kv.get_computed_blocks(second)
    assert tokens == 36
    on_device = [c for c in hit if c not in (TIER_BLOCK, NULL_BLOCK)]
    assert 0 < len(on_device) and len(hit.tier_hashes) > 0
    assert kv.allocate_slots(second, 4, hit) is not None
    columns = _columns_of(kv, "b")
    for want, got in zip(hit, columns, strict=False):
        assert got == want or (want == TIER_BLOCK and got not in on_device + [NULL_BLOCK])
    assert len(kv.take_transfers().to_device) == len(hit.tier_hashes)
    assert all(kv.pool.ref_counts[b] == 1 for b in on_device)
    kv.free(second)
    assert kv.pool.num_free_blocks == 39


def test_a_window_lost_in_every_tier_shrinks_the_hit_and_disk_serves_the_rest():
    """A small host tier pushes the prefix on to disk; a sliding block lost everywhere
    cuts the hit to the longest one whose windows are all held, read from disk."""
    disk = DiskTier(200)
    kv = _manager([6, 0], num_blocks=40, host=HostTier(2, disk))
    prompt = list(range(200, 240))
    first = _request("a", prompt)
    _run(kv, first, 40, chunk=8)
    kv.free(first)
    _evict_all(kv, per_step=2)  # each step's two offloads push the host's last two to disk
    request = _request("b", prompt)
    kv._hash_full_blocks(request, 39)
    lost = kv._key(0, request.block_hashes[8])
    kv.host.forget(lost)
    disk.forget(lost)
    hit, tokens = kv.get_computed_blocks(request)
    assert tokens == 32  # a hit of 9 blocks needs sliding block 8 (as on the device)
    assert hit[5 * 2] == NULL_BLOCK and hit[6 * 2] == TIER_BLOCK
    on_disk = [key for key in hit.tier_hashes if key in disk]
    assert len(on_disk) >= len(hit.tier_hashes) - 2
    slots = {key: disk.lookup(key) for key in on_disk}
    assert kv.allocate_slots(request, 8, hit) is not None
    reads = kv.take_transfers().from_disk
    assert {key: slot for slot, _, key in reads} == slots
    kv.free(request)
    assert kv.pool.num_free_blocks == 39


def test_a_failed_step_leaves_no_hit_on_the_blocks_it_was_to_load():
    """The step carrying a hit's loads fails (a disk block that did not verify, say): the
    device blocks it was to fill are no prefix hit for anyone, and the disk keys it read
    are forgotten; the host tier's copies, never the cause, stay."""
    for windows in ([6, 0], [0]):
        disk = DiskTier(200)
        kv = _manager(windows, num_blocks=40, host=HostTier(8, disk))
        prompt = list(range(500, 540))
        first = _request("a", prompt)
        _run(kv, first, 40, chunk=8)
        kv.free(first)
        _evict_all(kv, per_step=2)
        second = _request("b", prompt)
        hit, tokens = kv.get_computed_blocks(second)
        assert tokens == 36 and hit.tier_hashes
        assert kv.allocate_slots(second, 4, hit) is not None
        transfers = kv.take_transfers()
        assert transfers.from_disk and transfers.to_device
        kv.transfers_failed(transfers)
        kv.free(second)
        assert all(key not in disk for _, _, key in transfers.from_disk)
        in_host = [key for key in hit.tier_hashes if kv.host.lookup(key) is not None]
        assert in_host
        # what is left: the host tier's blocks, never the device blocks that were not filled
        third = _request("c", prompt)
        hit, _ = kv.get_computed_blocks(third)
        loaded = {block for _, block in transfers.to_device}
        loaded |= {block for _, block, _ in transfers.from_disk}
        assert not loaded & set(hit)
        kv.take_transfers()


def test_groups_never_share_a_cached_block():
    # two sliding groups hold the same tokens in different blocks: each finds its own
    kv = _manager([6, 6, 0], num_blocks=200)
    first = _request("a", list(range(40)))
    _run(kv, first, 16, chunk=16)
    row = kv.rows["a"]
    cols = kv.block_tables[row, :12].reshape(4, 3)
    request = _request("b", list(range(40)))
    kv._hash_full_blocks(request, 16)
    for i, block_hash in enumerate(request.block_hashes[:4]):
        found = [kv.pool.get_cached_block(kv._key(g, block_hash)) for g in range(3)]
        assert found == cols[i].tolist() and len(set(found)) == 3


def test_request_capacity_counts_the_window():
    kv = _manager([6, 6, 0], num_blocks=31)
    # 30 usable blocks; with a chunk of 8 a sliding group holds at most
    # ceil((6 - 1 + 8) / 4) + 1 = 5 blocks: 30 = n + 2 * 5 -> n = 20 blocks of global
    assert kv.max_request_tokens(chunk=8) == 20 * BS
    assert KVCacheManager(31, BS, 256, 8).max_request_tokens(chunk=8) == 31 * BS


def test_gemma3_270m_holds_over_3x_the_tokens_at_8k():
    """The same KV bytes, Gemma 3 270M's layers (18, window 512, every 6th global), 8,192
    tokens per sequence prefilled in chunks of 2,048 then decoded: sequences held at once
    with every layer keeping every block against sliding layers freeing theirs."""
    windows, bs, context, chunk = gemma3_windows(18, 512), 16, 8192, 2048
    budget = 48 * (context // bs) * 18  # layer-blocks: room for 48 sequences of 8K, all layers

    def sequences_held(enabled: bool) -> int:
        groups = kv_groups(windows, enabled)
        num_blocks = budget // groups.num_slots
        kv = KVCacheManager(num_blocks, bs, context + bs, 256, groups=groups)
        held = 0
        while True:
            request = _request(str(held), [7] * (context - 1))
            request.sampling_params.max_tokens = 2
            try:
                _run(kv, request, context - 1, chunk)
                _run(kv, request, context, 1)  # one decode step: the window moves on
            except AssertionError:
                return held
            held += 1

    full, hybrid = sequences_held(False), sequences_held(True)
    assert full == 48
    assert hybrid >= 3 * full, (full, hybrid)


def test_what_keeps_every_block():
    from ringllm.pipeline.config import EngineConfig
    from ringllm.pipeline.core.kv_groups import engine_kv_groups, hybrid_off_reason

    def reason(**kwargs):
        return hybrid_off_reason(EngineConfig.from_kwargs(model="m", **kwargs))

    assert reason() is None
    assert "disable-hybrid" in reason(disable_hybrid_kv_cache_manager=True)
    assert reason(speculative_config={"method": "ngram", "num_speculative_tokens": 2}) is None
    draft = {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}
    assert "draft model" in reason(speculative_config=draft)
    # the host and disk tiers keep groups (their blocks are one group's, under its key)
    assert reason(swap_space=1, kv_offload_dir="/tmp/x") is None
    config = EngineConfig.from_kwargs(model="m", disable_hybrid_kv_cache_manager=True)
    assert engine_kv_groups(gemma3_windows(12, 8), config).windows == (0,)


def test_trim_frees_every_groups_columns_past_the_kept_blocks():
    """Rejected drafts: the blocks past the kept ones go back in every group."""
    kv = _manager([6, 0], num_blocks=100)
    request = _request("a", list(range(10, 30)))  # 20 tokens
    _run(kv, request, 20, chunk=20)
    row = kv.rows["a"]
    assert kv.num_blocks_of_row[row] == 5 * 2
    # a step of 1 token + 7 drafts: blocks for positions 20..27 (block 6 new)
    assert kv.allocate_slots(request, 8) is not None
    assert kv.num_blocks_of_row[row] == 7 * 2
    free_before_trim = kv.pool.num_free_blocks
    kv.trim(request, 6)  # every draft rejected: 21 tokens computed, 6 blocks kept
    assert kv.num_blocks_of_row[row] == 6 * 2
    assert kv.pool.num_free_blocks == free_before_trim + 2
    kv.free(request)
    assert kv.pool.num_free_blocks == 99


def test_admission_counts_a_requests_peak_blocks_over_the_groups():
    """One global and two sliding groups (window 6, chunks of 8): a request holds its
    global blocks and at most 5 per sliding group, so 31 blocks (the null one aside) take
    a request of up to 20 blocks, and refuse one longer, naming the groups."""
    import pytest

    from ringllm.pipeline.config import CacheConfig, SchedulerConfig
    from ringllm.pipeline.core.scheduler import Scheduler

    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8),
        CacheConfig(block_size=BS),
        256,
        31,
        kv_groups=kv_groups([6, 6, 0]),
    )
    assert scheduler.max_request_tokens == 20 * BS

    def request(rid, prompt_len):
        params = SamplingParams(max_tokens=40)
        return Request(rid, [5] * prompt_len, params, (), max_tokens=40)

    scheduler.add_request(request("fits", 41))  # its last token never enters: 80 tokens
    with pytest.raises(ValueError, match=r"holds 80 tokens of one request: 31 blocks .* groups"):
        scheduler.add_request(request("long", 42))
