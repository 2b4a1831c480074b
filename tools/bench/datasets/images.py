"""The parts of the `random-mm` dataset that are not about requests: random images, their
sizes as the flags spell them, and random text of an exact token count.

    image:  uint8 RGB noise [height, width, 3] from the dataset's generator, PNG-encoded
            (lossless, so the pixels the server decodes are the ones drawn; noise is the
            worst case for PNG's size, ~3 bytes a pixel)
    sizes:  --random-mm-image-size WxH (one size), or vLLM's --random-mm-bucket-config
            '{(height, width, 1): probability, ...}' (each image's size drawn from it)
    text:   random ids decoded to text and encoded again until the text is exactly the
            asked number of tokens (vLLM's way): a text prompt is re-tokenized by the
            server, so ids alone would not say its length
"""

from __future__ import annotations

import argparse
import ast
import io
import re
from dataclasses import dataclass

import numpy as np

from ringllm.tools.bench.datasets.request import (
    DatasetTokenizer,
    SampleRequest,
    check_positive,
    draw_lengths,
    prompt_token_pool,
)

DEFAULT_IMAGE_SIZE = "256x256"  # vLLM's first default bucket
MAX_TEXT_TRIES = 10
_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


@dataclass(frozen=True)
class ImageBucket:
    width: int  # pixels
    height: int  # pixels
    probability: float


def parse_image_size(text: str) -> tuple[int, int]:
    """'224x224' -> (width, height), each >= 1 pixel."""
    match = _SIZE.match(text)
    if match is None or min(int(match.group(1)), int(match.group(2))) < 1:
        raise ValueError(
            f"random_mm_image_size: {text!r} is not WIDTHxHEIGHT in pixels (e.g. 224x224)"
        )
    return int(match.group(1)), int(match.group(2))


def parse_bucket_config(text: str) -> tuple[ImageBucket, ...]:
    """vLLM's bucket config: a dict literal {(height, width, num_frames): probability};
    num_frames must be 1 (images; more would be a video). Probabilities are normalized,
    zero ones dropped."""
    field = "random_mm_bucket_config"
    try:
        raw = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(
            f"{field}: {text!r} is not a dict literal such as '{{(256, 256, 1): 1.0}}'"
        ) from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{field}: must be a non-empty dict {{(height, width, 1): p}}")
    buckets = []
    for key, p in raw.items():
        ok = isinstance(key, tuple) and len(key) == 3 and all(isinstance(k, int) for k in key)
        if not ok or min(key[:2]) < 1:
            raise ValueError(f"{field}: key {key!r} is not (height, width, num_frames) in pixels")
        if key[2] != 1:
            raise ValueError(f"{field}: key {key!r} has {key[2]} frames; only images (1) are sent")
        if not isinstance(p, int | float) or isinstance(p, bool) or p < 0:
            raise ValueError(f"{field}: probability of {key!r} must be a number >= 0, got {p!r}")
        if p > 0:
            buckets.append(ImageBucket(width=key[1], height=key[0], probability=float(p)))
    total = sum(b.probability for b in buckets)
    if total == 0:
        raise ValueError(f"{field}: every probability is 0")
    return tuple(ImageBucket(b.width, b.height, b.probability / total) for b in buckets)


def draw_sizes(
    buckets: tuple[ImageBucket, ...], count: int, rng: np.random.Generator
) -> list[tuple[int, int]]:
    """`count` (width, height) pairs from the buckets (one bucket: no draw at all)."""
    if len(buckets) == 1:
        return [(buckets[0].width, buckets[0].height)] * count
    picks = rng.choice(len(buckets), size=count, p=[b.probability for b in buckets])
    return [(buckets[i].width, buckets[i].height) for i in picks.tolist()]


def random_png(width: int, height: int, rng: np.random.Generator) -> bytes:
    """An RGB noise image, PNG-encoded."""
    from PIL import Image

    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def text_token_pool(tokenizer, pool: np.ndarray) -> np.ndarray:
    """The ids of `pool` that decode alone to whole characters: byte pieces of a
    character would decode, next to other pieces, to U+FFFD, which encodes to other
    tokens than were drawn."""
    whole = [i for i in pool.tolist() if "\ufffd" not in tokenizer.decode([i])]
    return np.asarray(whole or pool.tolist(), dtype=np.int64)


def random_text(
    tokenizer, pool: np.ndarray, num_tokens: int, rng: np.random.Generator
) -> tuple[str, int]:
    """(text, its token count): random ids from `pool` (`text_token_pool`'s) made into a text that encodes to
    `num_tokens` tokens (no special tokens added). Decoding then encoding may merge or
    split tokens, so the ids are topped up or cut and tried again; after MAX_TEXT_TRIES
    the count is what the text really has."""
    ids = rng.choice(pool, size=num_tokens).tolist()
    for _ in range(MAX_TEXT_TRIES):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == num_tokens:
            return text, num_tokens
        if len(ids) < num_tokens:
            ids += rng.choice(pool, size=num_tokens - len(ids)).tolist()
        else:
            ids = ids[:num_tokens]
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def image_buckets(args: argparse.Namespace) -> tuple[ImageBucket, ...]:
    """The image sizes the flags ask for: the bucket config when given, else the one size."""
    if getattr(args, "random_mm_bucket_config", None):
        return parse_bucket_config(args.random_mm_bucket_config)
    width, height = parse_image_size(getattr(args, "random_mm_image_size", DEFAULT_IMAGE_SIZE))
    return (ImageBucket(width, height, 1.0),)


def sends_images(args: argparse.Namespace) -> bool:
    """Whether the requests the flags describe carry images."""
    return args.dataset == "random-mm" and args.random_mm_num_images > 0


def random_mm_requests(
    tokenizer: DatasetTokenizer,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    num_images: int,
    buckets: tuple[ImageBucket, ...],
    seed: int,
    num_image_tokens: int = 0,
) -> list[SampleRequest]:
    """Text prompts of about `input_len` tokens (uniform in the range, as random's) with
    `num_images` random PNG images each; prompt_len = the text's tokens + num_images x
    num_image_tokens."""
    check_positive("num_prompts", num_requests, "requests")
    check_positive("input_len", input_len, "tokens")
    check_positive("output_len", output_len, "tokens")
    if isinstance(num_images, bool) or not isinstance(num_images, int) or num_images < 0:
        raise ValueError(f"random_mm_num_images: must be an int >= 0 images, got {num_images!r}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio: must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    pool = text_token_pool(tokenizer, prompt_token_pool(tokenizer))
    requests = []
    for n_in, n_out in draw_lengths(rng, num_requests, input_len, output_len, range_ratio):
        text, text_len = random_text(tokenizer, pool, n_in, rng)
        sizes = draw_sizes(buckets, num_images, rng)
        images = tuple(random_png(width, height, rng) for width, height in sizes)
        prompt_len = text_len + num_images * num_image_tokens
        requests.append(SampleRequest(text, prompt_len, n_out, images))
    return requests
