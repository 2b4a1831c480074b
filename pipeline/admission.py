"""Admission checks: can a request ever run on this engine? Pure functions of its size.

The scheduler calls them when a request arrives, and so does every front end before it
sends a request to an engine core in another process, so a client's mistake is answered
at once with the counts, never left waiting in a queue it can never leave.
"""

from __future__ import annotations


def check_prompt_fits(
    num_prompt_tokens: int, max_model_len: int, num_blocks: int, block_size: int
) -> None:
    if num_prompt_tokens == 0:
        raise ValueError("prompt: must contain at least one token")
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt: {num_prompt_tokens} tokens leave no room for output within max_model_len "
            f"{max_model_len} tokens; shorten the prompt"
        )
    if -(-(num_prompt_tokens + 1) // block_size) > num_blocks:
        raise ValueError(
            f"prompt: {num_prompt_tokens} tokens need more KV blocks than the whole cache has "
            f"({num_blocks} blocks of {block_size} tokens)"
        )


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """max_tokens, capped by what is left of the context (None: all of it)."""
    room = max_model_len - num_prompt_tokens
    return room if requested is None else min(requested, room)
