"""ImageProcessor against transformers' PIL image processors (CLIP, LLaVA)."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest
from PIL import Image

from ringllm.pipeline.frontend.image_processor import (
    ImageProcessor,
    ImageProcessorConfig,
    to_rgb,
)

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

# llava-hf/llava-1.5-7b-hf's preprocessor_config.json.
LLAVA_15 = {
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "processor_class": "LlavaProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 336},
}
_META = ("image_processor_type", "feature_extractor_type", "processor_class")


def oracle(config: dict):
    """transformers' PIL-backend processor for the same config."""
    kind = config.get("image_processor_type", config.get("feature_extractor_type"))
    cls = (
        transformers.LlavaImageProcessorPil
        if kind.startswith("Llava")
        else transformers.CLIPImageProcessorPil
    )
    return cls(**{k: v for k, v in config.items() if k not in _META})


def ours(tmp_path, config: dict) -> ImageProcessor:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    return ImageProcessor.from_folder(tmp_path)


def assert_same(processor: ImageProcessor, reference, images: list[Image.Image]) -> None:
    got = processor(images)
    want = reference(images, return_tensors="np")["pixel_values"]
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # the same ops: bit-equal


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "LA": 2, "L": 1, "CMYK": 4}[mode]
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode)


def reopened(image: Image.Image, fmt: str, **save_args) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save_args)
    return Image.open(io.BytesIO(buffer.getvalue()))


@pytest.mark.parametrize(
    "width,height",
    [
        (1, 1),
        (2, 3),
        (1, 300),
        (300, 1),
        (335, 337),
        (336, 336),
        (337, 336),
        (1000, 17),
        (3000, 4000),
    ],
)
def test_sizes_and_aspect_ratios_match_transformers(tmp_path, width, height):
    assert_same(ours(tmp_path, LLAVA_15), oracle(LLAVA_15), [random_image(width, height)])


def palette_image(width: int, height: int, transparency=None) -> Image.Image:
    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 16, (height, width), dtype=np.uint8), "P")
    image.putpalette(rng.integers(0, 256, 16 * 3, dtype=np.uint8).tolist())
    if transparency is None:
        return reopened(image, "PNG")
    return reopened(image, "PNG", transparency=transparency)


MODES = {
    "RGB": lambda: random_image(50, 40),
    "RGBA": lambda: random_image(50, 40, "RGBA"),
    "LA": lambda: random_image(41, 50, "LA"),
    "L": lambda: random_image(41, 50, "L"),
    "L with tRNS": lambda: reopened(random_image(30, 31, "L"), "PNG", transparency=7),
    "1": lambda: random_image(64, 48, "L").convert("1"),
    "P": lambda: palette_image(45, 33),
    "P, one transparent index": lambda: palette_image(45, 33, transparency=3),
    "P, alpha per entry": lambda: palette_image(45, 33, transparency=bytes(range(0, 256, 16))),
    "CMYK JPEG": lambda: reopened(random_image(60, 50, "CMYK"), "JPEG"),
    "I (32-bit)": lambda: Image.fromarray(np.arange(-500, 1500, dtype=np.int32).reshape(40, 50)),
    "F (float)": lambda: Image.fromarray(
        np.linspace(-9, 300, 2000, dtype=np.float32).reshape(40, 50)
    ),
    "RGB JPEG": lambda: reopened(random_image(60, 50), "JPEG"),
    "animated GIF": lambda: reopened(
        random_image(20, 20).convert("P"),
        "GIF",
        save_all=True,
        append_images=[random_image(20, 20, seed=2).convert("P")],
    ),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_modes_match_transformers(tmp_path, mode):
    image = MODES[mode]()
    assert_same(ours(tmp_path, LLAVA_15), oracle(LLAVA_15), [image])


def test_rgba_composites_onto_white():
    image = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert to_rgb(image).getpixel((0, 0)) == (255, 255, 255)


def test_sixteen_bit_gray_keeps_the_high_byte(tmp_path):
    values = np.random.default_rng(3).integers(0, 65536, (40, 50), dtype=np.uint16)
    image = reopened(Image.frombytes("I;16", (50, 40), values.astype("<u2").tobytes()), "PNG")
    assert image.mode == "I;16"
    processor, reference = ours(tmp_path, LLAVA_15), oracle(LLAVA_15)
    # transformers clips at 255: nearly every pixel comes out white ...
    clipped = reference([image], return_tensors="np")["pixel_values"]
    white = reference([Image.new("RGB", (50, 40), "white")], return_tensors="np")["pixel_values"]
    assert np.mean(clipped == white) > 0.95
    # ... we keep the high byte, as Pillow does for 16-bit RGB.
    high_byte = Image.fromarray((values >> 8).astype(np.uint8), "L")
    np.testing.assert_array_equal(
        processor([image]), reference([high_byte], return_tensors="np")["pixel_values"]
    )


def test_lab_is_refused(tmp_path):
    with pytest.raises(ValueError, match="LAB"):
        ours(tmp_path, LLAVA_15)([Image.new("LAB", (8, 8))])


def test_a_batch_of_mixed_images(tmp_path):
    images = [random_image(100, 50), random_image(7, 300, "RGBA"), palette_image(9, 9)]
    processor = ours(tmp_path, LLAVA_15)
    assert_same(processor, oracle(LLAVA_15), images)
    assert processor.output_hw == (336, 336)
    assert processor([]).shape == (0, 3, 336, 336)


CONFIGS = {
    "clip defaults": {"image_processor_type": "CLIPImageProcessor"},
    "height x width, no crop": {
        "image_processor_type": "CLIPImageProcessor",
        "size": {"height": 30, "width": 50},
        "do_center_crop": False,
    },
    "crop larger than the resize pads": {
        "image_processor_type": "CLIPImageProcessor",
        "size": {"shortest_edge": 21},
        "crop_size": {"height": 40, "width": 33},
    },
    "no resize": {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": False,
        "crop_size": {"height": 64, "width": 17},
    },
    "no rescale": {"image_processor_type": "CLIPImageProcessor", "do_rescale": False},
    "no normalize": {"image_processor_type": "CLIPImageProcessor", "do_normalize": False},
    "neither": {
        "image_processor_type": "CLIPImageProcessor",
        "do_rescale": False,
        "do_normalize": False,
    },
    "scalar mean and std": {
        "image_processor_type": "CLIPImageProcessor",
        "image_mean": 0.5,
        "image_std": 0.25,
    },
    "legacy feature extractor, int sizes": {
        "feature_extractor_type": "CLIPFeatureExtractor",
        "size": 48,
        "crop_size": 40,
    },
    "llava, do_pad false": {**LLAVA_15, "image_processor_type": "LlavaImageProcessor"},
    "llava, pad to square": {
        **LLAVA_15,
        "image_processor_type": "LlavaImageProcessor",
        "do_pad": True,
    },
    **{
        f"resample {code}": {
            "image_processor_type": "CLIPImageProcessor",
            "resample": code,
            "size": {"shortest_edge": 37},
            "crop_size": {"height": 37, "width": 37},
        }
        for code in range(6)
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_configs_match_transformers(tmp_path, name):
    config = CONFIGS[name]
    images = [random_image(61, 45), random_image(20, 90, "RGBA"), random_image(5, 3)]
    assert_same(ours(tmp_path, config), oracle(config), images)


def test_without_convert_rgb_only_rgb_is_taken(tmp_path):
    config = {**LLAVA_15, "do_convert_rgb": False}
    processor = ours(tmp_path, config)
    assert_same(processor, oracle(config), [random_image(40, 30)])
    with pytest.raises(ValueError, match="mode RGBA .* do_convert_rgb"):
        processor([random_image(40, 30, "RGBA")])


@pytest.mark.parametrize(
    "config,match",
    [
        (
            {"image_processor_type": "SiglipImageProcessor"},
            "'SiglipImageProcessor' is not supported",
        ),
        ({}, "None is not supported"),
        ({**LLAVA_15, "do_image_splitting": True}, "do_image_splitting"),
        ({**LLAVA_15, "auto_map": {}, "crop_pct": 0.9}, "auto_map, crop_pct"),
        ({**LLAVA_15, "do_pad": True}, "do_pad is not supported for CLIPImageProcessor"),
        ({**LLAVA_15, "size": {"shortest_edge": 336, "longest_edge": 672}}, "longest_edge"),
        ({**LLAVA_15, "size": {"height": 336}}, "size"),
        ({**LLAVA_15, "size": {"shortest_edge": 0}}, "shortest_edge must be a positive"),
        ({**LLAVA_15, "crop_size": {"height": 1.5, "width": 2}}, "crop_size: height"),
        ({**LLAVA_15, "resample": 9}, "resample: 9"),
        ({**LLAVA_15, "do_resize": "yes"}, "do_resize must be true or false"),
        ({**LLAVA_15, "image_mean": [0.5, 0.5]}, "image_mean must be three numbers"),
        ({**LLAVA_15, "image_std": [1, 0, 1]}, "image_std: must not contain 0"),
        ({**LLAVA_15, "do_center_crop": False}, "fixed size"),
    ],
)
def test_unsupported_configs_are_refused_by_name(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        ours(tmp_path, config)


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match="preprocessor_config.json: not found"):
        ImageProcessor.from_folder(tmp_path)


def test_an_extreme_aspect_ratio_past_the_resize_limit_is_refused():
    processor = ImageProcessor(ImageProcessorConfig(), max_resized_pixels=224 * 224 * 100)
    processor([random_image(100, 1)])  # 22400 x 224: at the limit
    with pytest.raises(ValueError, match="101x1 pixels would resize to 22624x224"):
        processor([random_image(101, 1)])
