"""The newer architectures through the whole engine (scheduler, paged cache, prefix cache,
preemption), float32, transformers as the oracle: Gemma 3 (sliding layers of 16 keys, the
prompts well past them), Phi-3 (fused tensors, LongRoPE), Qwen3-MoE and Mixtral (experts)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringllm.pipeline import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) for i in range(8)]


def _prompts(count: int, seed: int, length: int, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


@pytest.mark.parametrize("name", ["gemma3", "phi3", "qwen3_moe", "mixtral"])
def test_prefix_cache_and_preemption_keep_transformers_tokens(model_factory, name):
    path = model_factory(name)
    prefix = _prompts(1, seed=1, length=48)[0]
    shared = [prefix + [7, 8, 9], prefix + [10, 11]]
    others = _prompts(6, seed=2, length=40)
    roomy = LLM(path, dtype="float32", num_gpu_blocks_override=256)
    first, second = (roomy.generate([p], GREEDY, use_tqdm=False)[0] for p in shared)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 48
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(shared, (first, second), strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist(), name
    # 8 requests of 51-64 tokens in 12 blocks of 16: they preempt each other. Gemma 3's
    # blocks are one layer's (6 groups: kv_groups.py): 36 blocks, the null block one of them
    blocks = 36 if name == "gemma3" else 12
    tight = LLM(path, dtype="float32", num_gpu_blocks_override=blocks, enable_prefix_caching=False)
    prompts = shared + others
    for params in (GREEDY, SEEDED):
        want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
        assert got == want, name
    scheduler = tight.llm_engine.engine_core.scheduler
    assert scheduler.num_preemptions > 0
    assert scheduler.kv.pool.num_free_blocks == (35 if name == "gemma3" else 12)
