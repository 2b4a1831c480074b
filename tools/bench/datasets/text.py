"""The text datasets: `random` and `prefix-repetition` (token ids), `sharegpt` (a
ShareGPT-format JSON file) and `code-edit` (real Python source, then an ask to write it out
again with a change). See the package docstring for what each draws."""

from __future__ import annotations

import json
import logging
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ringllm.tools.bench.datasets.request import (
    DatasetTokenizer,
    SampleRequest,
    check_positive,
    draw_lengths,
    prompt_token_pool,
)

logger = logging.getLogger(__name__)

# ShareGPT filtering as vLLM's benchmarks do it: drop tiny turns and very long ones.
SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048


def random_requests(
    tokenizer: DatasetTokenizer,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[SampleRequest]:
    check_positive("num_prompts", num_requests, "requests")
    check_positive("input_len", input_len, "tokens")
    check_positive("output_len", output_len, "tokens")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio: must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    pool = prompt_token_pool(tokenizer)
    requests = []
    for n_in, n_out in draw_lengths(rng, num_requests, input_len, output_len, range_ratio):
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
    check_positive("num_prompts", num_requests, "requests")
    check_positive("prefix_len", prefix_len, "tokens")
    check_positive("suffix_len", suffix_len, "tokens")
    check_positive("output_len", output_len, "tokens")
    check_positive("num_prefixes", num_prefixes, "prefixes")
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
    check_positive("num_prompts", num_requests, "requests")
    if output_len is not None:
        check_positive("output_len", output_len, "tokens")
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
    check_positive("num_prompts", num_requests, "requests")
    check_positive("input_len", input_len, "tokens")
    check_positive("output_len", output_len, "tokens")
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
