"""The multi-turn chat dataset: many conversations, their turns interleaved.

    conversation c:  opening_c | user_c0 | reply_c0 | user_c1 | reply_c1 | user_c2 ...
    turn t's prompt: opening_c + (user_ci + reply_ci for i < t) + user_ct
    request order:   c0 t0, c1 t0, ..., cN-1 t0, c0 t1, c1 t1, ...     (turn-major)

Each conversation opens with `prefix_len` tokens of its own (a system prompt and a pasted
document: no two conversations share any), and each turn adds a user message of
`user_len` tokens. The replies in the history are drawn in advance, as in a replayed chat
log: turn t asks for `output_len` tokens, but turn t + 1 carries the recorded reply, not
what the engine made. So the prefix turn t + 1 can find cached is turn t's prompt (its full
blocks), and every turn's prompt is the same in any run, whatever the engine generates.

The turn-major order is what makes the workload a test of the KV tiers: between two turns
of one conversation every other conversation's prompt passes through the KV cache, so once
the conversations' KV (`prefix_blocks`) exceeds the device cache, a turn finds its history
only in a tier behind it, or recomputes it. Sent with a concurrency under the number of
conversations (`bench serve --max-concurrency`; 1: one turn after the other), each turn
starts after its conversation's previous one has finished.

Prompts are token ids, drawn as `random`'s are (no special tokens). Request i is turn
i // num_conversations of conversation i % num_conversations.
"""

from __future__ import annotations

import numpy as np

from ringllm.tools.bench.datasets.request import (
    DatasetTokenizer,
    SampleRequest,
    check_positive,
    prompt_token_pool,
)


def multi_turn_prompt_len(prefix_len: int, user_len: int, output_len: int, turn: int) -> int:
    """Tokens of turn `turn`'s prompt (0-based): the opening, turn + 1 user messages and
    `turn` recorded replies."""
    return prefix_len + (turn + 1) * user_len + turn * output_len


def multi_turn_prefix_blocks(
    num_conversations: int,
    num_turns: int,
    prefix_len: int,
    user_len: int,
    output_len: int,
    block_size: int,
) -> int:
    """The full KV blocks the conversations' prompts leave in a prefix cache at the end:
    what a tier must hold for every turn to find its history."""
    last = multi_turn_prompt_len(prefix_len, user_len, output_len, num_turns - 1)
    return num_conversations * (last // block_size)


def multi_turn_token_ids(
    pool: np.ndarray,
    num_conversations: int,
    num_turns: int,
    prefix_len: int,
    user_len: int,
    output_len: int,
    seed: int,
) -> list[list[int]]:
    """The prompts' token ids in request order (turn-major), drawn from `pool`."""
    rng = np.random.default_rng(seed)
    by_conversation = []
    for _ in range(num_conversations):
        history = rng.choice(pool, size=prefix_len).tolist()
        prompts = []
        for turn in range(num_turns):
            if turn:
                history += rng.choice(pool, size=output_len).tolist()  # the recorded reply
            history += rng.choice(pool, size=user_len).tolist()
            prompts.append(list(history))
        by_conversation.append(prompts)
    return [by_conversation[c][t] for t in range(num_turns) for c in range(num_conversations)]


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
    conversations of `num_turns` turns (this module)."""
    for field, value, unit in (
        ("num_prompts", num_requests, "requests"),
        ("multi_turn_conversations", num_conversations, "conversations"),
        ("multi_turn_turns", num_turns, "turns"),
        ("multi_turn_prefix_len", prefix_len, "tokens"),
        ("multi_turn_user_len", user_len, "tokens"),
        ("output_len", output_len, "tokens"),
    ):
        check_positive(field, value, unit)
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
