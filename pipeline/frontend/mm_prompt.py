"""Images in prompts, for a model that takes them: where a prompt's images come from, how
many it may hold, and the prompt expanded to the positions the model fills with features.

    chat image parts / multi_modal_data["image"] -> ImageSource (the item, its field)
    tokenized prompt:  t t <image> t t t <image> t          one image token per image
    expanded:          t t <image> x num_image_tokens t t t <image> x num_image_tokens t
    each image, on the media pool: load (image_inputs.py, within the MediaPolicy)
        -> preprocess (image_processor.py) -> ImageInput(offset, num_image_tokens, pixels)

A prompt may also arrive expanded already (token ids a RequestOutput showed): exactly
num_image_tokens consecutive image tokens per image are then taken as they are.

Invariants: the image count is checked against the limit before any image is read, and
the token count and the expanded prompt's fit before any is fetched or decoded; every
refusal is a ValueError naming the field (`messages[i].content[j].image_url`,
`multi_modal_data.image[k]`, `prompt`); images are read, decoded and preprocessed only on
the front end's media pool (`media_loading_threads` threads), never on an event loop;
the images being decoded and preprocessed at once hold at most max_pixels pixels together
(`PixelBudget`; one image may always run), so the pool's memory has a bound however many
threads it has, and the heap is handed back to the system after a large one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from ringllm.pipeline.child_process import give_back_free_heap
from ringllm.pipeline.config import MultiModalConfig
from ringllm.pipeline.errors import too_long_message
from ringllm.pipeline.frontend.image_inputs import (
    MediaPolicy,
    image_from_content_part,
    load_pixels,
)
from ringllm.pipeline.frontend.image_processor import ImageProcessor
from ringllm.pipeline.messages import EngineInfo, ImageInput

LIMIT_FLAG = "--limit-mm-per-prompt"
MM_DATA_FIELD = "multi_modal_data"
# Prefixes the image modules start their messages with; the field path replaces them.
_MESSAGE_PREFIXES = ("image_url: ", "image: ")
# An image this large (pixels) is followed by a trim of the heap: its decode and RGB copies
# were freed into the media thread's malloc arena, which otherwise keeps them (4 threads
# kept 580 MiB after 5,792 x 5,792 PNGs; 130 MiB with the trim).
_TRIM_PIXELS = 1 << 22


class PixelBudget:
    """Pixels of the images being decoded and preprocessed at once: `hold(n)` waits until
    n more fit in `capacity` (or nothing else is held, so one image of any size runs)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self.held == 0 or self.held + pixels <= self.capacity)
            self.held += pixels
        try:
            yield
        finally:
            with self._cond:
                self.held -= pixels
                self._cond.notify_all()


@dataclass(frozen=True)
class ImageTokens:
    """How a model's prompts hold an image: the token, its text, the positions it fills."""

    token_id: int
    text: str  # what a chat template or a prompt writes for one image ("<image>")
    num_tokens: int  # positions one image fills once expanded


@dataclass(frozen=True)
class ImageSource:
    """One image of a request before it is read: an image_url part or a PIL image."""

    item: Mapping[str, Any] | Image.Image
    where: str  # the field that named it, for errors


def media_policy(config: MultiModalConfig) -> MediaPolicy:
    """Where images may come from and how big they may be, from the server's flags."""
    domains = config.media_domains()
    return MediaPolicy(
        allowed_local_media_path=config.allowed_local_media_path,
        allow_http=domains is not None,
        allowed_domains=domains or (),
        max_bytes=config.max_media_bytes,
        max_pixels=config.max_image_pixels,
        fetch_timeout_s=config.media_fetch_timeout_s,
    )


def sources_of_mm_data(mm_data: Any) -> list[ImageSource]:
    """An offline prompt's `multi_modal_data` ({"image": a PIL image or a list}) -> sources."""
    if not isinstance(mm_data, Mapping):
        raise ValueError(
            f"{MM_DATA_FIELD}: must be a dict such as {{'image': <PIL image or list>}}, got "
            f"{type(mm_data).__name__}"
        )
    unknown = sorted(str(key) for key in mm_data if key != "image")
    if unknown:
        raise ValueError(f"{MM_DATA_FIELD}: unknown modality {unknown}; this engine takes 'image'")
    images = mm_data.get("image")
    if images is None:
        return []
    if isinstance(images, Image.Image):
        images = [images]
    if not isinstance(images, Sequence) or isinstance(images, str | bytes):
        raise ValueError(
            f"{MM_DATA_FIELD}.image: must be a PIL image or a list of them, got "
            f"{type(images).__name__}"
        )
    sources = []
    for index, image in enumerate(images):
        where = f"{MM_DATA_FIELD}.image[{index}]"
        if not isinstance(image, Image.Image):
            raise ValueError(f"{where}: expected a PIL image, got {type(image).__name__}")
        sources.append(ImageSource(image, where))
    return sources


def place_images(
    token_ids: Sequence[int], tokens: ImageTokens, num_images: int, field: str
) -> tuple[list[int], list[int]]:
    """(the expanded token ids, each image's first position in them).

    The prompt holds one image token per image (each becomes num_tokens of them), or is
    expanded already (num_tokens consecutive ones per image); anything else is refused
    with both counts."""
    ids = np.asarray(token_ids, dtype=np.int64)
    positions = np.flatnonzero(ids == tokens.token_id)
    if len(positions) == num_images:
        # image i's placeholder moves right by (num_tokens - 1) for each image before it
        offsets = positions + np.arange(num_images) * (tokens.num_tokens - 1)
        counts = np.where(ids == tokens.token_id, tokens.num_tokens, 1)
        return np.repeat(ids, counts).tolist(), offsets.tolist()
    if len(positions) == num_images * tokens.num_tokens and _runs_of(positions, tokens.num_tokens):
        return list(token_ids), positions[:: tokens.num_tokens].tolist()
    raise ValueError(
        f"{field}: holds {len(positions)} image token(s) ({tokens.text!r}) for {num_images} "
        f"image(s); put one {tokens.text} where each image goes"
    )


def _runs_of(positions: np.ndarray, length: int) -> bool:
    """Whether sorted `positions` are runs of `length` consecutive ones."""
    runs = positions.reshape(-1, length)
    return bool((runs - runs[:, :1] == np.arange(length)).all())


class PromptImages:
    """The image side of one front end's prompts (a model that takes images): the limit,
    the media policy, the model's preprocessor and the media pool that runs them."""

    def __init__(
        self,
        tokens: ImageTokens,
        processor: ImageProcessor,
        config: MultiModalConfig,
        max_model_len: int,
    ) -> None:
        self.tokens = tokens
        self.processor = processor
        self.policy = media_policy(config)
        self.limit = config.limit("image")
        self.max_model_len = max_model_len
        # NOTE: threads start on first use; a fetch waits at most media_fetch_timeout_s
        self._pool = ThreadPoolExecutor(
            config.media_loading_threads, thread_name_prefix="ringllm-media"
        )
        self.pixels = PixelBudget(self.policy.max_pixels)

    @classmethod
    def for_model(cls, info: EngineInfo, tokenizer, config: MultiModalConfig, model_dir):
        """The front end's PromptImages, or None for a text-only model."""
        if not info.takes_images:
            return None
        (text,) = tokenizer.convert_ids_to_tokens([info.image_token_id])
        if text is None:
            raise ValueError(
                f"image_token_id: {info.image_token_id} is not a token of the tokenizer "
                f"({tokenizer.vocab_size} tokens)"
            )
        processor = ImageProcessor.from_folder(model_dir)
        size = getattr(info, "image_size", 0)
        if size and processor.output_hw != (size, size):
            raise ValueError(
                f"preprocessor_config.json: makes {processor.output_hw} pixel images, the "
                f"model's vision tower takes {size}x{size}"
            )
        tokens = ImageTokens(info.image_token_id, text, info.num_image_tokens)
        return cls(tokens, processor, config, info.max_model_len)

    def check_count(self, num_images: int, field: str) -> None:
        if num_images > self.limit:
            raise ValueError(
                f"{field}: {num_images} images; at most {self.limit} per prompt ({LIMIT_FLAG})"
            )

    def place(
        self, token_ids: Sequence[int], num_images: int, field: str
    ) -> tuple[list[int], list[int]]:
        """`place_images`, and the expanded prompt must leave room for output."""
        ids, offsets = place_images(token_ids, self.tokens, num_images, field)
        if num_images and len(ids) >= self.max_model_len:
            raise ValueError(too_long_message(field, len(ids), self.max_model_len))
        return ids, offsets

    def load(
        self, sources: Sequence[ImageSource], offsets: Sequence[int]
    ) -> tuple[ImageInput, ...]:
        """Every image read, decoded and preprocessed on the media pool, in parallel; the
        first failure (in prompt order) is raised and the images not started are dropped."""
        futures = [
            self._pool.submit(self._load_one, source, offset)
            for source, offset in zip(sources, offsets, strict=True)
        ]
        try:
            return tuple(future.result() for future in futures)
        finally:
            for future in futures:
                future.cancel()

    def _load_one(self, source: ImageSource, offset: int) -> ImageInput:
        """Read and size-checked first (bytes only); decoded and made small within the
        pixel budget."""
        try:
            image = image_from_content_part(source.item, self.policy, load=False)
        except ValueError as exc:
            raise ValueError(_named(exc, source.where)) from None
        num_pixels = image.width * image.height
        try:
            with self.pixels.hold(num_pixels):
                pixels = self._decode(image, source.where)
                del image  # the full-size image, before the budget lets the next one in
        finally:
            if num_pixels >= _TRIM_PIXELS:
                give_back_free_heap()
        return ImageInput.from_pixels(offset, self.tokens.num_tokens, pixels)

    def _decode(self, image: Image.Image, where: str) -> np.ndarray:
        try:
            image = load_pixels(image)
        except ValueError as exc:
            raise ValueError(_named(exc, where)) from None
        try:
            return self.processor.preprocess(image)
        except Exception as exc:  # untrusted pixels: a mode or size Pillow trips on
            detail = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            raise ValueError(_named(detail, where)) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _named(exc: Exception | str, where: str) -> str:
    """An image module's message with the request's field path in front of it."""
    message = str(exc)
    for prefix in _MESSAGE_PREFIXES:
        if message.startswith(prefix):
            message = message[len(prefix) :]
            break
    return f"{where}: {message}"
