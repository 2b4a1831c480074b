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
import re
from collections.abc import Callable

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

SUPPORTED_ARCHITECTURE = "llama"

# llama.cpp tensor name (inside block N) -> HF name (inside model.layers.N).
_BLOCK_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAME_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_REQUIRED = object()  # read_field's "no default": a missing field is an error


class GGUFFormatError(ValueError):
    """The file is not a GGUF this converter can turn into an HF Llama checkpoint."""


def open_gguf(gguf_path: pathlib.Path) -> gguf.GGUFReader:
    """Open `gguf_path` for reading, turning any parse failure into one clear error."""
    gguf_path = pathlib.Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    try:
        return gguf.GGUFReader(gguf_path, "r")
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors...
        raise GGUFFormatError(
            f"{gguf_path} ({gguf_path.stat().st_size} bytes) is not a readable GGUF file: "
            f"{type(exc).__name__}: {exc}. The file is truncated or corrupt; delete it and "
            "fetch it again (`ringllm fetch-demo-model --force`)."
        ) from exc


def read_field(reader: gguf.GGUFReader, key: str, default: object = _REQUIRED) -> object:
    """The value of metadata field `key`; `default` if absent, an error if no default."""
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise GGUFFormatError(f"GGUF metadata has no field {key!r}, which the converter needs")
        return default
    return field.contents()


def build_hf_config(reader: gguf.GGUFReader) -> dict:
    """The HF `config.json` contents (LlamaForCausalLM) read from the GGUF metadata."""
    arch = read_field(reader, "general.architecture")
    if arch != SUPPORTED_ARCHITECTURE:
        raise GGUFFormatError(
            f"GGUF architecture is {arch!r}; only {SUPPORTED_ARCHITECTURE!r} is supported"
        )
    if reader.get_field(f"{arch}.rope.scaling.type") is not None:
        raise GGUFFormatError("GGUF uses rope scaling, which this converter does not support")
    hidden_size = int(read_field(reader, f"{arch}.embedding_length"))
    num_heads = int(read_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(read_field(reader, f"{arch}.attention.key_length", hidden_size // num_heads))
    rotary_dim = int(read_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise GGUFFormatError(
            f"GGUF rotary dimension {rotary_dim} differs from head_dim {head_dim}; "
            "partial rotary embeddings are not supported"
        )
    tokens_field = reader.get_field("tokenizer.ggml.tokens")
    num_tokens = len(tokens_field.data) if tokens_field is not None else _REQUIRED
    eos_token_id = int(read_field(reader, "tokenizer.ggml.eos_token_id"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "intermediate_size": int(read_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(read_field(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(
            read_field(reader, f"{arch}.attention.head_count_kv", num_heads)
        ),
        "head_dim": head_dim,
        "rms_norm_eps": float(read_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(read_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(read_field(reader, f"{arch}.context_length")),
        "vocab_size": int(read_field(reader, f"{arch}.vocab_size", num_tokens)),
        "tie_word_embeddings": _find_tensor(reader, "output.weight") is None,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(read_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos_token_id,
        "pad_token_id": int(read_field(reader, "tokenizer.ggml.padding_token_id", eos_token_id)),
        "torch_dtype": "bfloat16",
    }


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


def expected_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the checkpoint of `config` must hold."""
    hidden = config["hidden_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    ffn = config["intermediate_size"]
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    per_layer = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }
    for layer in range(config["num_hidden_layers"]):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{name}"] = shape
    return shapes


def hf_tensor_name(gguf_name: str) -> str:
    """The HF name of llama.cpp tensor `gguf_name`; an error for a tensor we cannot place."""
    if gguf_name in _TOP_TENSOR_NAMES:
        return _TOP_TENSOR_NAMES[gguf_name]
    match = _BLOCK_NAME_RE.match(gguf_name)
    if match and match.group(2) in _BLOCK_TENSOR_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_TENSOR_NAMES[match.group(2)]}"
    raise GGUFFormatError(f"GGUF tensor {gguf_name!r} has no Llama equivalent in this converter")


def dequantize_tensor(tensor: gguf.ReaderTensor, config: dict) -> np.ndarray:
    """One GGUF tensor as float32 in HF orientation (rows = outputs), Q/K un-permuted."""
    try:
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise GGUFFormatError(
            f"GGUF tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, "
            "which the installed gguf package cannot dequantize"
        ) from exc
    # GGUF lists dimensions fastest-first, so numpy's (rows, cols) is the reversed list.
    weight = weight.reshape([int(d) for d in reversed(tensor.shape)])
    if tensor.name.endswith(".attn_q.weight"):
        weight = unpermute_rotary_rows(weight, config["num_attention_heads"])
    elif tensor.name.endswith(".attn_k.weight"):
        weight = unpermute_rotary_rows(weight, config["num_key_value_heads"])
    # A copy: F32 tensors come back as read-only views of the memory-mapped file.
    return np.array(weight, dtype=np.float32)


def convert_weights(
    reader: gguf.GGUFReader,
    config: dict,
    on_tensor: Callable[[str], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF, dequantized, as bfloat16 under its HF name.

    `on_tensor(gguf_name)` is called after each tensor (the progress display).
    """
    expected = expected_tensor_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name not in expected:
            raise GGUFFormatError(
                f"GGUF tensor {tensor.name!r} ({name}) is outside the "
                f"{config['num_hidden_layers']}-layer model its metadata describes"
            )
        weight = dequantize_tensor(tensor, config)
        if tuple(weight.shape) != expected[name]:
            raise GGUFFormatError(
                f"GGUF tensor {tensor.name!r} has shape {tuple(weight.shape)}; "
                f"the metadata implies {expected[name]} for {name}"
            )
        weights[name] = torch.from_numpy(weight).to(torch.bfloat16)
        if on_tensor is not None:
            on_tensor(tensor.name)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise GGUFFormatError(
            f"GGUF lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}"
        )
    return weights


def write_hf_model(
    reader: gguf.GGUFReader,
    out_dir: pathlib.Path,
    on_tensor: Callable[[str], None] | None = None,
) -> dict:
    """Write `config.json`, `generation_config.json` and `model.safetensors` into `out_dir`.

    Returns the config written.
    """
    config = build_hf_config(reader)
    weights = convert_weights(reader, config, on_tensor)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config)
    return config


def _find_tensor(reader: gguf.GGUFReader, name: str) -> gguf.ReaderTensor | None:
    return next((t for t in reader.tensors if t.name == name), None)


def _write_json(path: pathlib.Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
