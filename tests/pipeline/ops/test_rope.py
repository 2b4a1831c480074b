"""The rotary tables (ops/rope.py): written as positions come, equal to a table made whole."""

from __future__ import annotations

import pytest
import torch

from ringllm.pipeline import LLM, SamplingParams
from ringllm.pipeline.ops.rope import RotaryTable, cos_sin_cache

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "head_dim, positions, theta, scaling, rotary_dim",
    [
        (64, 10_000, 10_000.0, None, None),
        (256, 32_768, 1e6, None, None),  # Gemma 3's global table
        (96, 5_000, 10_000.0, None, 64),  # Phi-3's partial rotary
        (128, 9_000, 500_000.0, LLAMA3, None),
    ],
)
def test_a_table_written_in_steps_is_the_table_made_whole(
    head_dim, positions, theta, scaling, rotary_dim
):
    whole = cos_sin_cache(head_dim, positions, theta, scaling, rotary_dim)
    table = RotaryTable(head_dim, positions, theta, scaling, rotary_dim, rows=100)
    assert table.rows == 100
    table.cover(50)  # already written
    assert table.rows == 100
    table.cover(101)  # at least doubles
    assert table.rows == 200
    table.cover(4_097)
    assert table.rows == 4_097
    table.cover(positions + 10)  # never past the table
    assert table.rows == positions
    assert torch.equal(table.table, whole)
    with pytest.raises(ValueError, match="must be even"):
        RotaryTable(head_dim, positions, theta, scaling, rotary_dim=3)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_a_context_past_the_first_rows_gives_the_same_tokens(model_factory, monkeypatch, name):
    """A model whose tables start with 8 rows, prompted and decoding past them (the table
    grows within a step, on the fused decode path and the layer path alike), samples the
    same greedy tokens and logprobs as one whose tables are written whole at load."""
    folder = str(model_factory(name))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompt = {"prompt_token_ids": list(range(40, 70))}

    def run() -> tuple[list[int], list[float], list[int]]:
        llm = LLM(folder, num_gpu_blocks_override=64, max_model_len=128)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        model = llm.llm_engine.engine_core.executor.runner.model
        rows = [t.rows for t in model._rotary_tables]
        logprobs = [lp[tok].logprob for tok, lp in zip(out.token_ids, out.logprobs, strict=True)]
        llm.shutdown()
        return list(out.token_ids), logprobs, rows

    whole_tokens, whole_logprobs, whole_rows = run()
    assert whole_rows and all(rows == 128 for rows in whole_rows)  # 4,096 asked, 128 held
    monkeypatch.setattr(RotaryTable, "FIRST_ROWS", 8)
    tokens, logprobs, rows = run()
    assert all(30 + 24 - 1 <= r < 128 for r in rows), rows  # grown, not written whole
    assert tokens == whole_tokens
    assert logprobs == whole_logprobs
