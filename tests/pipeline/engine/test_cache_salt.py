"""`cache_salt` offline (vLLM's prompt-dict field), in the device cache and the host tier.

A device cache that holds about two prompts pushes the others' prefix blocks into the host
tier; they come back only to a request with the same salt, since the tiers key blocks by
the same salted hashes.
"""

from __future__ import annotations

import numpy as np
import pytest

from ringllm.pipeline.frontend.llm import LLM
from ringllm.pipeline.sampling_params import SamplingParams

BASE = dict(dtype="float32", block_size=8, max_num_batched_tokens=64)
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(model_factory):
    return str(model_factory())


def cached_tokens(llm: LLM, prompts, salt=None) -> list[int]:
    salted = {} if salt is None else {"cache_salt": salt}
    results = llm.generate(
        [{"prompt_token_ids": p, **salted} for p in prompts], PARAMS, use_tqdm=False
    )
    return [r.num_cached_tokens for r in results]


def test_salted_prefixes_are_shared_only_under_the_same_salt(model):
    prompt = np.arange(100, 140).tolist()  # five blocks of 8
    with LLM(model, **BASE) as llm:
        assert cached_tokens(llm, [prompt], "a") == [0]
        assert cached_tokens(llm, [prompt], "b") == [0]
        assert cached_tokens(llm, [prompt], "a") == [32]
        assert cached_tokens(llm, [prompt]) == [0]
        assert cached_tokens(llm, [prompt]) == [32]
        with pytest.raises(ValueError, match="cache_salt: must be a non-empty string"):
            cached_tokens(llm, [prompt], "")
        with pytest.raises(ValueError, match="cache_salt: must be a non-empty string"):
            cached_tokens(llm, [prompt], 3)


def test_the_host_tier_keeps_salted_blocks_apart(model):
    rng = np.random.default_rng(30)
    prompts = [rng.integers(3, 400, 37).tolist() for _ in range(6)]  # four full blocks each
    with LLM(model, **BASE, num_gpu_blocks_override=14, max_num_seqs=1) as llm:
        for p in prompts:  # one at a time: the early ones' blocks go to the host tier
            assert cached_tokens(llm, [p], "a") == [0]
        assert llm.llm_engine.engine_core.scheduler.kv.host is not None  # a host tier
        assert [cached_tokens(llm, [p], "b")[0] for p in prompts] == [0] * 6
        again = [cached_tokens(llm, [p], "a")[0] for p in prompts]
    assert all(n >= 24 for n in again[:2])  # found in host memory, under the same salt
