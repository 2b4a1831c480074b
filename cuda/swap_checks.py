"""The argument checks of `swap_blocks` (KV-cache blocks between a device cache and a host
or disk tier), shared by every implementation so that all refuse the same calls with the
same words: `CudaOps` (cuda/ops.py), whose kernel then trusts the block ids blindly, and
`TorchOps` / `CpuOps` (pipeline/ops/).

NOTE: this module imports torch and the standard library only, never CuPy: the torch
reference ops import it on machines without CuPy or a GPU (cuda/__init__.py is empty, so
importing this submodule pulls nothing else in).
"""

from __future__ import annotations

import torch


def check_swap_blocks(src_caches, dst_caches, block_mapping) -> torch.Tensor:
    """Refuses a swap_blocks call that cannot be copied (ValueError, naming what is wrong);
    returns block_mapping as a contiguous CPU int64 [N, 2], whose ids a kernel may then use
    blindly. Devices are not checked: where each side may be is up to the implementation
    (CudaOps checks its own in CudaOps._swap_device)."""
    if len(src_caches) != len(dst_caches):
        raise ValueError(
            f"swap_blocks: {len(src_caches)} layers in src_caches, {len(dst_caches)} in dst_caches"
        )
    if not src_caches:
        return _swap_mapping(block_mapping, None, None)
    src_blocks, first = _check_swap_side("src_caches", src_caches, None)
    dst_blocks, _ = _check_swap_side("dst_caches", dst_caches, first)
    src_memory = {_memory(c) for pair in src_caches for c in pair if c.numel()}
    if any(_memory(c) in src_memory for pair in dst_caches for c in pair if c.numel()):
        raise ValueError(
            "swap_blocks: a cache is in both src_caches and dst_caches; copy_blocks copies "
            "blocks within one cache"
        )
    return _swap_mapping(block_mapping, src_blocks, dst_blocks)


def _check_swap_side(side: str, caches, first: torch.Tensor | None) -> tuple[int, torch.Tensor]:
    """Every cache of one side: contiguous, 4-D, the dtype and per-block shape of `first`
    (src_caches[0]'s keys; None: this is that side), and the number of blocks of the side's
    first cache. Returns (that number, first)."""
    num_blocks = None
    for layer, pair in enumerate(caches):
        if len(pair) != 2:
            raise ValueError(
                f"swap_blocks: {side}[{layer}] must be a (key_cache, value_cache) pair, "
                f"got {len(pair)} tensors"
            )
        first = pair[0] if first is None else first
        for name, cache in zip(("key", "value"), pair, strict=True):
            where = f"swap_blocks: {side}[{layer}] {name} cache"
            if cache.dim() != 4 or cache.dtype != first.dtype or cache.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"{where} is {cache.dtype} {tuple(cache.shape)}; every cache must be "
                    f"{first.dtype} [num_blocks, {', '.join(map(str, first.shape[1:]))}] "
                    "like src_caches[0]'s keys"
                )
            if not cache.is_contiguous():
                raise ValueError(f"{where} is not contiguous; KV caches are dense tensors")
            num_blocks = cache.shape[0] if num_blocks is None else num_blocks
            if cache.shape[0] != num_blocks:
                raise ValueError(
                    f"{where} has {cache.shape[0]} blocks, {side}[0] keys {num_blocks}; the "
                    "caches of one side have one number of blocks"
                )
    return num_blocks, first


def _memory(cache: torch.Tensor) -> tuple[str, int]:
    return str(cache.device), cache.untyped_storage().data_ptr()


def _swap_mapping(block_mapping, src_blocks: int | None, dst_blocks: int | None) -> torch.Tensor:
    """block_mapping checked: int64 [N, 2], ids inside each side's blocks (None: no caches,
    nothing to check them against), no dst twice."""
    if (
        not isinstance(block_mapping, torch.Tensor)
        or block_mapping.dtype != torch.int64
        or block_mapping.dim() != 2
        or block_mapping.shape[1] != 2
    ):
        got = (
            f"{block_mapping.dtype} {tuple(block_mapping.shape)}"
            if isinstance(block_mapping, torch.Tensor)
            else type(block_mapping).__name__
        )
        raise ValueError(f"swap_blocks: block_mapping must be an int64 [N, 2] tensor, got {got}")
    mapping = block_mapping.cpu().contiguous()
    if mapping.shape[0] == 0:
        return mapping
    for column, side, num_blocks in ((0, "src", src_blocks), (1, "dst", dst_blocks)):
        if num_blocks is None:
            continue
        ids = mapping[:, column]
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= num_blocks:
            raise ValueError(
                f"swap_blocks: {side} block ids {low}..{high} outside the {side} caches' "
                f"{num_blocks} blocks (0..{num_blocks - 1})"
            )
    dst_ids, counts = mapping[:, 1].unique(return_counts=True)
    if int(counts.max()) > 1:
        repeated = dst_ids[counts > 1].tolist()
        raise ValueError(
            f"swap_blocks: dst blocks {repeated[:8]} appear more than once in block_mapping; "
            "each destination block takes one source"
        )
    return mapping
