"""The hybrid KV cache through the whole engine: Gemma 3's sliding layers (16 keys) free
their blocks, and the tokens and logprobs are those of the cache that keeps every block,
through prompts chunked across window boundaries and prefix-cache hits; Mistral's window
on every layer against transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringllm.pipeline import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True, logprobs=3)


def _prompts():
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 500, (70,), generator=g).tolist()
    others = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (37, 90, 53)]
    return [shared + [7, 8, 9], shared + [10, 11, 12, 13]] + others


def _assert_same(got, want, cached: bool = True) -> None:
    """Tokens and logprobs (the tiny models repeat tokens: only the logprobs show a wrong
    key read); `cached`: the same prefix-cache hits too."""
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # the second prompt starts from the first one's cached prefix in both
        assert not cached or a.num_cached_tokens == b.num_cached_tokens
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-5)


def _held(llm) -> int:
    pool = llm.llm_engine.engine_core.scheduler.kv.pool
    return int((pool.ref_counts > 0).sum())


def test_gemma3_sliding_layers_free_blocks_and_keep_every_token(model_factory):
    path = model_factory("gemma3")
    # the same bytes: 40 blocks of all 6 layers, or 240 blocks of one layer each
    common = dict(dtype="float32", max_num_batched_tokens=24, max_num_seqs=4)
    off = LLM(path, num_gpu_blocks_override=40, disable_hybrid_kv_cache_manager=True, **common)
    on = LLM(path, num_gpu_blocks_override=240, **common)
    assert off.llm_engine.engine_core.scheduler.kv.num_groups == 1
    kv = on.llm_engine.engine_core.scheduler.kv
    assert kv.groups.windows == (16,) * 5 + (0,)
    prompts = _prompts()
    # 30 blocks: every freed block is soon another's (a block freed too early is
    # overwritten before it is read), and the requests preempt each other
    tight = LLM(path, num_gpu_blocks_override=30, **common)
    for params in (GREEDY, SEEDED):
        want = off.generate(prompts, params, use_tqdm=False)
        got = on.generate(prompts, params, use_tqdm=False)
        _assert_same(got, want)
        _assert_same(tight.generate(prompts, params, use_tqdm=False), want, cached=False)
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert got[1].num_cached_tokens == 64
    # one request of 90 + 24 tokens, stepped: its sliding layers hold their window only
    engine = on.llm_engine
    engine.add_request("long", prompts[3], SamplingParams(max_tokens=24, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, _held(on))
    blocks = -(-(90 + 24) // 16)
    # the global group keeps every block; each sliding one at most its window of 16 keys
    # and a chunk of 24 (ceil(39 / 16) + 1 blocks), against 6 x 8 without groups
    assert blocks + 1 <= peak <= 1 + blocks + 5 * 4, peak
    assert peak < 1 + 6 * blocks
    assert _held(on) == 1  # the null block alone


def test_ngram_drafts_trim_every_group(model_factory):
    """n-gram drafts on prompts that repeat themselves, sampled (seeded): drafts are
    rejected and their blocks trimmed in every group (the core's columns and the worker's
    rows); the same tokens as the same drafts without groups (the same logits, the same
    seeded verification, as long as both hold every request: a preemption would change
    which drafts a step verifies, and with them the seeded draws)."""
    path = model_factory("gemma3")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    common = dict(
        dtype="float32", max_num_batched_tokens=24, max_num_seqs=4, speculative_config=spec
    )
    off = LLM(path, num_gpu_blocks_override=40, disable_hybrid_kv_cache_manager=True, **common)
    on = LLM(path, num_gpu_blocks_override=240, **common)
    assert on.llm_engine.engine_core.scheduler.kv.num_groups == 6
    g = torch.Generator().manual_seed(9)
    prompts = [(torch.randint(3, 500, (n,), generator=g).tolist() * 4)[:70] for n in (5, 9, 13)]
    params = [
        SamplingParams(temperature=1.5, seed=i, max_tokens=40, ignore_eos=True, logprobs=3)
        for i in range(3)
    ]
    want = off.generate(prompts, params, use_tqdm=False)
    _assert_same(on.generate(prompts, params, use_tqdm=False), want)
    stats = on.llm_engine.front_end.spec_decoding  # the counts the reports summed
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_gemma3_groups_in_the_fused_decode_loop(model_factory, monkeypatch, kv):
    """int8 matrices: decode steps run every layer in one C call (models/decode_plan.py),
    each layer with its group's table and slots. An int8 KV cache gives the same bits
    either way: each block holds the same rows, written in the same order, so the same
    values and scales, whichever block ids the groups hand out."""
    from ringllm.pipeline.models.decode_plan import DecodePlan

    fused = []
    run = DecodePlan.run
    monkeypatch.setattr(DecodePlan, "run", lambda self, *a: fused.append(1) or run(self, *a))
    path = model_factory("gemma3")
    common = dict(
        dtype="float32", quantization="int8", max_num_batched_tokens=24, kv_cache_dtype=kv
    )
    off = LLM(path, num_gpu_blocks_override=40, disable_hybrid_kv_cache_manager=True, **common)
    on = LLM(path, num_gpu_blocks_override=240, **common)
    prompts = _prompts()[2:]
    want = off.generate(prompts, GREEDY, use_tqdm=False)
    fused.clear()
    got = on.generate(prompts, GREEDY, use_tqdm=False)
    assert fused, "the decode steps should have run fused"
    _assert_same(got, want)


def test_mistral_window_on_every_layer_matches_transformers(model_factory, tmp_path):
    path = tmp_path / "mistral"
    shutil.copytree(model_factory("mistral"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(sliding_window=8, use_sliding_window=True)
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(path, dtype="float32", max_num_batched_tokens=20, num_gpu_blocks_override=64)
    kv = llm.llm_engine.engine_core.scheduler.kv
    assert (kv.num_groups, kv.groups.windows) == (1, (8,))
    prompts = _prompts()[2:]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_gemma3_groups_under_tensor_parallel(model_factory):
    """Two ranks, each with its half of the heads in the same groups and block tables."""
    path = model_factory("gemma3", num_kv_heads=2)
    args = dict(model=str(path), dtype="float32", max_num_batched_tokens=24)
    prompts = _prompts()[2:]
    want = LLM(num_gpu_blocks_override=30, **args).generate(prompts, GREEDY, use_tqdm=False)
    with LLM(tensor_parallel_size=2, num_gpu_blocks_override=30, **args) as llm:
        assert llm.llm_engine.engine_core.scheduler.kv.num_groups == 6
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert {t: p.logprob for t, p in la.items()} == pytest.approx(
                {t: p.logprob for t, p in lb.items()}, abs=1e-4
            )


def test_gemma3_groups_across_pipeline_stages(model_factory):
    """Two stages, each holding its layers' KV tensors (6 groups of one layer: stage 0
    the sliding layers 0-2, stage 1 layers 3-5, the global one among them) over the one
    table the core keeps; a small cache, so freed blocks are reused."""
    path = model_factory("gemma3")
    common = dict(dtype="float32", max_num_batched_tokens=24, max_num_seqs=4)
    want = LLM(path, num_gpu_blocks_override=240, **common).generate(
        _prompts(), GREEDY, use_tqdm=False
    )
    with LLM(path, pipeline_parallel_size=2, num_gpu_blocks_override=60, **common) as llm:
        assert llm.llm_engine.engine_core.scheduler.kv.num_groups == 6
        got = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    _assert_same(got, want, cached=False)


def test_gemma3_groups_swap_to_the_host_tier(model_factory):
    """Swap preemption with groups: requests decoding 100 tokens past their windows are
    swapped with freed (null) columns, which their host blocks keep; back, every group's
    window is where it was."""
    path = model_factory("gemma3")
    common = dict(dtype="float32", max_num_batched_tokens=24, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, logprobs=3)
    want = LLM(path, num_gpu_blocks_override=400, **common).generate(
        _prompts(), params, use_tqdm=False
    )
    tight = LLM(path, num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.01, **common)
    kv = tight.llm_engine.engine_core.scheduler.kv
    swapped_at = []
    swap_out = kv.swap_out
    kv.swap_out = lambda r: swapped_at.append(r.num_computed_tokens) or swap_out(r)
    got = tight.generate(_prompts(), params, use_tqdm=False)
    _assert_same(got, want, cached=False)
    scheduler = tight.llm_engine.engine_core.scheduler
    assert scheduler.num_swaps > 0 and scheduler.num_blocks_swapped_in > 0
    assert max(swapped_at) > 2 * 16  # swapped once blocks had left a window
    assert scheduler.kv.pool.num_free_blocks == 39
    assert scheduler.kv.host.num_swapped_blocks == 0


def _summed_tier_stats(scheduler):
    """Sums the host and disk tiers' counts make_stats reports from now on."""
    from types import SimpleNamespace

    from ringllm.pipeline.stats import TierStats

    total = SimpleNamespace(host=TierStats(), disk=TierStats())
    make = scheduler.make_stats

    def counting():
        stats = make()
        if stats.kv_tiers is not None:
            total.host.add(stats.kv_tiers.host)
            if stats.kv_tiers.disk is not None:
                total.disk.add(stats.kv_tiers.disk)
        return stats

    scheduler.make_stats = counting
    return total


TIERS = dict(dtype="float32", max_num_batched_tokens=24, max_num_seqs=1)


def _tier_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts of 53 tokens: 48 (three windows of 16) a prefix hit can hold."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (53,), generator=g).tolist() for _ in range(count)]


def _one_by_one(batch, params):
    """Runs `batch` through an LLM a prompt at a time (each finds the others' blocks)."""
    return lambda llm: [llm.generate([p], params, use_tqdm=False)[0] for p in batch]


def _uncut(path, each):
    """`each`'s outputs from a cache that never evicts, and the bytes of one KV block in
    GiB (the tiers' sizes are counted in them)."""
    with LLM(path, num_gpu_blocks_override=400, **TIERS) as llm:
        block = llm.llm_engine.engine_core.executor.runner.kv_bytes_per_block
        return each(llm), block / 2**30


def _small_host_and_disk(tmp_path, block_gib: float) -> dict:
    return dict(
        swap_space=6 * block_gib,
        kv_offload_dir=str(tmp_path / "kv"),
        kv_offload_max_gib=256 * block_gib,
    )


def test_gemma3_prefixes_come_back_from_the_host_and_disk_tiers(model_factory, tmp_path):
    """Groups with the tiers behind: six prompts' 48-token prefixes (three windows) through
    a device cache that holds about one request. Evicted, each group's blocks go to host
    memory, and the second pass loads them into every group's columns; past a small host
    tier they go on to disk, where an engine restarted on the same folder finds them.
    Tokens and logprobs are those of a cache that never evicts."""
    path = model_factory("gemma3")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    each = _one_by_one(_tier_prompts(6, seed=11), params)
    want, block_gib = _uncut(path, each)
    with LLM(path, num_gpu_blocks_override=30, swap_space=256 * block_gib, **TIERS) as llm:
        scheduler = llm.llm_engine.engine_core.scheduler
        assert scheduler.kv.num_groups == 6 and scheduler.kv.host is not None
        first = each(llm)
        counted = _summed_tier_stats(scheduler)
        second = each(llm)
    _assert_same(first, want, cached=False)
    _assert_same(second, want, cached=False)
    assert [out.num_cached_tokens for out in second] == [48] * 6  # 3 blocks each
    # at least 5 prompts' 3 blocks in the global group and 1 or 2 in each sliding one
    assert counted.host.hits >= 5 * (3 + 5) and counted.host.blocks_out == counted.host.hits

    disk = _small_host_and_disk(tmp_path, block_gib)  # the host: fewer than a step evicts
    with LLM(path, num_gpu_blocks_override=30, **TIERS, **disk) as llm:
        _assert_same(each(llm), want, cached=False)
        assert llm.llm_engine.engine_core.scheduler.kv.host.disk.num_used > 0
    with LLM(path, num_gpu_blocks_override=30, **TIERS, **disk) as llm:
        scheduler = llm.llm_engine.engine_core.scheduler
        assert scheduler.kv.host.disk.num_used > 0  # what the files hold, verified
        counted = _summed_tier_stats(scheduler)
        again = each(llm)
    _assert_same(again, want, cached=False)
    assert counted.disk.hits > 0 and counted.disk.blocks_out == counted.disk.hits
    assert sum(out.num_cached_tokens == 48 for out in again) >= 3


def test_gemma3_tier_hits_under_tensor_parallel(model_factory, tmp_path):
    """Two ranks, each with its shard of every group's blocks in its own host tier and disk
    file: the same prefix hits, loaded on both ranks, give the single rank's tokens."""
    path = model_factory("gemma3", num_kv_heads=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    each = _one_by_one(_tier_prompts(4, seed=12), params)
    want, block_gib = _uncut(path, each)
    tiers = _small_host_and_disk(tmp_path, block_gib)  # a rank's host: 12 blocks of its half
    with LLM(path, tensor_parallel_size=2, num_gpu_blocks_override=30, **TIERS, **tiers) as llm:
        scheduler = llm.llm_engine.engine_core.scheduler
        each(llm)
        counted = _summed_tier_stats(scheduler)
        got = each(llm)
    assert counted.host.hits > 0 and counted.disk.hits > 0
    assert [out.num_cached_tokens for out in got] == [48] * 4
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert {t: p.logprob for t, p in la.items()} == pytest.approx(
                {t: p.logprob for t, p in lb.items()}, abs=1e-4
            )
