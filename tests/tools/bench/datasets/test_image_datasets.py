"""The random-mm dataset (tools/bench/datasets/): seeded, exact in its
text lengths and image sizes, lossless in its pixels, and counted in prompt_len."""

from __future__ import annotations

import argparse
import io

import numpy as np
import pytest
from PIL import Image

from ringllm.pipeline.frontend.tokenizer import Tokenizer
from ringllm.tools.bench.datasets import add_dataset_args, sample_requests
from ringllm.tools.bench.datasets.images import (
    ImageBucket,
    parse_bucket_config,
    parse_image_size,
    random_mm_requests,
    random_png,
    random_text,
    sends_images,
    text_token_pool,
)
from ringllm.tools.bench.datasets.request import prompt_token_pool
from ringllm.tools.make_model import ModelShape, make_model

NUM_IMAGE_TOKENS = 16  # the tiny llava's


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = make_model(tmp_path_factory.mktemp("llava"), ModelShape(arch="llava"))
    return Tokenizer.from_folder(folder)


def dataset_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    return parser.parse_args(["--dataset", "random-mm", *argv])


def decoded(png: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG"
    return image


def test_same_seed_same_requests_other_seed_others(tokenizer):
    args = dataset_args("--num-prompts", "6", "--random-mm-image-size", "40x24")
    first = sample_requests(args, tokenizer, seed=3)
    again = sample_requests(args, tokenizer, seed=3)
    other = sample_requests(args, tokenizer, seed=4)
    assert first == again  # prompts, lengths and the PNG bytes themselves
    assert [r.prompt for r in first] != [r.prompt for r in other]
    assert [r.images for r in first] != [r.images for r in other]
    assert len({r.images[0] for r in first}) == 6  # every request its own image


def test_text_is_exactly_the_asked_tokens_and_prompt_len_counts_the_images(tokenizer):
    argv = ("--num-prompts", "40", "--random-input-len", "50", "--random-mm-num-images", "2")
    requests = sample_requests(dataset_args(*argv), tokenizer, 0, NUM_IMAGE_TOKENS)
    special = tokenizer.all_special_ids
    for r in requests:
        ids = tokenizer.encode(r.prompt, add_special_tokens=False)
        assert len(ids) == 50
        assert not special & set(ids)
        assert r.prompt_len == 50 + 2 * NUM_IMAGE_TOKENS
        assert len(r.images) == 2
    # unknown positions (0): the text alone is counted
    requests = sample_requests(dataset_args(*argv), tokenizer, 0)
    assert {r.prompt_len for r in requests} == {50}


def test_images_are_rgb_pngs_of_the_size_asked_and_their_pixels_survive(tokenizer):
    args = dataset_args("--num-prompts", "2", "--random-mm-image-size", "31x17")
    (png,) = sample_requests(args, tokenizer, 0)[0].images
    image = decoded(png)
    assert image.mode == "RGB" and image.size == (31, 17)
    pixels = np.asarray(image)
    redrawn = np.random.default_rng(9).integers(0, 256, size=(17, 31, 3), dtype=np.uint8)
    assert np.array_equal(
        np.asarray(decoded(random_png(31, 17, np.random.default_rng(9)))), redrawn
    )
    assert pixels.std() > 50  # noise over the whole range, not a flat image


def test_bucket_config_draws_each_size_by_its_probability(tokenizer):
    config = "{(16, 32, 1): 3, (8, 8, 1): 1, (64, 64, 1): 0}"
    args = dataset_args(
        "--num-prompts", "200", "--random-input-len", "4", "--random-mm-bucket-config", config
    )
    sizes = [decoded(r.images[0]).size for r in sample_requests(args, tokenizer, 0)]
    assert set(sizes) == {(32, 16), (8, 8)}  # (height, width) keys; the 0 bucket never
    assert 0.65 < sizes.count((32, 16)) / len(sizes) < 0.85  # 3 : 1, binomial sd ~0.03


def test_zero_images_is_the_text_only_side(tokenizer):
    args = dataset_args("--num-prompts", "3", "--random-mm-num-images", "0", "--input-len", "9")
    assert not sends_images(args)
    for r in sample_requests(args, tokenizer, 0, NUM_IMAGE_TOKENS):
        assert r.images == () and r.prompt_len == 9
    assert sends_images(dataset_args())  # default: one image


def test_lengths_vary_within_the_range_ratio(tokenizer):
    requests = random_mm_requests(
        tokenizer, 50, 20, 10, 0.5, 1, (ImageBucket(8, 8, 1.0),), 0, NUM_IMAGE_TOKENS
    )
    text_lens = {r.prompt_len - NUM_IMAGE_TOKENS for r in requests}
    assert len(text_lens) > 3 and min(text_lens) >= 10 and max(text_lens) <= 30
    assert all(5 <= r.expected_output_len <= 15 for r in requests)


def test_vllm_flag_spellings():
    args = dataset_args(
        "--random-input-len", "7", "--random-output-len", "5", "--random-range-ratio", "0.25",
        "--random-mm-base-items-per-request", "3",
    )  # fmt: skip
    assert (args.input_len, args.output_len, args.range_ratio) == (7, 5, 0.25)
    assert args.random_mm_num_images == 3


def test_text_pool_keeps_whole_characters_only(tokenizer):
    pool = text_token_pool(tokenizer, prompt_token_pool(tokenizer))
    assert 0 < len(pool) < len(prompt_token_pool(tokenizer))  # byte-level BPE has byte pieces
    text, count = random_text(tokenizer, pool, 0, np.random.default_rng(0))
    assert (text, count) == ("", 0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--random-mm-image-size", "224"), "random_mm_image_size"),
        (("--random-mm-image-size", "0x10"), "random_mm_image_size"),
        (("--random-mm-bucket-config", "{(8, 8): 1}"), "random_mm_bucket_config"),
        (("--random-mm-bucket-config", "{(8, 8, 4): 1}"), "frames"),
        (("--random-mm-bucket-config", "{(8, 8, 1): 0}"), "every probability is 0"),
        (("--random-mm-bucket-config", "not python"), "dict literal"),
        (("--random-mm-num-images", "-1"), "random_mm_num_images"),
    ],
)
def test_bad_flags_name_the_field(tokenizer, flags, message):
    with pytest.raises(ValueError, match=message):
        sample_requests(dataset_args(*flags), tokenizer, 0)


def test_size_parsers():
    assert parse_image_size(" 640 X 480 ") == (640, 480)
    buckets = parse_bucket_config("{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}")
    assert buckets == (ImageBucket(256, 256, 0.5), ImageBucket(1280, 720, 0.5))
