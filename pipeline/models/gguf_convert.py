"""GGUF (llama.cpp) -> Hugging Face Llama checkpoint: config and weights.

This module owns the model half of turning a llama-architecture GGUF file into a normal
HF folder: it reads the hyper-parameters from the GGUF metadata into a `config.json`,
dequantizes every tensor, renames it to the HF `LlamaForCausalLM` name, undoes llama.cpp's
Q/K row permutation and writes one bfloat16 `model.safetensors`. The tokenizer half lives
in `gguf_tokenizer.py`.

Invariants:
- Every tensor in the GGUF is either mapped to exactly one HF name or rejected with an
  error naming it: nothing is silently dropped, and every HF tensor the config implies
  must be present with the shape the config implies.
- Weights are dequantized to float32 and rounded once, to bfloat16, at the end.
- `lm_head.weight` is written only when the GGUF has its own `output.weight`; otherwise
  the config says `tie_word_embeddings: true`.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import numpy as np
import torch
from safetensors.torch import save_file

from ringllm.pipeline.models.gguf_config import (  # noqa: F401 (re-exported)
    GGUFFormatError,
    build_hf_config,
    generation_config,
    open_gguf,
    read_field,
)
from ringllm.pipeline.models.gguf_file import GGUFFile
from ringllm.pipeline.models.gguf_weights import GGUFWeightSource


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head, interleaved pairs -> two rotary halves.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3)... while HF rotates (x_i, x_{i+d/2}).
    Its converter therefore reorders each head's output rows from "halves" order
    [r0 .. r_{d/2-1} | r_{d/2} .. r_{d-1}] to "interleaved" order [r0, r_{d/2}, r1, ...].
    Viewing a head's rows as (2, d/2) and reading them as (d/2, 2) is that permutation;
    here we view the interleaved rows as (d/2, 2) and transpose back to (2, d/2).
    """
    num_rows = weight.shape[0]
    if num_rows % (2 * num_heads) != 0:
        raise GGUFFormatError(
            f"projection has {num_rows} rows, not a multiple of 2 * {num_heads} heads"
        )
    half_dim = num_rows // num_heads // 2
    per_head = weight.reshape(num_heads, half_dim, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def convert_weights(
    reader: GGUFFile,
    config: dict,
    on_tensor: Callable[[str], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF, dequantized (and q / k un-permuted: gguf_weights.py), as
    bfloat16 under its HF name. `on_tensor(hf_name)` is called after each (the progress
    display)."""
    source = GGUFWeightSource(pathlib.Path(reader.path), reader=reader)
    weights: dict[str, torch.Tensor] = {}
    for name in source.names():
        weights[name] = source.get(name).to(torch.bfloat16)
        if on_tensor is not None:
            on_tensor(name)
    return weights


def write_hf_model(
    reader: GGUFFile,
    out_dir: pathlib.Path,
    on_tensor: Callable[[str], None] | None = None,
) -> dict:
    """Write `config.json`, `generation_config.json` and `model.safetensors` into `out_dir`.

    Returns the config written.
    """
    config = build_hf_config(reader)
    weights = convert_weights(reader, config, on_tensor)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(reader))
    return config


def _write_json(path: pathlib.Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
