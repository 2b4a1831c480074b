"""LLaVA (1.5): a CLIP vision tower and a projector in front of a Llama-family decoder.

    pixel_values [N, 3, S, S] -> CLIP tower (models/clip.py) -> hidden_states[vision_feature_layer]
      -> drop the CLS row ("default") or keep it ("full")   [N, num_image_tokens, D_vision]
      -> linear_1 -> projector_hidden_act -> linear_2       [N, num_image_tokens, H]

    prompt ids:   t t t <image> x num_image_tokens t t <image> x num_image_tokens t t
    embeddings:   text rows looked up; the image-token rows replaced, in order, by the
                  rows of the images' features (`merge_image_embeds`)
                  -> the decoder's `forward(batch, kv_caches, inputs_embeds)`

The class *is* its language model (a `LlamaForCausalLM` subclass, built from
`text_config`; Mistral / Qwen2 / Qwen3 text models get their variant's `adapt_config`):
text-only steps run `forward(batch, kv_caches)` unchanged, and the KV cache, tensor
parallelism and sleep mode see the decoder as they would a text model. The vision tower
and projector are replicated on every rank. Under pipeline parallelism they belong to the
first stage (which embeds the input); later stages are the decoder's stages unchanged.

The prompt must hold one image token per feature row (the front end expands each image's
placeholder to `num_image_tokens`); a prefill chunk that ends inside an image takes the
rows of that image's features that fall in the chunk.

Checkpoint names, both layouts accepted (and the vision tower with or without
`vision_model.`, which transformers 5 saves without):

    transformers >= 4.52               older
    model.language_model.<decoder>     language_model.model.<decoder>
    lm_head.weight                     language_model.lm_head.weight
    model.vision_tower.vision_model.   vision_tower.vision_model.
    model.multi_modal_projector.       multi_modal_projector.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ringllm.pipeline.models.clip import (
    ClipVisionConfig,
    ClipVisionWeights,
    activation,
    clip_hidden_states,
    load_clip_vision,
)
from ringllm.pipeline.models.communicator import Communicator
from ringllm.pipeline.models.hf_config import ArchConfig
from ringllm.pipeline.models.llama import LlamaForCausalLM
from ringllm.pipeline.models.registry import model_class, register
from ringllm.pipeline.models.stages import StageInfo
from ringllm.pipeline.models.weights import Shard, WeightSource
from ringllm.pipeline.ops import Ops

SELECT_STRATEGIES = ("default", "full")  # drop the CLS feature / keep it
# text_config.model_type -> the registered decoder (when text_config names no architecture)
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# (decoder prefix, its head's name), newest layout first
TEXT_LAYOUTS = (
    ("model.language_model.", "lm_head.weight"),
    ("language_model.model.", "language_model.lm_head.weight"),
)
VISION_PREFIXES = (
    "model.vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.vision_model.",
    "vision_tower.",
)
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


@dataclass(frozen=True)
class LlavaConfig:
    """LLaVA's own fields of config.json, checked."""

    vision: ClipVisionConfig
    image_token_id: int
    feature_layers: tuple[int, ...]  # hidden_states indices, 0..num_hidden_layers
    select_strategy: str
    projector_hidden_act: str
    projector_bias: bool
    text_architecture: str

    @property
    def num_image_tokens(self) -> int:
        """Feature rows (prompt positions) per image."""
        return self.vision.num_patches + (self.select_strategy == "full")

    @property
    def num_vision_layers(self) -> int:
        """Tower layers that must run: up to the deepest feature layer."""
        return max(self.feature_layers)

    @classmethod
    def from_arch(cls, arch: ArchConfig) -> LlavaConfig:
        raw = arch.multimodal_config
        where = "config.json"
        if raw is None:
            raise ValueError(f"{where}: {arch.architecture} needs text_config and vision_config")
        if not isinstance(raw.get("vision_config"), dict):
            raise ValueError(
                f"{where}: field 'vision_config' (the vision tower's config) is missing"
            )
        vision = ClipVisionConfig.from_dict(raw["vision_config"], f"{where} vision_config")
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in SELECT_STRATEGIES:
            raise ValueError(
                f"{where}: vision_feature_select_strategy {strategy!r} is not supported "
                f"(supported: {SELECT_STRATEGIES})"
            )
        act = raw.get("projector_hidden_act", "gelu")
        activation(act, f"{where}: projector_hidden_act")
        return cls(
            vision=vision,
            image_token_id=_image_token_id(raw, arch.vocab_size, where),
            feature_layers=_feature_layers(raw.get("vision_feature_layer", -2), vision, where),
            select_strategy=strategy,
            projector_hidden_act=act,
            projector_bias=bool(raw.get("multimodal_projector_bias", True)),
            text_architecture=_text_architecture(raw["text_config"], where),
        )


def _image_token_id(raw: dict[str, Any], vocab_size: int, where: str) -> int:
    value = raw.get("image_token_index", raw.get("image_token_id", 32000))
    if not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(
            f"{where}: image_token_index {value!r} is not a token id of the vocab "
            f"(0..{vocab_size - 1})"
        )
    return value


def _feature_layers(value: Any, vision: ClipVisionConfig, where: str) -> tuple[int, ...]:
    """vision_feature_layer (an int or a list, negative counting from the end of the
    num_hidden_layers + 1 hidden states) -> indices 0..num_hidden_layers."""
    num_states = vision.num_hidden_layers + 1
    layers = [value] if isinstance(value, int) else value
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
        raise ValueError(f"{where}: vision_feature_layer {value!r} is not an int or a list of ints")
    for i in layers:
        if not -num_states <= i < num_states:
            raise ValueError(
                f"{where}: vision_feature_layer {i} is outside the vision tower's "
                f"{num_states} hidden states ({-num_states}..{num_states - 1})"
            )
    return tuple(i % num_states for i in layers)


def _text_architecture(text: dict[str, Any], where: str) -> str:
    archs = text.get("architectures") or []
    model_type = text.get("model_type", "llama")
    name = archs[0] if archs else TEXT_ARCHITECTURES.get(model_type)
    if name is None:
        raise ValueError(
            f"{where}: text_config.model_type {model_type!r} is not supported "
            f"(supported: {sorted(TEXT_ARCHITECTURES)})"
        )
    decoder = model_class(name)
    if not issubclass(decoder, LlamaForCausalLM) or issubclass(
        decoder, LlavaForConditionalGeneration
    ):
        raise ValueError(f"{where}: text_config's {name} is not a Llama-family decoder")
    return name


@dataclass
class ProjectorWeights:
    linear_1: torch.Tensor  # [H, D_vision * len(feature_layers)]
    bias_1: torch.Tensor | None
    linear_2: torch.Tensor  # [H, H]
    bias_2: torch.Tensor | None


class _DecoderNames:
    """A LLaVA checkpoint seen with a text model's names (`model.layers.0...`,
    `lm_head.weight`), for the decoder's own loader."""

    def __init__(self, source: WeightSource, prefix: str, head: str) -> None:
        self.source, self.prefix, self.head = source, prefix, head

    def _name(self, name: str) -> str:
        if name == "lm_head.weight":
            return self.head
        return self.prefix + name.removeprefix("model.")

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self.source

    def get(
        self, name: str, shard: Shard | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        return self.source.get(self._name(name), shard=shard, shape=shape)


def _find_prefix(source: WeightSource, prefixes, probe: str, what: str) -> str:
    for prefix in prefixes:
        if prefix + probe in source:
            return prefix
    raise ValueError(
        f"the weights hold no {what}: none of {[p + probe for p in prefixes]} is there"
    )


@register("LlavaForConditionalGeneration")
class LlavaForConditionalGeneration(LlamaForCausalLM):
    supports_lora = False  # adapters name language_model.*: not read yet

    @classmethod
    def adapt_config(cls, arch: ArchConfig) -> ArchConfig:
        """The text decoder's variant (e.g. Qwen2's q/k/v bias); checks LLaVA's fields."""
        llava = LlavaConfig.from_arch(arch)
        adapted = model_class(llava.text_architecture).adapt_config(arch)
        return dataclasses.replace(adapted, architecture=arch.architecture)

    @classmethod
    def image_fields(cls, arch: ArchConfig) -> tuple[int, int, int]:
        """(image token id, positions per image, pixels per side), from config.json alone."""
        llava = LlavaConfig.from_arch(arch)
        return llava.image_token_id, llava.num_image_tokens, llava.vision.image_size

    def __init__(
        self,
        arch: ArchConfig,
        ops: Ops,
        dtype: torch.dtype,
        device: str,
        max_positions: int,
        comm: Communicator | None = None,
        stage: StageInfo | None = None,
        quantization: str | None = None,
    ) -> None:
        super().__init__(arch, ops, dtype, device, max_positions, comm, stage, quantization)
        self.llava = LlavaConfig.from_arch(arch)
        self.vision: ClipVisionWeights | None = None
        self.projector: ProjectorWeights | None = None
        self._projector_act = activation(self.llava.projector_hidden_act, "projector_hidden_act")

    @property
    def image_token_id(self) -> int:
        return self.llava.image_token_id

    @property
    def num_image_tokens(self) -> int:
        """Prompt positions (feature rows) per image."""
        return self.llava.num_image_tokens

    @property
    def image_size(self) -> int:
        """Pixels per side of the square images `embed_images` takes."""
        return self.llava.vision.image_size

    # ---- loading -------------------------------------------------------------------

    def load_weights(self, source: WeightSource) -> None:
        prefix = _find_prefix(
            source, [p for p, _ in TEXT_LAYOUTS], "embed_tokens.weight", "language model"
        )
        head = dict(TEXT_LAYOUTS)[prefix]
        super().load_weights(_DecoderNames(source, prefix, head))
        if not self.stage.is_first:
            return  # the vision tower and projector feed the first stage's embeddings
        cfg = self.llava
        vision_prefix = _find_prefix(
            source, VISION_PREFIXES, "embeddings.class_embedding", "vision tower"
        )
        self.vision = load_clip_vision(
            source, vision_prefix, cfg.vision, cfg.num_vision_layers, self.device, self.dtype
        )
        self.projector = self._load_projector(
            source, _find_prefix(source, PROJECTOR_PREFIXES, "linear_1.weight", "projector")
        )

    def _load_projector(self, source: WeightSource, prefix: str) -> ProjectorWeights:
        h = self.arch.hidden_size
        d_in = self.llava.vision.hidden_size * len(self.llava.feature_layers)

        def bias(name: str) -> torch.Tensor | None:
            return self._read(source, prefix + name, (h,)) if self.llava.projector_bias else None

        return ProjectorWeights(
            linear_1=self._read(source, prefix + "linear_1.weight", (h, d_in)),
            bias_1=bias("linear_1.bias"),
            linear_2=self._read(source, prefix + "linear_2.weight", (h, h)),
            bias_2=bias("linear_2.bias"),
        )

    # ---- images and embeddings -----------------------------------------------------

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] (resized, cropped, normalized: preprocessor_config.json)
        -> the images' features [N, num_image_tokens, hidden] in the model dtype."""
        if self.vision is None:
            raise ValueError(
                f"embed_images: pipeline stage {self.stage.rank} of {self.stage.size} holds "
                "no vision tower (the first stage encodes the images)"
            )
        cfg, p = self.llava, self.projector
        states = clip_hidden_states(self.vision, cfg.vision, pixel_values, cfg.feature_layers)
        if cfg.select_strategy == "default":
            states = [s[:, 1:] for s in states]
        features = torch.cat(states, dim=-1)
        hidden = self._projector_act(F.linear(features, p.linear_1, p.bias_1))
        return F.linear(hidden, p.linear_2, p.bias_2)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the text embeddings [T, hidden] (image tokens get their own row)."""
        return self._embed(input_ids)

    def merge_image_embeds(
        self, input_ids: torch.Tensor, image_embeds: torch.Tensor
    ) -> torch.Tensor:
        """The input rows of a flat token batch: input_ids [T] -> [T, hidden], the rows of
        image tokens replaced in order by image_embeds [M, hidden], M = the image tokens in
        input_ids (the rows of `embed_images` that fall in this batch's tokens)."""
        embeds = self._embed(input_ids)
        is_image = input_ids == self.image_token_id
        num_image_tokens = int(is_image.sum())
        if image_embeds.shape != (num_image_tokens, embeds.shape[1]):
            raise ValueError(
                f"image_embeds: shape {tuple(image_embeds.shape)}, the batch has "
                f"{num_image_tokens} image tokens of hidden size {embeds.shape[1]}"
            )
        embeds[is_image] = image_embeds.to(device=embeds.device, dtype=embeds.dtype)
        return embeds
