"""Builds a model from a Hugging Face folder: config, architecture, dtype, weights.

`resolve_model_path(None)` is the demo model (fetched and converted on first use); a
missing folder, an unknown architecture, a context longer than the model allows, or a
bad weight file are errors that name what is wrong.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ringllm.pipeline.config import ModelConfig
from ringllm.pipeline.models.hf_config import TORCH_DTYPES, ArchConfig, load_arch_config
from ringllm.pipeline.models.registry import model_class
from ringllm.pipeline.models.weights import RandomWeights, WeightSource
from ringllm.pipeline.ops import Ops


def resolve_model_path(model: str | None) -> Path:
    if model is None:
        from ringllm.tools.demo_model import demo_model_path

        return demo_model_path()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model folder {path} does not exist (models are loaded from local folders only)"
        )
    return path


def resolve_dtype(requested: str, arch: ArchConfig, device: str) -> torch.dtype:
    """`auto` keeps the checkpoint's dtype, except float16 on CPU, which runs as bfloat16."""
    if requested != "auto":
        return TORCH_DTYPES[requested]
    if arch.dtype == torch.float16 and device == "cpu":
        return torch.bfloat16
    return arch.dtype


def resolve_max_model_len(requested: int | None, arch: ArchConfig) -> int:
    limit = arch.max_position_embeddings
    if arch.sliding_window is not None:
        limit = min(limit, int(arch.sliding_window))
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len: {requested} tokens is more than the model allows ({limit} tokens: "
            f"max_position_embeddings / sliding_window in config.json)"
        )
    return requested


@dataclasses.dataclass
class LoadedModel:
    model: object
    arch: ArchConfig
    path: Path
    dtype: torch.dtype
    max_model_len: int


def load_model(config: ModelConfig, device: str, ops: Ops, comm=None) -> LoadedModel:
    path = resolve_model_path(config.model)
    arch = load_arch_config(path)
    cls = model_class(arch.architecture)
    arch = cls.adapt_config(arch)
    dtype = resolve_dtype(config.dtype, arch, device)
    max_model_len = resolve_max_model_len(config.max_model_len, arch)
    source = (
        WeightSource(path) if config.load_format == "auto" else RandomWeights(config.seed, device)
    )
    with torch.inference_mode():
        model = cls(arch, ops, dtype, device, max_positions=max_model_len, comm=comm)
        model.load_weights(source)
    return LoadedModel(model=model, arch=arch, path=path, dtype=dtype, max_model_len=max_model_len)
