"""--data-parallel-size N: N engine core processes behind one front end."""

from __future__ import annotations

import os

import pytest

from ringllm.ipc.shm import list_segments
from ringllm.pipeline import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_two_engine_cores_share_the_load_and_agree(model_factory):
    path = model_factory("llama")
    args = dict(model=str(path), dtype="float32", num_gpu_blocks_override=128)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(12)]
    reference = LLM(**args).generate(prompts, PARAMS, use_tqdm=False)
    before = set(list_segments())  # other processes' segments may come and go meanwhile
    with LLM(multiprocess=True, data_parallel_size=2, **args) as llm:
        client = llm.llm_engine.core_client
        assert len(client.clients) == 2
        engine_pids = [c.engine_pid for c in client.clients]
        got = llm.generate(prompts, PARAMS, use_tqdm=False)
        assert min(client.num_routed) >= 3, f"requests were not spread: {client.num_routed}"
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]
    mine = {n for n in set(list_segments()) - before if n.startswith(f"ringllm_{os.getpid()}_")}
    assert not mine and not any(
        n.startswith(tuple(f"ringllm_{p}_" for p in engine_pids)) for n in list_segments()
    )


def test_data_parallel_needs_processes(model_factory):
    with pytest.raises(ValueError, match="data_parallel_size.*multiprocess=True"):
        LLM(model_factory("llama"), dtype="float32", data_parallel_size=2)
