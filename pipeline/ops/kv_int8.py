"""The int8 KV cache (`--kv-cache-dtype int8`): 8-bit keys and values, one float32 scale
per (block, KV head).

Layout. A cache tensor is [num_blocks, kv_heads, block_size, head_size] int8, and its
scales follow its elements in the same allocation, float32 [num_blocks, kv_heads]:

    | blk 0: head 0's rows | head 1's rows | ... | blk N-1 ... || scales [N, Hk] float32 |
    '------------------- the cache tensor (int8) -------------''--- kv_scales(cache) ---'

so everything that hands a cache around (the model's layers, the decode plan, the ops)
carries its scales with it, and a block id still names everything a block holds. What
moves blocks (swap_blocks, copy_blocks) moves their scales too. The scales cost 4 bytes
per block_size * head_size values: 0.4% at 16-token blocks of head size 64.

The write rule (the C kernels, the CUDA kernels and `write_rows` below all follow it). A
value is q * scale[block, head] with q in -127..127. Writing token row x (head_size values,
in float32) at row r of a block, for one head:

    s = max|x| / 127
    r == 0            scale = s           (a block's first row starts it afresh)
    r > 0 and s > scale                   rows 0..r-1 are re-rounded to the larger scale:
                      q = rint(q * (scale / s)) (the ratio in float32), then scale = s
    q(x) = clamp(rint(x / scale), -127, 127); 0 where scale is 0

NOTE: why this is safe without atomics or a second pass: a block's rows are written by
one sequence, in order (rows 0..r-1 before row r; a block is only shared once full, and a
full block is never written again), and each implementation writes one block's rows in
token order. A re-rounded row carries at most half a step of the larger scale more error;
a block's scale only grows, so it is re-rounded a few times at most, early in the block.
Rejected speculative tokens may have grown a scale: that costs precision, never
correctness. A prompt's rows all go in by one call, so its blocks are quantized as a whole
would be, row by row.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 per (block, KV head)
QMAX = 127


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype is torch.int8


def block_bytes(kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block of one cache tensor, its scales included for int8."""
    if dtype is torch.int8:
        return kv_heads * (block_size * head_dim + SCALE_BYTES)
    return kv_heads * block_size * head_dim * dtype.itemsize


def new_cache(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    zero: bool = True,
    pin_memory: bool = False,
) -> torch.Tensor:
    """One cache tensor of `shape` [num_blocks, kv_heads, block_size, head_size]; int8
    ones with their scales behind them (this module's layout), zeroed when `zero`."""
    make = torch.zeros if zero else torch.empty
    if dtype is not torch.int8:
        return make(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    num_blocks, kv_heads, block_size, head_dim = shape
    if head_dim % SCALE_BYTES:
        raise ValueError(
            f"kv_cache_dtype int8: head_size {head_dim} is not a multiple of 4 "
            "(the scales that follow the values must be float32-aligned)"
        )
    elements = num_blocks * kv_heads * block_size * head_dim
    buffer = make(
        elements + SCALE_BYTES * num_blocks * kv_heads,
        dtype=torch.int8,
        device=device,
        pin_memory=pin_memory,
    )
    return buffer[:elements].view(shape)


def kv_scales(cache: torch.Tensor) -> torch.Tensor:
    """The float32 [num_blocks, kv_heads] scales of an int8 cache made by `new_cache` (a
    view: writing it writes the cache's scales)."""
    num_blocks, kv_heads = cache.shape[0], cache.shape[1]
    storage = cache.untyped_storage()
    if (
        cache.dtype is not torch.int8
        or cache.dim() != 4
        or cache.storage_offset() != 0
        or not cache.is_contiguous()
        or storage.nbytes() != cache.numel() + SCALE_BYTES * num_blocks * kv_heads
    ):
        raise ValueError(
            f"kv_scales: a {cache.dtype} cache of shape {tuple(cache.shape)} is not an int8 "
            "KV cache made by kv_int8.new_cache (its scales must follow its values)"
        )
    scales = torch.empty(0, dtype=torch.float32, device=cache.device)
    return scales.set_(storage, cache.numel() // SCALE_BYTES, (num_blocks, kv_heads))


def has_scales(cache: torch.Tensor) -> bool:
    """Whether `cache` is an int8 cache with its scales behind it (what a C or CUDA kernel
    must check before it reads past the values)."""
    try:
        kv_scales(cache)
    except ValueError:
        return False
    return True


def scales_ptr(cache: torch.Tensor) -> int:
    """The address of an int8 cache's scales (the C and CUDA kernels take it); 0 for other
    caches."""
    return cache.data_ptr() + cache.numel() if cache.dtype is torch.int8 else 0


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """The reference write: rows [T, kv_heads, head_size] (any float dtype) into an int8
    cache at slots [T] (-1: skipped), token by token, by the rule above."""
    block_size = cache.shape[2]
    scales = kv_scales(cache)
    x_all = rows.float()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, block_size)
        x = x_all[t]  # [Hk, D]
        wanted = x.abs().amax(dim=-1) / QMAX  # [Hk]
        if row == 0:
            scale = wanted
        else:
            old = scales[block]
            grow = wanted > old
            scale = torch.where(grow, wanted, old)
            if bool(grow.any()):
                ratio = torch.where(grow, old / scale, torch.ones_like(old))
                earlier = cache[block, :, :row].float() * ratio[:, None, None]
                cache[block, :, :row] = torch.round(earlier).to(torch.int8)
        scales[block] = scale
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(x / safe[:, None]).clamp_(-QMAX, QMAX)
        cache[block, :, row] = torch.where(scale[:, None] > 0, q, torch.zeros_like(q)).to(
            torch.int8
        )


def dequantize_blocks(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype):
    """cache[index] as `dtype` values (index: block ids of any shape): the int8 rows times
    their block's scale, in float32 then rounded to `dtype`."""
    scales = kv_scales(cache)[index]  # [..., Hk]
    return (cache[index].float() * scales[..., None, None]).to(dtype)


def copy_block_scales(src: torch.Tensor, dst: torch.Tensor, src_ids, dst_ids) -> None:
    """dst's scales of blocks dst_ids = src's of src_ids (int8 caches; block copies)."""
    dst_scales = kv_scales(dst)
    moved = kv_scales(src).index_select(0, src_ids.to(src.device))
    dst_scales.index_copy_(0, dst_ids.to(dst.device), moved.to(dst.device))
