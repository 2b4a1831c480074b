"""Shared fixtures: tiny random-weight models of each architecture, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringllm.tools.make_model import ModelShape, make_model

# Each variant exercises a different loader / model path.
MODEL_VARIANTS = {
    "llama": ModelShape(arch="llama", rope_scaling="llama3", tie_word_embeddings=True),
    "mistral": ModelShape(arch="mistral", num_kv_heads=4, num_shards=3),
    "qwen2": ModelShape(arch="qwen2", config_style="new", num_kv_heads=1),
    "qwen3": ModelShape(arch="qwen3", head_dim=32, rope_scaling="linear", config_style="new"),
}


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def make(name: str = "llama", **overrides) -> Path:
        key = (name, tuple(sorted(overrides.items())))
        if key not in made:
            shape = ModelShape(**{**MODEL_VARIANTS[name].__dict__, **overrides})
            made[key] = make_model(tmp_path_factory.mktemp(f"model_{name}"), shape)
        return made[key]

    return make
