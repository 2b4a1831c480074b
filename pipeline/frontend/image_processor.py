"""Image preprocessing: decoded PIL images -> the pixel values a vision tower was trained on.

A model folder says how in `preprocessor_config.json`. We implement the CLIP family that
LLaVA-1.5 uses (`CLIPImageProcessor`, its legacy name `CLIPFeatureExtractor`, and
`LlavaImageProcessor`, whose only addition is `do_pad`: pad to a square of the mean colour
before resizing). The stages, in transformers' order, all on uint8 until the rescale:

    convert to RGB -> [pad to square] -> resize (PIL, shortest edge or height x width)
    -> center crop (zero-padded when the image is smaller) -> rescale -> normalize

Invariants:
- The numerics are those of transformers' PIL backend (`CLIPImageProcessorPil`): the same
  Pillow resize, the rescale in float64 cast to float32, the normalize in float32. Output
  equals transformers' exactly (`tests/pipeline/frontend/test_images.py` holds it), with
  the one deliberate difference noted in `to_rgb` (16-bit grayscale).
- Every field of the config is either implemented or refused with a ValueError naming
  it; nothing is silently ignored but the bookkeeping keys in `_METADATA_KEYS`.
- Only Pillow and numpy run here: no torch, no transformers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ringllm.pipeline.frontend.tokenizer import read_json_file

PREPROCESSOR_CONFIG_FILE = "preprocessor_config.json"

# OpenAI CLIP's statistics: transformers' defaults for the CLIP family.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# NOTE: the Fast names run torchvision's resize in transformers (close to Pillow's, not
# bit-equal); we give those models the PIL backend's numerics, which is what a
# transformers install without torchvision gives them too.
_CLIP_TYPES = ("CLIPImageProcessor", "CLIPImageProcessorPil", "CLIPImageProcessorFast")
_LLAVA_TYPES = ("LlavaImageProcessor", "LlavaImageProcessorPil", "LlavaImageProcessorFast")
_LEGACY_TYPES = ("CLIPFeatureExtractor",)
_METADATA_KEYS = frozenset({"image_processor_type", "feature_extractor_type", "processor_class"})
_FIELDS = frozenset(
    {
        "do_convert_rgb",
        "do_pad",
        "do_resize",
        "size",
        "default_to_square",
        "resample",
        "do_center_crop",
        "crop_size",
        "do_rescale",
        "rescale_factor",
        "do_normalize",
        "image_mean",
        "image_std",
    }
)
_SIXTEEN_BIT_GRAY = ("I;16", "I;16L", "I;16B", "I;16N")

# NOTE: an extreme aspect ratio makes the shortest-edge resize huge before the crop
# (a 1 x 20000 image at 336 would be 336 x 6.7M pixels); past this we refuse.
DEFAULT_MAX_RESIZED_PIXELS = 1 << 26


@dataclass(frozen=True)
class ImageProcessorConfig:
    """What preprocessor_config.json says, checked. Sizes are in pixels."""

    do_convert_rgb: bool = True
    do_pad_to_square: bool = False
    do_resize: bool = True
    resize_shortest_edge: int | None = 224  # or resize_height x resize_width
    resize_height: int | None = None
    resize_width: int | None = None
    resample: int = int(Image.Resampling.BICUBIC)
    do_center_crop: bool = True
    crop_height: int = 224
    crop_width: int = 224
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    def __post_init__(self) -> None:
        if self.do_resize and (self.resize_shortest_edge is None) == (self.resize_height is None):
            raise ValueError("size: give either shortest_edge or height and width")
        for name in ("resize_shortest_edge", "resize_height", "resize_width"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"size: {name} must be at least 1 pixel, got {value}")
        if self.crop_height < 1 or self.crop_width < 1:
            raise ValueError(
                f"crop_size: must be at least 1 pixel, got {self.crop_height}x{self.crop_width}"
            )
        if self.resample not in {int(r) for r in Image.Resampling}:
            raise ValueError(f"resample: {self.resample} is not a PIL resampling filter (0-5)")
        if any(s == 0 for s in self.image_std):
            raise ValueError(f"image_std: must not contain 0, got {list(self.image_std)}")
        if self.output_hw is None:
            raise ValueError(
                "size/do_center_crop: the output size depends on the image (a shortest_edge "
                "resize without a center crop); batched pixel values need a fixed size"
            )

    @property
    def output_hw(self) -> tuple[int, int] | None:
        """The (height, width) of every output image, or None when it varies."""
        if self.do_center_crop:
            return self.crop_height, self.crop_width
        if self.do_resize and self.resize_height is not None:
            return self.resize_height, self.resize_width
        return None

    @classmethod
    def from_dict(
        cls, config: Mapping[str, Any], where: str = PREPROCESSOR_CONFIG_FILE
    ) -> ImageProcessorConfig:
        """Check a preprocessor config and keep what we implement; refuse the rest by name."""
        kind = config.get("image_processor_type", config.get("feature_extractor_type"))
        if kind not in _CLIP_TYPES + _LLAVA_TYPES + _LEGACY_TYPES:
            raise ValueError(
                f"{where}: image processor {kind!r} is not supported; supported: "
                f"{', '.join(_CLIP_TYPES + _LLAVA_TYPES + _LEGACY_TYPES)}"
            )
        unknown = sorted(set(config) - _FIELDS - _METADATA_KEYS)
        if unknown:
            raise ValueError(f"{where}: field(s) {', '.join(unknown)} of {kind} are not supported")
        do_pad = _flag(config, "do_pad", False, where)
        if do_pad and kind not in _LLAVA_TYPES:
            raise ValueError(
                f"{where}: do_pad is not supported for {kind} (only LLaVA's pad to square)"
            )
        shortest, height, width = _resize_size(config, where)
        crop_height, crop_width = _crop_size(config, where)
        return cls(
            do_convert_rgb=_flag(config, "do_convert_rgb", True, where),
            do_pad_to_square=do_pad,
            do_resize=_flag(config, "do_resize", True, where),
            resize_shortest_edge=shortest,
            resize_height=height,
            resize_width=width,
            resample=_int(config, "resample", int(Image.Resampling.BICUBIC), where),
            do_center_crop=_flag(config, "do_center_crop", True, where),
            crop_height=crop_height,
            crop_width=crop_width,
            do_rescale=_flag(config, "do_rescale", True, where),
            rescale_factor=_number(config, "rescale_factor", 1 / 255, where),
            do_normalize=_flag(config, "do_normalize", True, where),
            image_mean=_triple(config, "image_mean", CLIP_MEAN, where),
            image_std=_triple(config, "image_std", CLIP_STD, where),
        )


class ImageProcessor:
    """Decoded images -> float32 pixel values [N, 3, H, W], as the model's config says."""

    def __init__(
        self,
        config: ImageProcessorConfig,
        max_resized_pixels: int = DEFAULT_MAX_RESIZED_PIXELS,
    ) -> None:
        self.config = config
        self.max_resized_pixels = max_resized_pixels
        self.output_hw: tuple[int, int] = config.output_hw  # type: ignore[assignment]
        self._mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
        self._std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]

    @classmethod
    def from_folder(cls, model_dir: str | Path, **kwargs: Any) -> ImageProcessor:
        path = Path(model_dir) / PREPROCESSOR_CONFIG_FILE
        if not path.is_file():
            raise ValueError(
                f"{path}: not found; a model that takes images needs its preprocessor_config.json"
            )
        return cls(ImageProcessorConfig.from_dict(read_json_file(path), str(path)), **kwargs)

    def __call__(self, images: Sequence[Image.Image]) -> np.ndarray:
        height, width = self.output_hw
        pixel_values = np.empty((len(images), 3, height, width), dtype=np.float32)
        for i, image in enumerate(images):
            pixel_values[i] = self.preprocess(image)
        return pixel_values

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """One image -> [3, H, W] float32."""
        config = self.config
        rgb = to_rgb(image) if config.do_convert_rgb else _require_rgb(image)
        # NOTE: a PIL image until the resize has made it small: every numpy copy of a
        # full-size image costs its size again (a 5,792 x 5,792 PNG: 100 MB each).
        if config.do_pad_to_square:
            fill = tuple(int(m * 255) for m in config.image_mean)
            rgb = pad_to_square(rgb, fill)
        if config.do_resize:
            rgb = self.resize(rgb)
        pixels = np.moveaxis(np.asarray(rgb), -1, 0)  # [3, H, W] uint8
        if config.do_center_crop:
            pixels = center_crop(pixels, config.crop_height, config.crop_width)
        if config.do_rescale:
            # As transformers: the product in float64, then float32.
            values = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
        else:
            values = pixels.astype(np.float32)
        if config.do_normalize:
            values = (values - self._mean) / self._std
        return values

    def resize(self, image: Image.Image) -> Image.Image:
        height, width = self.resized_hw(image.height, image.width)
        if height * width > self.max_resized_pixels:
            raise ValueError(
                f"image: {image.width}x{image.height} pixels would resize to "
                f"{width}x{height}, past the limit of {self.max_resized_pixels} pixels; "
                "send an image with a less extreme aspect ratio"
            )
        return image.resize((width, height), resample=Image.Resampling(self.config.resample))

    def resized_hw(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the resize makes of a height x width image."""
        shortest = self.config.resize_shortest_edge
        if shortest is None:
            return self.config.resize_height, self.config.resize_width  # type: ignore[return-value]
        # torchvision's rule, as transformers writes it: the long side truncates.
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(shortest * long / short)
        return (new_long, shortest) if width <= height else (shortest, new_long)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (transformers' `convert_to_rgb`).

    NOTE: two modes where we do not follow transformers:
    - 16-bit grayscale ("I;16*"): Pillow's convert clips each value at 255, so all but the
      darkest 0.4% of the range turns white. We keep the high byte, as Pillow does for a
      16-bit RGB PNG.
    - "LAB": transformers takes its a* band for alpha (the band is named "A") and Pillow's
      LAB -> RGB copies bands without a colour transform; we refuse it.
    """
    if image.mode in _SIXTEEN_BIT_GRAY:
        high_bytes = (np.asarray(image, dtype=np.uint16) >> 8).astype(np.uint8)
        image = Image.fromarray(high_bytes, "L")
    if image.mode == "LAB":
        raise ValueError("image: mode LAB (CIELab) is not supported; send an RGB image")
    try:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        if image.mode == "RGB":
            return image  # NOTE: convert would copy it, full size
        return image.convert("RGB")
    except ValueError as exc:
        raise ValueError(f"image: mode {image.mode} cannot be converted to RGB ({exc})") from exc


def _require_rgb(image: Image.Image) -> Image.Image:
    if image.mode != "RGB":
        raise ValueError(
            f"image: mode {image.mode} given but the model's do_convert_rgb is false; send RGB"
        )
    return image


def pad_to_square(image: Image.Image, fill: tuple[int, ...]) -> Image.Image:
    """An RGB image -> an S x S one with S the longer side, the image centred (the odd
    pixel after it), `fill` around it."""
    width, height = image.size
    if height == width:
        return image
    side = max(height, width)
    square = Image.new("RGB", (side, side), fill)
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


def center_crop(pixels: np.ndarray, crop_height: int, crop_width: int) -> np.ndarray:
    """[C, H, W] -> [C, crop_height, crop_width]; a side shorter than the crop is centred
    in zeros (the extra pixel, if odd, goes before it: transformers' `ceil`)."""
    (src_y, dst_y, len_y), (src_x, dst_x, len_x) = (
        _crop_span(pixels.shape[1], crop_height),
        _crop_span(pixels.shape[2], crop_width),
    )
    if dst_y == 0 and dst_x == 0:
        return pixels[:, src_y : src_y + len_y, src_x : src_x + len_x]
    out = np.zeros((pixels.shape[0], crop_height, crop_width), dtype=pixels.dtype)
    out[:, dst_y : dst_y + len_y, dst_x : dst_x + len_x] = pixels[
        :, src_y : src_y + len_y, src_x : src_x + len_x
    ]
    return out


def _crop_span(size: int, crop: int) -> tuple[int, int, int]:
    """(source start, destination start, length) of one axis of a center crop."""
    if size >= crop:
        return (size - crop) // 2, 0, crop
    return 0, math.ceil((crop - size) / 2), size


def _resize_size(
    config: Mapping[str, Any], where: str
) -> tuple[int | None, int | None, int | None]:
    """(shortest_edge, height, width) of the `size` field; an int is a shortest edge
    unless `default_to_square` (CLIP's default: false) makes it a square."""
    size = config.get("size", {"shortest_edge": 224})
    if isinstance(size, int) and not isinstance(size, bool):
        if _flag(config, "default_to_square", False, where):
            return None, size, size
        return size, None, None
    if not isinstance(size, Mapping):
        raise ValueError(f"{where}: size must be an int or an object, got {size!r}")
    given = {k: v for k, v in size.items() if v is not None}
    if set(given) == {"shortest_edge"}:
        return _pixels(given, "shortest_edge", f"{where}: size"), None, None
    if set(given) == {"height", "width"}:
        h = _pixels(given, "height", f"{where}: size")
        return None, h, _pixels(given, "width", f"{where}: size")
    raise ValueError(
        f"{where}: size {dict(size)} is not supported; use {{'shortest_edge': N}} or "
        "{'height': H, 'width': W}"
    )


def _crop_size(config: Mapping[str, Any], where: str) -> tuple[int, int]:
    crop = config.get("crop_size", {"height": 224, "width": 224})
    if isinstance(crop, int) and not isinstance(crop, bool):
        return crop, crop
    if not isinstance(crop, Mapping) or set(crop) != {"height", "width"}:
        raise ValueError(
            f"{where}: crop_size must be an int or {{'height', 'width'}}, got {crop!r}"
        )
    return _pixels(crop, "height", f"{where}: crop_size"), _pixels(
        crop, "width", f"{where}: crop_size"
    )


def _pixels(values: Mapping[str, Any], key: str, where: str) -> int:
    value = values[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive number of pixels, got {value!r}")
    return value


def _flag(config: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _int(config: Mapping[str, Any], key: str, default: int, where: str) -> int:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _number(config: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def _triple(
    config: Mapping[str, Any], key: str, default: tuple[float, float, float], where: str
) -> tuple[float, float, float]:
    """A per-channel statistic: three numbers, or one for all three channels."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * 3
    if (
        not isinstance(value, list)
        or len(value) != 3
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise ValueError(f"{where}: {key} must be three numbers (R, G, B), got {value!r}")
    return float(value[0]), float(value[1]), float(value[2])
