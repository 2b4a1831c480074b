"""The multi-turn dataset: its shape (turn-major order, each turn extending its
conversation's previous prompt, exact lengths, no shared openings, no special tokens),
determinism, flags, and through a real `ringllm serve` with a host tier behind a small
device cache: `bench serve --dataset multi-turn` makes the server find its turns' history
in the host tier (its /metrics say so)."""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from ringllm.pipeline.frontend.tokenizer import Tokenizer
from ringllm.tools.bench import commands as bench
from ringllm.tools.bench.datasets import add_dataset_args, sample_requests
from ringllm.tools.bench.datasets.multi_turn import (
    multi_turn_prefix_blocks,
    multi_turn_prompt_len,
    multi_turn_requests,
)

N, T, PREFIX, USER, OUT = 5, 3, 40, 12, 6


@pytest.fixture(scope="module")
def tiny_model(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_folder(tiny_model)


def chat(tokenizer, num_requests=N * T, seed=0):
    return multi_turn_requests(tokenizer, num_requests, N, T, PREFIX, USER, OUT, seed)


def test_turn_major_order_and_each_turn_extends_the_last(tokenizer):
    requests = chat(tokenizer)
    assert len(requests) == N * T
    for i, r in enumerate(requests):
        turn = i // N
        assert r.prompt_len == len(r.prompt) == multi_turn_prompt_len(PREFIX, USER, OUT, turn)
        assert r.prompt_len == PREFIX + (turn + 1) * USER + turn * OUT
        assert r.expected_output_len == OUT
        if turn:
            previous = requests[i - N].prompt  # the same conversation's previous turn
            assert r.prompt[: len(previous)] == previous
    openings = {tuple(r.prompt[:8]) for r in requests[:N]}
    assert len(openings) == N  # every conversation opens with tokens of its own


def test_no_special_tokens_and_inside_the_vocabulary(tokenizer):
    special = tokenizer.all_special_ids
    for r in chat(tokenizer):
        assert all(0 <= t < tokenizer.vocab_size and t not in special for t in r.prompt)


def test_deterministic_by_seed_and_truncated_in_order(tokenizer):
    assert chat(tokenizer, seed=3) == chat(tokenizer, seed=3)
    assert chat(tokenizer, seed=3) != chat(tokenizer, seed=4)
    assert chat(tokenizer, num_requests=7) == chat(tokenizer)[:7]


def test_prefix_blocks_count_what_the_last_turns_leave():
    last = multi_turn_prompt_len(PREFIX, USER, OUT, T - 1)  # 40 + 36 + 12 = 88
    assert multi_turn_prefix_blocks(N, T, PREFIX, USER, OUT, 16) == N * (last // 16) == 25


def test_flags_select_the_dataset(tokenizer):
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    args = parser.parse_args(
        ["--dataset", "multi-turn", "--num-prompts", str(N * T), "--output-len", str(OUT),
         "--multi-turn-conversations", str(N), "--multi-turn-turns", str(T),
         "--multi-turn-prefix-len", str(PREFIX), "--multi-turn-user-len", str(USER)]
    )  # fmt: skip
    assert sample_requests(args, tokenizer, seed=0) == chat(tokenizer)
    defaults = parser.parse_args(["--dataset", "multi-turn"])
    requests = sample_requests(defaults, tokenizer, seed=0)
    assert len(requests) == 16 * 4 == defaults.num_prompts  # 16 conversations of 4 turns
    assert requests[-1].prompt_len == 1024 + 4 * 64 + 3 * 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_requests": N * T + 1}, "num_prompts: 16 requests, but 5 conversations x 3"),
        ({"num_conversations": 0}, "multi_turn_conversations"),
        ({"num_turns": 0}, "multi_turn_turns"),
        ({"prefix_len": 0}, "multi_turn_prefix_len"),
        ({"user_len": -1}, "multi_turn_user_len"),
        ({"output_len": 0}, "output_len"),
    ],
)
def test_bad_values_name_their_field(tokenizer, change, message):
    values = {
        "num_requests": N * T, "num_conversations": N, "num_turns": T, "prefix_len": PREFIX,
        "user_len": USER, "output_len": OUT, "seed": 0,
    }  # fmt: skip
    with pytest.raises(ValueError, match=message):
        multi_turn_requests(tokenizer, **{**values, **change})


# ---- through a server ----------------------------------------------------------------

URL_LINE = re.compile(r"listening on (http://[\d.]+:\d+)")


@pytest.fixture(scope="module")
def tiered_server(tiny_model, tmp_path_factory):
    """`ringllm serve` with a host tier behind a 16-block device cache."""
    log_path = tmp_path_factory.mktemp("multi_turn") / "server.log"
    command = [
        sys.executable, "-m", "ringllm.server.cli", str(tiny_model), "--port", "0",
        "--dtype", "float32", "--max-model-len", "256", "--block-size", "16",
        "--num-gpu-blocks-override", "16", "--swap-space", "0.01",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        url = None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            match = URL_LINE.search(log_path.read_text(errors="replace"))
            url = match.group(1) if match else None
            time.sleep(0.1)
        assert url, log_path.read_text(errors="replace")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def metric(text: str, name: str, tier: str | None = None) -> float:
    """The sum of a /metrics counter's samples (of one tier's label, when given)."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"ringllm:{name}(?:_total)?(\{{[^}}]*\}})? (\S+)$", line)
        if match and (tier is None or f'tier="{tier}"' in (match.group(1) or "")):
            total += float(match.group(2))
    return total


def test_bench_serve_sends_it_and_the_server_hits_the_host_tier(
    tiered_server, tiny_model, tmp_path
):
    parser = argparse.ArgumentParser(prog="ringllm")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "serve.json"
    args = parser.parse_args(
        ["bench", "serve", "--disable-tqdm", "--base-url", tiered_server,
         "--tokenizer", str(tiny_model), "--dataset", "multi-turn", "--num-prompts", str(N * T),
         "--multi-turn-conversations", str(N), "--multi-turn-turns", str(T),
         "--multi-turn-prefix-len", str(PREFIX), "--multi-turn-user-len", str(USER),
         "--output-len", str(OUT), "--ignore-eos", "--max-concurrency", "1",
         "--result-json", str(out)]
    )  # fmt: skip
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == N * T and result["failed"] == 0
    assert result["input_lens"] == [r.prompt_len for r in chat(Tokenizer.from_folder(tiny_model))]
    with urllib.request.urlopen(tiered_server + "/metrics", timeout=10) as response:
        text = response.read().decode()
    # 5 conversations of ~5 blocks each outgrow 16 device blocks: later turns find their
    # history in the host tier
    assert metric(text, "kv_tier_hits", "host") > 0
    assert metric(text, "prefix_cache_hits") > 0
