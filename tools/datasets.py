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
                       re-encoded to the exact length (tools/datasets_mm.py). With 0 images:
                       the same kind of text prompt alone, the text-only side of a comparison
    multi-turn         `multi_turn_conversations` chats of `multi_turn_turns` turns each,
                       interleaved turn by turn; each turn's prompt is its conversation so
                       far (an opening of `multi_turn_prefix_len` tokens of its own, the
                       earlier user messages and recorded replies) plus a new user message
                       of `multi_turn_user_len` tokens; `output_len` tokens asked per turn
                       (tools/datasets_multi_turn.py: the KV tiers' workload)

Invariants: `prompt_len` is the number of tokens the engine will see (token-id prompts
are never re-tokenized; text prompts are measured with the same tokenizer the engine
uses), and every token id of a generated prompt is a non-special id inside the vocabulary.
A request with images counts in `prompt_len` the positions its images fill when the caller
says how many one image fills (`num_image_tokens`, from the model's config.json: the engine
expands each image to them); the chat template's own tokens are the server's to count.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ringllm.tools.datasets_mm import (
    ImageBucket,
    draw_sizes,
    parse_bucket_config,
    parse_image_size,
    random_png,
    random_text,
    text_token_pool,
)
from ringllm.tools.datasets_multi_turn import multi_turn_token_ids

logger = logging.getLogger(__name__)

DATASET_NAMES = (
    "random", "sharegpt", "prefix-repetition", "code-edit", "random-mm", "multi-turn",
)  # fmt: skip
DEFAULT_IMAGE_SIZE = "256x256"  # vLLM's first default bucket
# ShareGPT filtering as vLLM's benchmarks do it: drop tiny turns and very long ones.
SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048


class DatasetTokenizer(Protocol):
    """What a dataset needs from a tokenizer (ringllm's `Tokenizer` has all of it)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def all_special_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids the engine takes as they are
    prompt_len: int  # tokens (with the image positions, when known: see the module doc)
    expected_output_len: int  # tokens
    images: tuple[bytes, ...] = ()  # PNG files, sent with the prompt in this order


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
    _check_positive("num_prompts", args.num_prompts, "requests")
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
    _check_positive("num_prompts", num_requests, "requests")
    _check_positive("input_len", input_len, "tokens")
    _check_positive("output_len", output_len, "tokens")
    if isinstance(num_images, bool) or not isinstance(num_images, int) or num_images < 0:
        raise ValueError(f"random_mm_num_images: must be an int >= 0 images, got {num_images!r}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio: must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    pool = text_token_pool(tokenizer, prompt_token_pool(tokenizer))
    in_low, in_high = length_bounds(input_len, range_ratio)
    out_low, out_high = length_bounds(output_len, range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        text, text_len = random_text(tokenizer, pool, n_in, rng)
        sizes = draw_sizes(buckets, num_images, rng)
        images = tuple(random_png(width, height, rng) for width, height in sizes)
        prompt_len = text_len + num_images * num_image_tokens
        requests.append(SampleRequest(text, prompt_len, n_out, images))
    return requests


def multi_turn_requests(
    tokenizer: DatasetTokenizer,
    num_requests: int,
    num_conversations: int,
    num_turns: int,
    prefix_len: int,
    user_len: int,
    output_len: int,
    seed: int,
) -> list[SampleRequest]:
    """The first `num_requests` turns, in turn-major order, of `num_conversations`
    conversations of `num_turns` turns (tools/datasets_multi_turn.py)."""
    for field, value, unit in (
        ("num_prompts", num_requests, "requests"),
        ("multi_turn_conversations", num_conversations, "conversations"),
        ("multi_turn_turns", num_turns, "turns"),
        ("multi_turn_prefix_len", prefix_len, "tokens"),
        ("multi_turn_user_len", user_len, "tokens"),
        ("output_len", output_len, "tokens"),
    ):
        _check_positive(field, value, unit)
    if num_requests > num_conversations * num_turns:
        raise ValueError(
            f"num_prompts: {num_requests} requests, but {num_conversations} conversations x "
            f"{num_turns} turns make {num_conversations * num_turns}; raise "
            "--multi-turn-conversations or --multi-turn-turns"
        )
    pool = prompt_token_pool(tokenizer)
    prompts = multi_turn_token_ids(
        pool, num_conversations, num_turns, prefix_len, user_len, output_len, seed
    )
    return [SampleRequest(p, len(p), output_len) for p in prompts[:num_requests]]


CODE_EDIT_ASKS = (
    "The same code with type hints added to every function signature:",
    "The same code, unchanged except that each function gets a one-line docstring:",
    "The same code with every local variable name spelled in full:",
    "The same code, copied exactly:",
)


def code_edit_requests(
    tokenizer: DatasetTokenizer,
    num_requests: int,
    input_len: int,
    output_len: int,
    seed: int,
) -> list[SampleRequest]:
    """Text prompts: ```python <a stretch of a stdlib file of about input_len tokens> ```,
    then one of CODE_EDIT_ASKS and an opening fence the answer continues."""
    import sysconfig

    _check_positive("num_prompts", num_requests, "requests")
    _check_positive("input_len", input_len, "tokens")
    _check_positive("output_len", output_len, "tokens")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 4000)
    if not files:
        raise ValueError(f"dataset code-edit: no Python sources under {stdlib}")
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_requests):
        lines = files[int(rng.integers(len(files)))].read_text(errors="replace").splitlines()
        start = int(rng.integers(max(len(lines) - 40, 1)))
        snippet: list[str] = []
        for line in lines[start:]:
            snippet.append(line)
            if len(tokenizer.encode("\n".join(snippet), add_special_tokens=False)) >= input_len:
                break
        ask = CODE_EDIT_ASKS[int(rng.integers(len(CODE_EDIT_ASKS)))]
        prompt = "```python\n" + "\n".join(snippet) + "\n```\n\n" + ask + "\n```python\n"
        requests.append(SampleRequest(prompt, len(tokenizer.encode(prompt)), output_len))
    return requests


def prompt_token_pool(tokenizer: DatasetTokenizer) -> np.ndarray:
    """Every id of the vocabulary a random prompt may use: all but the special tokens.

    NOTE: special tokens (BOS, EOS, chat markers) would change what the model does
    (an early EOS in the prompt, a new turn), so benchmarks avoid them as vLLM does.
    """
    ids = np.arange(tokenizer.vocab_size, dtype=np.int64)
    special = np.fromiter(tokenizer.all_special_ids, dtype=np.int64)
    pool = ids[~np.isin(ids, special)]
    if pool.size == 0:
        raise ValueError(
            f"tokenizer: all {tokenizer.vocab_size} ids are special; no prompt tokens to draw"
        )
    return pool


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive [low, high] a length drawn with `range_ratio` falls in (low >= 1)."""
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def random_requests(
    tokenizer: DatasetTokenizer,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[SampleRequest]:
    _check_positive("num_prompts", num_requests, "requests")
    _check_positive("input_len", input_len, "tokens")
    _check_positive("output_len", output_len, "tokens")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio: must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    pool = prompt_token_pool(tokenizer)
    in_low, in_high = length_bounds(input_len, range_ratio)
    out_low, out_high = length_bounds(output_len, range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        prompt = rng.choice(pool, size=n_in).tolist()
        requests.append(SampleRequest(prompt, n_in, n_out))
    return requests


def prefix_repetition_requests(
    tokenizer: DatasetTokenizer,
    num_requests: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int,
) -> list[SampleRequest]:
    """Request i carries prefix i % num_prefixes; the order is then shuffled so requests
    that share a prefix arrive interleaved, as they would from real clients."""
    _check_positive("num_prompts", num_requests, "requests")
    _check_positive("prefix_len", prefix_len, "tokens")
    _check_positive("suffix_len", suffix_len, "tokens")
    _check_positive("output_len", output_len, "tokens")
    _check_positive("num_prefixes", num_prefixes, "prefixes")
    if num_prefixes > num_requests:
        raise ValueError(
            f"num_prefixes: {num_prefixes} prefixes need at least as many requests, "
            f"got num_prompts {num_requests}"
        )
    rng = np.random.default_rng(seed)
    pool = prompt_token_pool(tokenizer)
    prefixes = [rng.choice(pool, size=prefix_len).tolist() for _ in range(num_prefixes)]
    requests = []
    for i in range(num_requests):
        prompt = prefixes[i % num_prefixes] + rng.choice(pool, size=suffix_len).tolist()
        requests.append(SampleRequest(prompt, prefix_len + suffix_len, output_len))
    order = rng.permutation(num_requests)
    return [requests[i] for i in order.tolist()]


def sharegpt_requests(
    tokenizer: DatasetTokenizer,
    path: Path,
    num_requests: int,
    output_len: int | None,
    seed: int,
) -> list[SampleRequest]:
    """The first (human, reply) pair of each conversation, shuffled with `seed`.

    Pairs too short (< 4 tokens) or too long (prompt > 1024, prompt + reply > 2048 tokens)
    are dropped. With fewer usable pairs than `num_requests`, pairs repeat (drawn with
    `seed`), as vLLM's benchmarks oversample.
    """
    _check_positive("num_prompts", num_requests, "requests")
    if output_len is not None:
        _check_positive("output_len", output_len, "tokens")
    pairs = _sharegpt_pairs(path)
    rng = np.random.default_rng(seed)
    requests = []
    for index in rng.permutation(len(pairs)).tolist():
        prompt, reply = pairs[index]
        prompt_len = len(tokenizer.encode(prompt))
        reply_len = len(tokenizer.encode(reply, add_special_tokens=False))
        wanted = reply_len if output_len is None else output_len
        if prompt_len < SHAREGPT_MIN_TOKENS or (
            output_len is None and wanted < SHAREGPT_MIN_TOKENS
        ):
            continue
        if (
            prompt_len > SHAREGPT_MAX_PROMPT_TOKENS
            or prompt_len + wanted > SHAREGPT_MAX_TOTAL_TOKENS
        ):
            continue
        requests.append(SampleRequest(prompt, prompt_len, wanted))
        if len(requests) == num_requests:
            return requests
    if not requests:
        raise ValueError(
            f"dataset_path: {path} has no conversation with a usable (prompt, reply) pair "
            f"({SHAREGPT_MIN_TOKENS}..{SHAREGPT_MAX_PROMPT_TOKENS} prompt tokens)"
        )
    logger.warning(
        "%s: %d usable pairs for %d requests; repeating pairs", path, len(requests), num_requests
    )
    extra = rng.integers(0, len(requests), size=num_requests - len(requests))
    return requests + [requests[i] for i in extra.tolist()]


def _sharegpt_pairs(path: Path) -> list[tuple[str, str]]:
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"dataset_path: {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"dataset_path: {path} is not valid JSON ({e})") from None
    if not isinstance(data, list):
        raise ValueError(
            f"dataset_path: {path} must hold a JSON list of conversations, "
            f"got {type(data).__name__}"
        )
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, Sequence) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        prompt, reply = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(reply, str):
            pairs.append((prompt, reply))
    return pairs


def _check_positive(field: str, value: Any, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}: must be an int >= 1 {unit}, got {value!r}")
