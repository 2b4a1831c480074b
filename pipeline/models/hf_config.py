"""Reads a Hugging Face `config.json` into `ArchConfig`, the shape facts a model needs.

Both spellings of the config are accepted: the older top-level `rope_theta` /
`rope_scaling` / `torch_dtype` and the newer `rope_parameters` / `dtype`. Anything the
engine cannot honour (an unknown rope type, a missing size) is a `ValueError` that names
the field and the file, at load time rather than as wrong numbers later.

A vision-language config (LLaVA: `text_config` and `vision_config` nested in it) gives its
language model's fields, with that model type's transformers defaults for the ones it
leaves out; the whole file is kept in `ArchConfig.multimodal_config` for the model class
to read its own fields from.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringllm.pipeline.config import SUPPORTED_ROPE_TYPES

# a checkpoint's dtypes by name; `ArchConfig.dtype` is the torch dtype of its name
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str):
    """The torch dtype of a DTYPE_NAMES name. NOTE: torch is imported here, not at the top:
    reading a config (`ringllm serve`'s front end checks its models) needs no torch."""
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype_name: str  # one of DTYPE_NAMES
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # config.json whole, for a model with a vision tower (its `text_config` filled the
    # fields above); None for a text-only model
    multimodal_config: dict[str, Any] | None = None
    # the (text) config's fields as read, for a model class's own (Gemma 3's layer types,
    # rotary bases, scales); not compared or hashed
    raw_config: dict[str, Any] | None = dataclasses.field(default=None, compare=False)

    @property
    def dtype(self):
        """The checkpoint's torch dtype."""
        return torch_dtype(self.dtype_name)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path.name} is missing from the model folder {path.parent}"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


# transformers' LlamaConfig defaults for the fields a LLaVA `text_config` may leave out
# (llava-1.5-7b's spells out only its vocab, context length, eps and dtype)
TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def check_tensor_parallel_split(arch: ArchConfig, tp_size: int) -> None:
    """ValueError unless `tp_size` ranks can split the model: each takes whole attention
    heads, whole KV heads and an equal share of the MLP (checked by the ranks, and before
    any starts by `executor/launch.py: check_model`)."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(arch, name)
        if value % tp_size:
            raise ValueError(
                f"tensor_parallel_size: {tp_size} ranks do not divide the model's {name} ({value})"
            )


def load_arch_config(folder: Path) -> ArchConfig:
    path = folder / "config.json"
    raw = read_json(path)
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError(f"{path}: field 'architectures' is missing or empty")
    multimodal, where = None, ""
    if "text_config" in raw or "vision_config" in raw:
        multimodal, raw, where = raw, text_config_of(raw, path), "text_config."

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ValueError(f"{path}: field {where + key!r} is missing")
        return raw[key]

    num_heads = int(need("num_attention_heads"))
    hidden_size = int(need("hidden_size"))
    rope_theta, rope_scaling = _rope(raw, path)
    return ArchConfig(
        architecture=archs[0],
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=int(need("num_hidden_layers")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        qk_norm=False,
        sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
        dtype_name=_dtype_name(raw, path),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_ids(raw.get("eos_token_id")),
        multimodal_config=multimodal,
        raw_config=raw,
    )


def text_config_of(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """A vision-language config's language model fields, as a text model's config.json
    would have them: `text_config` over its model type's defaults, the top-level dtype
    and tied head (transformers ties the head when either level says so)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{path}: field 'text_config' (the language model's config) is missing")
    merged = {**TEXT_CONFIG_DEFAULTS.get(text.get("model_type", "llama"), {}), **text}
    top_dtype = raw.get("dtype") or raw.get("torch_dtype")
    if top_dtype:
        merged["dtype"] = top_dtype
    merged["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings")) or bool(
        merged.get("tie_word_embeddings")
    )
    return merged


def _rope(raw: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):
        # per layer type (transformers 5's Gemma 3): the global layers' here, the model
        # class reads the others'
        params = params["full_attention"]
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"{path}: rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        if rope_type == "default":
            scaling = None
        elif rope_type == "longrope":
            # its context lengths live at the config's top level in Phi-3's spelling
            original = scaling.get("original_max_position_embeddings")
            original = original or raw.get("original_max_position_embeddings")
            if original is None:
                raise ValueError(f"{path}: longrope needs original_max_position_embeddings")
            scaling = {
                **scaling,
                "original_max_position_embeddings": int(original),
                "max_position_embeddings": int(raw.get("max_position_embeddings", original)),
            }
    return float(theta), scaling


def _dtype_name(raw: dict[str, Any], path: Path) -> str:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in DTYPE_NAMES:
        raise ValueError(
            f"{path}: dtype {name!r} is not supported (supported: {sorted(DTYPE_NAMES)})"
        )
    return name


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
