"""Request datasets shared by every benchmark: what is sent, not how it is sent.

A dataset turns its command-line arguments and a tokenizer into a list of
`SampleRequest(prompt, prompt_len, expected_output_len)`. The same arguments and seed give
the same requests in any program that imports this module (`bench throughput`,
`bench latency`, the transformers peer script), so their numbers compare like for like.

    random             token-id prompts drawn uniformly from the vocabulary minus the
                       special tokens; lengths uniform in [len * (1 - r), len * (1 + r)]
    sharegpt           a ShareGPT-format JSON file: the first human turn is the prompt
                       (text), the first reply sets the output length
    prefix-repetition  `num_prefixes` random prefixes of `prefix_len` tokens, each request
                       one prefix plus its own `suffix_len` random tokens (prefix caching)
    code-edit          input-grounded text (speculative decoding): a piece of real Python
                       source (the standard library's own files, in a fixed order) of about
                       `input_len` tokens, then an ask to write it out again with a change,
                       so most of the answer quotes the prompt
    random-mm          random text of `input_len` tokens and `random_mm_num_images` random
                       RGB PNG images each (`--random-mm-image-size WxH`, or vLLM's
                       `--random-mm-bucket-config`); the text is decoded from random ids and
                       re-encoded to the exact length (images.py). With 0 images:
                       the same kind of text prompt alone, the text-only side of a comparison
    multi-turn         `multi_turn_conversations` chats of `multi_turn_turns` turns each,
                       interleaved turn by turn; each turn's prompt is its conversation so
                       far (an opening of `multi_turn_prefix_len` tokens of its own, the
                       earlier user messages and recorded replies) plus a new user message
                       of `multi_turn_user_len` tokens; `output_len` tokens asked per turn
                       (multi_turn.py: the KV tiers' workload)

Invariants: `prompt_len` is the number of tokens the engine will see (token-id prompts
are never re-tokenized; text prompts are measured with the same tokenizer the engine
uses), and every token id of a generated prompt is a non-special id inside the vocabulary.
A request with images counts in `prompt_len` the positions its images fill when the caller
says how many one image fills (`num_image_tokens`, from the model's config.json: the engine
expands each image to them); the chat template's own tokens are the server's to count.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ringllm.tools.bench.datasets.images import (
    DEFAULT_IMAGE_SIZE,
    image_buckets,
    random_mm_requests,
)
from ringllm.tools.bench.datasets.multi_turn import multi_turn_requests
from ringllm.tools.bench.datasets.request import DatasetTokenizer, SampleRequest, check_positive
from ringllm.tools.bench.datasets.text import (
    code_edit_requests,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)

DATASET_NAMES = (
    "random", "sharegpt", "prefix-repetition", "code-edit", "random-mm", "multi-turn",
)  # fmt: skip


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """The dataset flags (vLLM's spelling). The seed is the caller's `--seed`."""
    group = parser.add_argument_group("dataset")
    group.add_argument(
        "--dataset",
        "--dataset-name",
        dest="dataset",
        default="random",
        choices=DATASET_NAMES,
        help="which requests to send (default: random)",
    )
    group.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    group.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (sharegpt)")
    group.add_argument(
        "--input-len", "--random-input-len", dest="input_len", type=int, default=32,
        help="prompt tokens per request (random; random-mm: the text's)",
    )  # fmt: skip
    group.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=int,
        default=None,
        help="output tokens per request (default 64; sharegpt: the reply's)",
    )
    group.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        dest="range_ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1",
    )
    group.add_argument(
        "--prefix-len", type=int, default=256, help="prefix-repetition: shared prefix tokens"
    )
    group.add_argument(
        "--suffix-len",
        type=int,
        default=32,
        help="prefix-repetition: tokens after the prefix, per request",
    )
    group.add_argument(
        "--num-prefixes", type=int, default=4, help="prefix-repetition: distinct prefixes"
    )
    group.add_argument(
        "--random-mm-num-images", "--random-mm-base-items-per-request",
        dest="random_mm_num_images", type=int, default=1,
        help="random-mm: images per request (0: text only, for the comparison)",
    )  # fmt: skip
    group.add_argument(
        "--random-mm-image-size", default=DEFAULT_IMAGE_SIZE, metavar="WxH",
        help=f"random-mm: pixels of every image (default {DEFAULT_IMAGE_SIZE})",
    )  # fmt: skip
    group.add_argument(
        "--random-mm-bucket-config", default=None, metavar="DICT",
        help="random-mm, vLLM's spelling: '{(height, width, 1): probability, ...}', each "
        "image's size drawn from it (instead of --random-mm-image-size)",
    )  # fmt: skip
    group.add_argument(
        "--multi-turn-conversations", type=int, default=16,
        help="multi-turn: conversations, interleaved turn by turn (default 16)",
    )  # fmt: skip
    group.add_argument(
        "--multi-turn-turns", type=int, default=4, help="multi-turn: turns per conversation"
    )
    group.add_argument(
        "--multi-turn-prefix-len", type=int, default=1024,
        help="multi-turn: tokens each conversation opens with, its own (default 1024)",
    )  # fmt: skip
    group.add_argument(
        "--multi-turn-user-len", type=int, default=64,
        help="multi-turn: tokens of each user message (default 64)",
    )  # fmt: skip


def sample_requests(
    args: argparse.Namespace, tokenizer: DatasetTokenizer, seed: int, num_image_tokens: int = 0
) -> list[SampleRequest]:
    """The requests `args` describe (see `add_dataset_args`), drawn with `seed`;
    `num_image_tokens`: the positions one image fills (0: unknown, not counted)."""
    check_positive("num_prompts", args.num_prompts, "requests")
    output_len = args.output_len
    if args.dataset == "random":
        return random_requests(
            tokenizer, args.num_prompts, args.input_len,
            64 if output_len is None else output_len, args.range_ratio, seed,
        )  # fmt: skip
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("dataset_path: --dataset sharegpt needs --dataset-path FILE.json")
        return sharegpt_requests(
            tokenizer, Path(args.dataset_path), args.num_prompts, output_len, seed
        )
    if args.dataset == "prefix-repetition":
        return prefix_repetition_requests(
            tokenizer, args.num_prompts, args.prefix_len, args.suffix_len, args.num_prefixes,
            64 if output_len is None else output_len, seed,
        )  # fmt: skip
    if args.dataset == "code-edit":
        return code_edit_requests(
            tokenizer, args.num_prompts, args.input_len,
            64 if output_len is None else output_len, seed,
        )  # fmt: skip
    if args.dataset == "random-mm":
        return random_mm_requests(
            tokenizer, args.num_prompts, args.input_len,
            64 if output_len is None else output_len, args.range_ratio,
            args.random_mm_num_images, image_buckets(args), seed, num_image_tokens,
        )  # fmt: skip
    if args.dataset == "multi-turn":
        return multi_turn_requests(
            tokenizer, args.num_prompts, args.multi_turn_conversations, args.multi_turn_turns,
            args.multi_turn_prefix_len, args.multi_turn_user_len,
            64 if output_len is None else output_len, seed,
        )  # fmt: skip
    raise ValueError(f"dataset: {args.dataset!r} is not one of {DATASET_NAMES}")
