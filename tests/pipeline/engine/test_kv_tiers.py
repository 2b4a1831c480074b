"""KV tiers through the engine: swap preemption and the host tier's prefix cache.

A KV cache forced small (num_gpu_blocks_override) makes long requests preempt each other;
with swap preemption their KV goes to the host tier and comes back, and every output
(greedy tokens, seeded samples, prompt logprobs, n > 1 children) must equal an unpreempted
run's. Prefix blocks evicted from the small device cache are kept in the host tier and
loaded back on a later hit.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.engine_core import EngineCore
from ringllm.pipeline.frontend.llm import LLM
from ringllm.pipeline.sampling_params import SamplingParams

BASE = dict(dtype="float32", block_size=8, max_num_batched_tokens=64)


def prompts(count: int, seed: int, low: int = 30, high: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 400, int(rng.integers(low, high))).tolist() for _ in range(count)]


def outputs_of(llm: LLM, batch, params) -> list:
    results = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [
        (
            [c.token_ids for c in r.outputs],
            [[(t, round(lp.logprob, 4)) for row in r.prompt_logprobs[1:] for t, lp in row.items()]]
            if r.prompt_logprobs
            else None,
        )
        for r in results
    ]


def scheduler_of(llm: LLM):
    return llm.llm_engine.engine_core.scheduler


@pytest.fixture(scope="module")
def model(model_factory):
    return str(model_factory())


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=11, max_tokens=48, ignore_eos=True, n=2),
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=1),
    SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=48, ignore_eos=True),
]


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_preemption_keeps_every_output(model, mode):
    batch = prompts(4, seed=1)
    with LLM(model, **BASE, num_gpu_blocks_override=400) as llm:
        expected = outputs_of(llm, batch, PARAMS)
        assert scheduler_of(llm).num_preemptions == 0
    with LLM(model, **BASE, num_gpu_blocks_override=24, preemption_mode=mode) as llm:
        got = outputs_of(llm, batch, PARAMS)
        s = scheduler_of(llm)
        assert s.num_swaps > 0
        assert s.num_blocks_swapped_in == s.num_blocks_swapped_out
        stats = s.make_stats().kv_tiers
        assert stats.num_swapped == 0 and stats.num_swaps_total == s.num_swaps
    assert got == expected


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_an_8_bit_cache_swaps_out_and_back_bit_for_bit(model, kv):
    """--kv-cache-dtype fp8 / int8: the host tier holds the same one-byte blocks (int8: and
    their scales), so a swapped request answers as an unpreempted run over the same cache."""
    batch = prompts(4, seed=6)
    params = PARAMS
    with LLM(model, **BASE, num_gpu_blocks_override=400, kv_cache_dtype=kv) as llm:
        expected = outputs_of(llm, batch, params)
    with LLM(
        model, **BASE, num_gpu_blocks_override=24, preemption_mode="swap", kv_cache_dtype=kv
    ) as llm:
        got = outputs_of(llm, batch, params)
        assert scheduler_of(llm).num_swaps > 0
    assert got == expected


def test_recompute_mode_never_swaps(model):
    batch = prompts(4, seed=2)
    with LLM(model, **BASE, num_gpu_blocks_override=24, preemption_mode="recompute") as llm:
        outputs_of(llm, batch, PARAMS)
        s = scheduler_of(llm)
        assert s.num_preemptions > 0 and s.num_swaps == 0


def test_a_full_host_tier_falls_back_to_recompute(model):
    """A host tier of a few blocks: some preemptions swap, the rest recompute; outputs
    unchanged."""
    batch = prompts(4, seed=3)
    with LLM(model, **BASE, num_gpu_blocks_override=400) as llm:
        expected = outputs_of(llm, batch, PARAMS)
    config = EngineConfig.from_kwargs(model=model, **BASE)
    one_block = _kv_bytes_per_block(config)
    swap_gib = 6 * one_block / 2**30
    with LLM(
        model, **BASE, num_gpu_blocks_override=24, preemption_mode="swap", swap_space=swap_gib
    ) as llm:
        got = outputs_of(llm, batch, PARAMS)
        s = scheduler_of(llm)
        assert s.kv.host.num_blocks == 6
        assert 0 < s.num_swaps < s.num_preemptions
    assert got == expected


def _kv_bytes_per_block(config) -> int:
    from ringllm.pipeline.worker.worker import Worker

    worker = Worker(config)
    return worker.runner.kv_bytes_per_block


def _disk_tiers(config, tmp_path) -> dict:
    """A host tier of 4 blocks in front of a disk tier of 64 under tmp_path / "kv"."""
    one_block = _kv_bytes_per_block(config)
    return dict(
        swap_space=4 * one_block / 2**30,
        kv_offload_dir=str(tmp_path / "kv"),
        kv_offload_max_gib=64 * one_block / 2**30,
    )


def _damage_every_page(folder) -> None:
    """One flipped byte in every page of the disk tier's file past its header's."""
    (path,) = folder.glob("*.bin")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        for at in range(4096 + 100, size, 4096):
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))


def test_prefix_blocks_evicted_from_the_device_come_back_from_the_host_tier(model):
    """Six prompts of distinct 32-token prefixes through a device cache that holds about
    two: the second pass finds the evicted prefixes in host memory (loaded, not
    recomputed), and answers as the first."""
    prefixes = prompts(6, seed=4, low=32, high=33)
    batch = [p + q for p, q in zip(prefixes, prompts(6, seed=5, low=5, high=6), strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model, **BASE, num_gpu_blocks_override=14, max_num_seqs=1) as llm:
        first = [outputs_of(llm, [p], params)[0] for p in batch]
        taken = summed_stats(scheduler_of(llm))  # the engine takes them every step
        second = [outputs_of(llm, [p], params)[0] for p in batch]
    assert second == first
    host, prefix_hits = taken.host, taken.prefix_hits
    assert host.hits >= 6 * 3  # every prompt's 4 prefix blocks, less what the device kept
    assert host.blocks_out == host.hits
    assert prefix_hits >= 6 * 24


def summed_stats(scheduler):
    """Sums what make_stats reports from now on (into the returned object)."""
    from types import SimpleNamespace

    from ringllm.pipeline.stats import TierStats

    total = SimpleNamespace(host=TierStats(), prefix_hits=0)
    make = scheduler.make_stats

    def counting():
        stats = make()
        total.host.add(stats.kv_tiers.host)
        total.prefix_hits += stats.prefix_cache.hits
        return stats

    scheduler.make_stats = counting
    return total


def test_no_swap_space_no_tiers(model):
    with LLM(model, **BASE, num_gpu_blocks_override=24, swap_space=0) as llm:
        outputs_of(llm, prompts(4, seed=6), PARAMS)
        s = scheduler_of(llm)
        assert s.kv.host is None and s.num_swaps == 0 and s.num_preemptions > 0
        assert s.make_stats().kv_tiers is None


def test_swap_space_past_host_memory_is_refused(model):
    from ringllm.pipeline.executor.host_memory import host_memory_bytes

    total, _ = host_memory_bytes()
    with pytest.raises(ValueError, match=r"swap_space: .* GiB of host memory, but this machine"):
        EngineCore(EngineConfig.from_kwargs(model=model, **BASE, swap_space=2 * total / 2**30))


def test_tensor_parallel_ranks_swap_their_shards(model_factory):
    """TP=2: the transfers ride in the STEP record; every rank copies its own shard."""
    model = str(model_factory())
    batch = prompts(4, seed=7)
    params = PARAMS[0]
    with LLM(model, **BASE, num_gpu_blocks_override=400) as llm:
        expected = outputs_of(llm, batch, params)
    with LLM(
        model, **BASE, num_gpu_blocks_override=24, preemption_mode="swap", tensor_parallel_size=2
    ) as llm:
        got = outputs_of(llm, batch, params)
        assert scheduler_of(llm).num_swaps > 0
    assert got == expected


def test_the_disk_tier_serves_prefixes_after_a_restart(model, tmp_path):
    """Prefix blocks pushed past a small host tier land on disk; a new engine on the same
    folder (same model, dtype, block size) finds them there; another block size does not
    trust them, and a file corrupted between runs is ignored, never loaded."""
    config = EngineConfig.from_kwargs(model=model, **BASE)
    tiers = _disk_tiers(config, tmp_path)  # the disk's 64 blocks allocated up front
    prefixes = prompts(6, seed=8, low=32, high=33)
    batch = [p + q for p, q in zip(prefixes, prompts(6, seed=9, low=5, high=6), strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model, **BASE, num_gpu_blocks_override=14, max_num_seqs=1, **tiers) as llm:
        first = [outputs_of(llm, [p], params)[0] for p in batch]
        disk = scheduler_of(llm).kv.host.disk
        assert disk.num_used >= 12  # what went past the 14 device and 4 host blocks
    with LLM(model, **BASE, num_gpu_blocks_override=14, max_num_seqs=1, **tiers) as llm:
        s = scheduler_of(llm)
        kept = s.kv.host.disk.num_used
        assert kept >= 12
        counted = summed_disk_stats(s)
        again = [outputs_of(llm, [p], params)[0] for p in batch]
    assert again == first
    # the first prompts' prefixes were pushed all the way to disk (the last ones' were
    # still in device / host memory when the first engine stopped, and are gone)
    assert counted.hits >= 8 and counted.blocks_out == counted.hits
    other = dict(BASE, block_size=16)
    with LLM(model, **other, num_gpu_blocks_override=8, max_num_seqs=1, **tiers) as llm:
        assert scheduler_of(llm).kv.host.disk.num_used == 0  # another layout: not trusted
    # corrupt every slot's data of the block size's file (written again just above)
    with LLM(model, **BASE, num_gpu_blocks_override=14, max_num_seqs=1, **tiers) as llm:
        [outputs_of(llm, [p], params)[0] for p in batch]
    _damage_every_page(tmp_path / "kv")
    with LLM(model, **BASE, num_gpu_blocks_override=14, max_num_seqs=1, **tiers) as llm:
        s = scheduler_of(llm)
        assert s.kv.host.disk.num_used == 0  # every damaged slot was dropped at open
        assert [outputs_of(llm, [p], params)[0] for p in batch] == first


def test_a_disk_block_damaged_while_running_is_recomputed_not_an_error(model, tmp_path, caplog):
    """The disk tier's file is damaged under a running engine (past its checks at start):
    a lone request whose prefix hit reads such a block fails its step (the block does not
    verify), is taken back unblamed, and computes the prefix again; every answer is the
    undamaged one, and no later hit lands on what the failed step did not load."""
    config = EngineConfig.from_kwargs(model=model, **BASE)
    tiers = _disk_tiers(config, tmp_path)
    prefixes = prompts(6, seed=14, low=32, high=33)
    batch = [p + q for p, q in zip(prefixes, prompts(6, seed=15, low=5, high=6), strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model, **BASE, num_gpu_blocks_override=14, max_num_seqs=1, **tiers) as llm:
        first = [outputs_of(llm, [p], params)[0] for p in batch]
        disk = scheduler_of(llm).kv.host.disk
        assert disk.num_used >= 12
        _damage_every_page(tmp_path / "kv")
        with caplog.at_level(logging.ERROR):
            again = [outputs_of(llm, [p], params)[0] for p in batch]
            third = [outputs_of(llm, [p], params)[0] for p in batch]
    assert again == first and third == first  # no error answer, no damaged KV read
    assert "did not verify" in caplog.text


def summed_disk_stats(scheduler):
    from ringllm.pipeline.stats import TierStats

    total = TierStats()
    make = scheduler.make_stats

    def counting():
        stats = make()
        total.add(stats.kv_tiers.disk)
        return stats

    scheduler.make_stats = counting
    return total


def test_an_int8_cache_goes_to_disk_and_back_with_its_scales(model, tmp_path):
    """--kv-cache-dtype int8 with a disk tier: prefix blocks pushed to disk carry their
    scales, so a restarted engine's hits answer as the first engine did (a block read back
    without its scales would read as other values)."""
    config = EngineConfig.from_kwargs(model=model, **BASE, kv_cache_dtype="int8")
    tiers = dict(_disk_tiers(config, tmp_path), kv_cache_dtype="int8")
    prefixes = prompts(6, seed=12, low=32, high=33)
    batch = [p + q for p, q in zip(prefixes, prompts(6, seed=13, low=5, high=6), strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    with LLM(model, **BASE, num_gpu_blocks_override=14, max_num_seqs=1, **tiers) as llm:
        first = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in batch]
        assert scheduler_of(llm).kv.host.disk.num_used >= 12
    with LLM(model, **BASE, num_gpu_blocks_override=14, max_num_seqs=1, **tiers) as llm:
        counted = summed_disk_stats(scheduler_of(llm))
        again = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in batch]
    assert counted.hits >= 8
    for a, b in zip(again, first, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # a hit computes the suffix alone: its products run in other shapes (1e-5 apart)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-3)


def test_an_offload_dir_that_cannot_be_used_is_a_clear_error(model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="file"):
        EngineCore(
            EngineConfig.from_kwargs(
                model=model, **BASE, swap_space=0.01, kv_offload_dir=str(blocker)
            )
        )
    with pytest.raises(ValueError, match="kv_offload_dir: the disk tier sits behind the host tier"):
        EngineConfig.from_kwargs(model=model, swap_space=0, kv_offload_dir=str(tmp_path))


def test_a_restarted_core_comes_back_with_its_disk_tier_warm(model, tmp_path):
    """LLMEngine(multiprocess=True) restarts a kill -9'd core (issue #16's supervision):
    the new core opens the dead one's disk tier (its lock died with it) and serves the
    prefixes pushed there as hits, with the same answers."""
    import os
    import signal

    from ringllm.pipeline.frontend.llm_engine import LLMEngine

    config = EngineConfig.from_kwargs(model=model, **BASE)
    config = EngineConfig.from_kwargs(
        model=model,
        **BASE,
        num_gpu_blocks_override=14,
        max_num_seqs=1,
        **_disk_tiers(config, tmp_path),
    )
    prefixes = prompts(6, seed=10, low=32, high=33)
    batch = [p + q for p, q in zip(prefixes, prompts(6, seed=11, low=5, high=6), strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = LLMEngine(config, multiprocess=True)

    def run(rid, prompt):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        done = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done = out
        return done

    try:
        first = [run(f"a{i}", p) for i, p in enumerate(batch)]
        killed = engine.core_client.engine_pid
        os.kill(killed, signal.SIGKILL)
        for _ in range(200):  # the next steps notice it and start a new core
            engine.step()
            if engine.num_restarts:
                break
        again = [run(f"b{i}", p) for i, p in enumerate(batch[:2])]
        assert engine.num_restarts == 1 and engine.core_client.engine_pid != killed
    finally:
        engine.shutdown()
    for old, new in zip(first, again, strict=False):
        assert new.outputs[0].token_ids == old.outputs[0].token_ids
    assert again[0].num_cached_tokens >= 24  # the first prompt's prefix, from disk


def test_tensor_parallel_disk_tiers_agree_after_a_restart(model, tmp_path):
    """TP=2: each rank writes its shard to its own file; a new engine starts from the
    entries both files verified alike, and hits them."""
    config = EngineConfig.from_kwargs(model=model, **BASE)
    one_block = _kv_bytes_per_block(config) // 2  # a rank's shard
    tiers = dict(
        swap_space=4 * one_block / 2**30,
        kv_offload_dir=str(tmp_path / "kv"),
        kv_offload_max_gib=64 * one_block / 2**30,
        tensor_parallel_size=2,
    )
    prefixes = prompts(6, seed=12, low=32, high=33)
    batch = [p + q for p, q in zip(prefixes, prompts(6, seed=13, low=5, high=6), strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model, **BASE, num_gpu_blocks_override=14, max_num_seqs=1, **tiers) as llm:
        first = [outputs_of(llm, [p], params)[0] for p in batch]
        written = scheduler_of(llm).kv.host.disk.num_used
    assert sorted(p.name for p in (tmp_path / "kv").glob("*.bin")) == [
        "ringllm-kv-rank0.bin",
        "ringllm-kv-rank1.bin",
    ]
    with LLM(model, **BASE, num_gpu_blocks_override=14, max_num_seqs=1, **tiers) as llm:
        s = scheduler_of(llm)
        assert s.kv.host.disk.num_used == written > 0
        counted = summed_disk_stats(s)
        again = [outputs_of(llm, [p], params)[0] for p in batch]
    assert again == first and counted.hits > 0
