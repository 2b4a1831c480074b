"""`ringllm serve` with a KV cache forced small and swap preemption: through the official
`openai` client the greedy completions equal the offline engine's (no preemption), and
/metrics counts the swaps and the host tier's use under ringllm: names."""

from __future__ import annotations

import openai
import pytest

from ringllm.pipeline import SamplingParams
from tests.server.conftest import ENGINE_KWARGS, ServerProcess, _flags, launched

PROMPTS = [f"Count from {i} to a hundred, one number a line: {i}," for i in range(6)]


@pytest.fixture(scope="module")
def small_cache_server(server_model, tmp_path_factory):
    engine = dict(ENGINE_KWARGS, num_gpu_blocks_override=40, block_size=8, max_num_seqs=6)
    args = [
        str(server_model), "--port", "0", "--engine-process", "--preemption-mode", "swap",
        "--swap-space", "0.05", *_flags(engine),
    ]  # fmt: skip
    with launched(args, tmp_path_factory.mktemp("tiers")) as (proc, url, log_path):
        yield ServerProcess(url, proc.pid, server_model, log_path, api_key="")


def test_swap_preemption_through_the_server(small_cache_server, offline_llm):
    client = openai.OpenAI(base_url=small_cache_server.v1, api_key="unused")
    model = client.models.list().data[0].id
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].text for o in offline_llm.generate(PROMPTS, params, use_tqdm=False)]
    got = client.completions.create(
        model=model, prompt=PROMPTS, max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    metrics = small_cache_server.metrics()
    assert metrics["ringllm:num_swaps_total"] > 0
    assert metrics["ringllm:swapped_out_blocks_total"] == metrics["ringllm:swapped_in_blocks_total"]
    assert metrics["ringllm:num_requests_swapped"] == 0
    assert metrics["ringllm:kv_tier_blocks"] > 0  # the host tier's size
