"""Admission checks: can a request ever run on this engine? Pure functions of its size.

The scheduler calls them when a request arrives, and so does every core client before it
sends a request on (pipeline/engine/core_client.py), so a client's mistake is answered at
once with the counts, never left waiting in a queue it can never leave.
"""

from __future__ import annotations

from ringllm.pipeline.errors import too_long_message


def check_request_fits(
    num_prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    max_request_tokens: int = 0,
) -> None:
    """Raises ValueError (with the counts) unless a request of this size can ever finish.

    `max_tokens` is already resolved against the context (see `resolve_max_tokens`).
    `max_request_tokens`: the tokens one request can hold in the whole cache, where that
    is not num_blocks * block_size (sliding-window layers: core/kv_groups.py); 0: it is.
    """
    n = num_prompt_tokens
    if n == 0:
        raise ValueError("prompt: must contain at least one token")
    if n >= max_model_len:
        raise ValueError(too_long_message("prompt", n, max_model_len))
    # NOTE: the whole life must fit, not just the prompt: a lone request that outgrows
    # the cache would preempt itself and wait for room that never comes. Its last
    # sampled token never enters the cache, hence the -1.
    max_len = min(n + max_tokens, max_model_len)
    blocks = -(-(max_len - 1) // block_size)
    held = f"{num_blocks} blocks of {block_size} tokens"
    if max_request_tokens:
        fits = blocks * block_size <= max_request_tokens
        held = f"it holds {max_request_tokens} tokens of one request: {held} over the layer groups"
    else:
        fits = blocks <= num_blocks
    if not fits:
        raise ValueError(
            f"prompt: {n} tokens plus up to {max_len - n} output tokens need more KV blocks "
            f"than the whole cache has ({held}); "
            f"shorten the prompt or lower max_tokens"
        )


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """max_tokens, capped by what is left of the context (None: all of it)."""
    room = max_model_len - num_prompt_tokens
    return room if requested is None else min(requested, room)


def check_admissible(request, info) -> None:
    """A core client's check of an `EngineCoreRequest` against the engine's `EngineInfo`."""
    max_tokens = resolve_max_tokens(
        request.sampling_params.max_tokens, request.num_prompt_tokens, info.max_model_len
    )
    check_request_fits(
        request.num_prompt_tokens,
        max_tokens,
        info.max_model_len,
        info.num_blocks,
        info.block_size,
        info.max_request_tokens,
    )
    if request.mm_inputs or info.takes_images:
        check_images(request, info)


def check_images(request, info) -> None:
    """Raises ValueError unless the request's images (`mm_inputs`) fit the engine's model:
    it takes images, each image fills `num_image_tokens` positions inside the prompt that
    all hold the image token, in order without overlap, with [3, S, S] float32 pixels, and
    no other prompt position holds the image token."""
    import numpy as np

    images = request.mm_inputs
    prompt = request.prompt_token_ids
    if not info.takes_images:
        if images:
            raise ValueError(f"images: the model {info.model_path.name} does not take images")
        return
    token, length, size = info.image_token_id, info.num_image_tokens, info.image_size
    ids = np.asarray(prompt, dtype=np.int64)
    placed = np.zeros(len(ids), dtype=bool)
    end = 0
    for i, image in enumerate(images):
        where = f"images[{i}]"
        if image.length != length:
            raise ValueError(f"{where}: fills {image.length} positions, the model's take {length}")
        if image.offset < end or image.end > len(ids):
            raise ValueError(
                f"{where}: positions [{image.offset}, {image.end}) are not inside the prompt "
                f"of {len(ids)} tokens after the image before it"
            )
        if not (ids[image.offset : image.end] == token).all():
            raise ValueError(
                f"{where}: positions [{image.offset}, {image.end}) must all hold "
                f"the image token {token}"
            )
        pixels = image.pixel_values
        if pixels is not None and (pixels.dtype != np.float32 or pixels.shape != (3, size, size)):
            raise ValueError(
                f"{where}: pixel values {pixels.dtype}{list(pixels.shape)}, the model takes "
                f"float32[3, {size}, {size}]"
            )
        placed[image.offset : image.end] = True
        end = image.end
    stray = int(np.count_nonzero((ids == token) & ~placed))
    if stray:
        raise ValueError(
            f"prompt: {stray} position(s) hold the image token {token} without an image; "
            f"each image fills {length} positions"
        )
