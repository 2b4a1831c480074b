"""CLIP's vision tower (transformers' CLIPVisionModel): the image encoder of LLaVA.

    pixels [N, C, S, S] -> conv (kernel = stride = patch, no bias) -> [N, P, D], P = (S/patch)^2
      -> [CLS | patches] + position embeddings -> LayerNorm ("pre_layrnorm")  = hidden_states[0]
      -> [ LayerNorm -> MHA (q/k/v/out with biases, no mask) (+ residual)
           LayerNorm -> fc1 -> act -> fc2 (+ residual) ]                       = hidden_states[i]

hidden_states[i] is the output of layer i (1-based), the indexing LLaVA's
`vision_feature_layer` counts in. Only the layers up to the deepest one asked for are
loaded and run; the post-layernorm (of the pooled CLS output) is never read.

The tower is small next to the language model: its matrices stay plain tensors in the
model dtype (F.linear), replicated on every tensor-parallel rank, and the images of a
call run as one batch. Attention has no mask: every patch sees every patch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ringllm.pipeline.models.weights import WeightSource


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# config.json's `hidden_act` / `projector_hidden_act` names, as transformers defines them
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str, field: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"{field}: activation {name!r} is not supported (supported: {sorted(ACTIVATIONS)})"
        )
    return ACTIVATIONS[name]


# transformers' CLIPVisionConfig defaults, for the fields a vision_config leaves out
_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}


@dataclass(frozen=True)
class ClipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int  # pixels per side of the (square) input
    patch_size: int  # pixels per side of a patch
    hidden_act: str
    layer_norm_eps: float

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> ClipVisionConfig:
        """`raw`: a `vision_config`; `where`: the file and field, for errors."""
        model_type = raw.get("model_type", "clip_vision_model")
        if model_type != "clip_vision_model":
            raise ValueError(
                f"{where}.model_type: vision tower {model_type!r} is not supported "
                "(supported: 'clip_vision_model')"
            )
        merged = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
        sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        config = cls(
            **{k: int(merged[k]) for k in (*sizes, "num_channels")},
            image_size=_square(merged["image_size"], f"{where}.image_size"),
            patch_size=_square(merged["patch_size"], f"{where}.patch_size"),
            hidden_act=str(merged["hidden_act"]),
            layer_norm_eps=float(merged["layer_norm_eps"]),
        )
        activation(config.hidden_act, f"{where}.hidden_act")
        if config.image_size % config.patch_size:
            raise ValueError(
                f"{where}.image_size: {config.image_size} pixels is not a multiple of "
                f"patch_size ({config.patch_size} pixels)"
            )
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"{where}.hidden_size: {config.hidden_size} does not split into "
                f"num_attention_heads ({config.num_attention_heads}) heads"
            )
        return config


def _square(value: Any, field: str) -> int:
    """An int, or [n, n]: transformers allows a pair; the tower here is square only."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"{field}: {value} is not square (only square images are supported)")
        value = value[0]
    return int(value)


@dataclass
class ClipLayerWeights:
    norm1_weight: torch.Tensor
    norm1_bias: torch.Tensor
    qkv: torch.Tensor  # [3D, D]: q | k | v, one product
    qkv_bias: torch.Tensor
    out_proj: torch.Tensor
    out_bias: torch.Tensor
    norm2_weight: torch.Tensor
    norm2_bias: torch.Tensor
    fc1: torch.Tensor
    fc1_bias: torch.Tensor
    fc2: torch.Tensor
    fc2_bias: torch.Tensor


@dataclass
class ClipVisionWeights:
    class_embedding: torch.Tensor  # [D]
    patch_embedding: torch.Tensor  # [D, C, patch, patch]
    position_embedding: torch.Tensor  # [1 + P, D]
    pre_norm_weight: torch.Tensor
    pre_norm_bias: torch.Tensor
    layers: list[ClipLayerWeights]


def load_clip_vision(
    source: WeightSource,
    prefix: str,
    config: ClipVisionConfig,
    num_layers: int,
    device: str,
    dtype: torch.dtype,
) -> ClipVisionWeights:
    """The embeddings, pre-norm and layers 0..num_layers-1 of the tower under `prefix`."""

    def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return source.get(prefix + name, shape=shape).to(device=device, dtype=dtype)

    d, c, p = config.hidden_size, config.num_channels, config.patch_size
    return ClipVisionWeights(
        class_embedding=read("embeddings.class_embedding", (d,)),
        patch_embedding=read("embeddings.patch_embedding.weight", (d, c, p, p)),
        position_embedding=read(
            "embeddings.position_embedding.weight", (1 + config.num_patches, d)
        ),
        pre_norm_weight=read("pre_layrnorm.weight", (d,)),
        pre_norm_bias=read("pre_layrnorm.bias", (d,)),
        layers=[_load_layer(read, config, i) for i in range(num_layers)],
    )


def _load_layer(read, config: ClipVisionConfig, i: int) -> ClipLayerWeights:
    p, d, inter = f"encoder.layers.{i}.", config.hidden_size, config.intermediate_size
    qkv = [read(f"{p}self_attn.{n}_proj.weight", (d, d)) for n in "qkv"]
    qkv_bias = [read(f"{p}self_attn.{n}_proj.bias", (d,)) for n in "qkv"]
    return ClipLayerWeights(
        norm1_weight=read(p + "layer_norm1.weight", (d,)),
        norm1_bias=read(p + "layer_norm1.bias", (d,)),
        qkv=torch.cat(qkv),
        qkv_bias=torch.cat(qkv_bias),
        out_proj=read(p + "self_attn.out_proj.weight", (d, d)),
        out_bias=read(p + "self_attn.out_proj.bias", (d,)),
        norm2_weight=read(p + "layer_norm2.weight", (d,)),
        norm2_bias=read(p + "layer_norm2.bias", (d,)),
        fc1=read(p + "mlp.fc1.weight", (inter, d)),
        fc1_bias=read(p + "mlp.fc1.bias", (inter,)),
        fc2=read(p + "mlp.fc2.weight", (d, inter)),
        fc2_bias=read(p + "mlp.fc2.bias", (d,)),
    )


def clip_hidden_states(
    weights: ClipVisionWeights,
    config: ClipVisionConfig,
    pixel_values: torch.Tensor,
    layer_ids: tuple[int, ...],
) -> list[torch.Tensor]:
    """pixel_values [N, C, S, S] -> hidden_states[i] for each i of `layer_ids` (0..loaded
    layers), each [N, 1 + P, D] in the weights' dtype."""
    c, s = config.num_channels, config.image_size
    if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (c, s, s):
        raise ValueError(
            f"pixel_values: shape {tuple(pixel_values.shape)}, the vision tower takes [N, {c}, {s}, {s}]"
        )
    w = weights
    x = pixel_values.to(device=w.patch_embedding.device, dtype=w.patch_embedding.dtype)
    patches = F.conv2d(x, w.patch_embedding, stride=config.patch_size)  # [N, D, S/p, S/p]
    patches = patches.flatten(2).transpose(1, 2)  # [N, P, D], row-major over the grid
    cls = w.class_embedding.expand(x.shape[0], 1, -1)
    hidden = torch.cat([cls, patches], dim=1) + w.position_embedding
    hidden = F.layer_norm(
        hidden, (config.hidden_size,), w.pre_norm_weight, w.pre_norm_bias, config.layer_norm_eps
    )
    act = activation(config.hidden_act, "hidden_act")
    states = {0: hidden}
    for i, layer in enumerate(w.layers[: max(layer_ids)], start=1):
        hidden = _encoder_layer(layer, hidden, config, act)
        states[i] = hidden
    return [states[i] for i in layer_ids]


def _encoder_layer(w: ClipLayerWeights, hidden, config: ClipVisionConfig, act) -> torch.Tensor:
    n, s, d = hidden.shape
    eps, heads = config.layer_norm_eps, config.num_attention_heads
    x = F.layer_norm(hidden, (d,), w.norm1_weight, w.norm1_bias, eps)
    qkv = F.linear(x, w.qkv, w.qkv_bias).view(n, s, 3, heads, config.head_dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [N, heads, S, head_dim]
    attn = F.scaled_dot_product_attention(q, k, v)  # scale head_dim^-0.5, no mask
    hidden = hidden + F.linear(attn.transpose(1, 2).reshape(n, s, d), w.out_proj, w.out_bias)
    x = F.layer_norm(hidden, (d,), w.norm2_weight, w.norm2_bias, eps)
    return hidden + F.linear(act(F.linear(x, w.fc1, w.fc1_bias)), w.fc2, w.fc2_bias)
