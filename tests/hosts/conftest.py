"""What the several-hosts tests share: the model, its offline outputs (the oracle), the
engine flags and prompts."""

from __future__ import annotations

import re

import pytest

from ringllm.pipeline import LLM, SamplingParams

ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--swap-space", "0"]
PROMPTS = [f"Number {i} is followed by" for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
URL_LINE = re.compile(r"listening on (http://\S+)")


@pytest.fixture(scope="session")
def model(model_factory):
    return str(model_factory("llama", num_layers=4))


@pytest.fixture(scope="session")
def offline_outputs(model):
    """The single-process engine's greedy completions of PROMPTS."""
    with LLM(model, dtype="float32", max_model_len=512) as llm:
        return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
