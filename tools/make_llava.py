"""`ringllm make-model --arch llava`: the parts of a tiny LLaVA-1.5 folder beyond its Llama
decoder (tools/make_model.py writes the decoder, the tokenizer and the files every arch has).

A CLIP vision tower (`VisionShape`) and its projector at random, scaled like the decoder;
an `<image>` special token (config.json's `image_token_index`); a chat template that puts
`<image>` where a message has an image part; the image processor's configs
(preprocessor_config.json: CLIP's resize, crop and normalization; processor_config.json,
for transformers' own processor to expand `<image>`).

`make-model --arch llava` writes the tiny default (32 px, 16 image positions, a 2-layer
64-wide decoder: tests). For figures that mean something, `BENCH_SHAPES` holds bigger
random ones, written by this module's own command:

    python -m ringllm.tools.make_llava OUT --shape clip-b-smollm2   # ~220M parameters

    tiny             the make-model default
    clip-b-smollm2   a CLIP-B-sized tower (224 px, patch 14: 256 image positions; 768
                     wide, 12 layers, 12 heads) before a SmolLM2-135M-sized decoder (576
                     wide, 30 layers, 9 heads, 3 KV heads, intermediate 1536, vocab 49152)

The model's vocabulary is larger than the trained tokenizer's (which the standard library's
source cannot make past ~8K tokens); its rows past the tokenizer's are zeroed
(`zero_padding_rows`), as padded checkpoints have them, so every token the model picks
decodes to text (a served stream with undecodable tokens has no content to time).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ringllm.tools.make_model import ModelShape

IMAGE_TOKEN = "<image>"
# ChatML; a message's content is a string or a list of parts: text parts' text, and one
# <image> per image part (the processor expands it to the image's feature rows)
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ['image', 'image_url'] %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# OpenAI CLIP's per-channel pixel mean and std (what CLIPImageProcessor normalizes with)
CLIP_IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass(frozen=True)
class VisionShape:
    """The CLIP vision tower of `--arch llava`."""

    image_size: int = 32  # pixels per side
    patch_size: int = 8  # pixels per side: (32 / 8)^2 = 16 image tokens
    hidden_size: int = 32
    intermediate_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    feature_layer: int = -2  # LLaVA-1.5's: the second to last hidden state
    select_strategy: str = "default"  # default: the CLS feature dropped; full: kept

    @property
    def num_image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + (self.select_strategy == "full")


def llava_config(shape: ModelShape, vision: VisionShape, text: dict, image_token_id: int) -> dict:
    dtype_key = "torch_dtype" if shape.config_style == "legacy" else "dtype"
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": text,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": vision.hidden_size,
            "intermediate_size": vision.intermediate_size,
            "num_hidden_layers": vision.num_layers,
            "num_attention_heads": vision.num_heads,
            "num_channels": 3,
            "image_size": vision.image_size,
            "patch_size": vision.patch_size,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
        },
        "image_token_index": image_token_id,
        "image_seq_length": vision.num_image_tokens,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": vision.feature_layer,
        "vision_feature_select_strategy": vision.select_strategy,
        "tie_word_embeddings": shape.tie_word_embeddings,
        dtype_key: shape.dtype,
    }


def write_processor_configs(out: Path, vision: VisionShape) -> None:
    size = vision.image_size
    image_processor = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": size},
        "resample": 3,  # bicubic
        "do_center_crop": True,
        "crop_size": {"height": size, "width": size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": CLIP_IMAGE_MEAN,
        "image_std": CLIP_IMAGE_STD,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=2))
    processor = {
        "processor_class": "LlavaProcessor",
        "image_token": IMAGE_TOKEN,
        "patch_size": vision.patch_size,
        "vision_feature_select_strategy": vision.select_strategy,
        "num_additional_image_tokens": 1,  # the CLS feature
    }
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))


def llava_weights(
    shape: ModelShape, vision: VisionShape, text: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The decoder's weights under LLaVA's names (transformers >= 4.52), the tower's and
    the projector's made at random, scaled as the decoder's are."""
    g = torch.Generator().manual_seed(shape.seed + 1)
    d, inter, p, h = (
        vision.hidden_size,
        vision.intermediate_size,
        vision.patch_size,
        shape.hidden_size,
    )

    def mat(*dims: int) -> torch.Tensor:
        fan_in = 1
        for n in dims[1:]:
            fan_in *= n
        return torch.randn(*dims, generator=g) * fan_in**-0.5

    def vec(n: int, center: float = 0.0, std: float = 0.1) -> torch.Tensor:
        return center + std * torch.randn(n, generator=g)

    w = {
        "embeddings.class_embedding": vec(d, std=0.5),
        "embeddings.patch_embedding.weight": mat(d, 3, p, p),
        "embeddings.position_embedding.weight": 0.5
        * torch.randn((vision.image_size // p) ** 2 + 1, d, generator=g),
        "pre_layrnorm.weight": vec(d, 1.0),
        "pre_layrnorm.bias": vec(d),
        "post_layernorm.weight": vec(d, 1.0),
        "post_layernorm.bias": vec(d),
    }
    for i in range(vision.num_layers):
        q = f"encoder.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w[f"{q}self_attn.{name}.weight"] = mat(d, d)
            w[f"{q}self_attn.{name}.bias"] = vec(d)
        for name in ("layer_norm1", "layer_norm2"):
            w[f"{q}{name}.weight"] = vec(d, 1.0)
            w[f"{q}{name}.bias"] = vec(d)
        w[q + "mlp.fc1.weight"], w[q + "mlp.fc1.bias"] = mat(inter, d), vec(inter)
        w[q + "mlp.fc2.weight"], w[q + "mlp.fc2.bias"] = mat(d, inter), vec(d)
    out = {"model.vision_tower.vision_model." + k: v for k, v in w.items()}
    projector = {
        "linear_1.weight": mat(h, d),
        "linear_1.bias": vec(h),
        "linear_2.weight": mat(h, h),
        "linear_2.bias": vec(h),
    }
    out.update({"model.multi_modal_projector." + k: v for k, v in projector.items()})
    dtype = next(iter(text.values())).dtype
    out = {k: v.to(dtype).contiguous() for k, v in out.items()}
    for name, tensor in text.items():
        if name.startswith("model."):
            name = "model.language_model." + name.removeprefix("model.")
        out[name] = tensor  # lm_head.weight keeps its name
    return out


def bench_shapes() -> dict[str, tuple[ModelShape, VisionShape]]:
    """The shapes `python -m ringllm.tools.make_llava --shape NAME` writes."""
    from ringllm.tools.make_model import ModelShape

    return {
        "tiny": (ModelShape(arch="llava"), VisionShape()),
        "clip-b-smollm2": (
            ModelShape(
                arch="llava", hidden_size=576, intermediate_size=1536, num_layers=30,
                num_heads=9, num_kv_heads=3, model_vocab_size=49152, tie_word_embeddings=True,
                rope_theta=100000.0, dtype="bfloat16",
            ),
            VisionShape(
                image_size=224, patch_size=14, hidden_size=768, intermediate_size=3072,
                num_layers=12, num_heads=12,
            ),
        ),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import dataclasses

    from ringllm.tools.make_model import make_model

    shapes = bench_shapes()
    parser = argparse.ArgumentParser(
        prog="python -m ringllm.tools.make_llava",
        description="write a random LLaVA-1.5 folder of one of the benchmark shapes",
    )
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--shape", choices=sorted(shapes), default="clip-b-smollm2")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None,
        help="the weights' dtype (default: the shape's)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape, vision = shapes[args.shape]
    shape = dataclasses.replace(shape, seed=args.seed, dtype=args.dtype or shape.dtype)
    out = make_model(args.out, shape, vision)
    if shape.model_vocab_size is not None:
        zero_padding_rows(out)
    print(out)
    return 0


def zero_padding_rows(out: Path) -> None:
    """The embedding (and an untied lm_head) rows past the tokenizer's vocabulary set to 0:
    their logits are 0, far below the best of the real rows' (std ~ sqrt(hidden) / 2), so
    greedy decoding never picks a token that has no text."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    num_tokens = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    path = out / "model.safetensors"
    weights = load_file(str(path))
    for name in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            weights[name][num_tokens:] = 0
    save_file(weights, str(path), metadata={"format": "pt"})


if __name__ == "__main__":
    raise SystemExit(main())
