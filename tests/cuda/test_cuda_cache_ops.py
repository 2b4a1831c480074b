"""reshape_and_cache and copy_blocks in the CPU emulator against TorchOps (exact copies)."""

from __future__ import annotations

import pytest
import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_reshape_and_cache_writes_slots_and_skips_minus_one(
    emulated_ops, reference_ops, dtype, block_size
):
    num_blocks, num_kv_heads, head_size = 12, 2, 64
    # A fused kv projection: key and value are views with a token stride of 2 heads * 2.
    kv = _randn(6, 2 * num_kv_heads * head_size, dtype=dtype, seed=1)
    key = kv[:, : num_kv_heads * head_size].view(6, num_kv_heads, head_size)
    value = kv[:, num_kv_heads * head_size :].view(6, num_kv_heads, head_size)
    capacity = num_blocks * block_size
    slot_mapping = torch.tensor([capacity - 1, -1, 0, block_size, 3 * block_size - 1, -1])
    caches = [
        _randn(num_blocks, num_kv_heads, block_size, head_size, dtype=dtype, seed=s) for s in (2, 3)
    ]
    expected = [c.clone() for c in caches]
    reference_ops.reshape_and_cache(key, value, *expected, slot_mapping)
    emulated_ops.reshape_and_cache(key, value, *caches, slot_mapping)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    # the -1 slots really were skipped: the rows that were written equal the inputs
    assert torch.equal(caches[0][0, :, 0], key[2])


def test_reshape_and_cache_rejects_a_non_contiguous_cache(emulated_ops):
    cache = torch.zeros(4, 2, 8, 16).transpose(1, 2)
    key = torch.zeros(1, 8, 16)
    with pytest.raises(ValueError, match="key_cache must be contiguous"):
        emulated_ops.reshape_and_cache(key, key, cache, cache, torch.tensor([0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_every_layer_keys_and_values(emulated_ops, reference_ops, dtype):
    shape = (10, 2, 16, 64)
    layers = 3
    key_caches = [_randn(*shape, dtype=dtype, seed=10 + i) for i in range(layers)]
    value_caches = [_randn(*shape, dtype=dtype, seed=20 + i) for i in range(layers)]
    mapping = torch.tensor([[0, 5], [3, 9], [3, 1], [7, 2]])
    expected_k = [c.clone() for c in key_caches]
    expected_v = [c.clone() for c in value_caches]
    reference_ops.copy_blocks(expected_k, expected_v, mapping)
    emulated_ops.copy_blocks(key_caches, value_caches, mapping)
    for actual, expected in zip(
        [*key_caches, *value_caches], [*expected_k, *expected_v], strict=True
    ):
        assert torch.equal(actual, expected)
    assert torch.equal(key_caches[2][9], key_caches[2][3])


def test_copy_blocks_rejects_caches_of_different_shapes(emulated_ops):
    with pytest.raises(ValueError, match="one dtype and shape"):
        emulated_ops.copy_blocks(
            [torch.zeros(4, 1, 2, 8)], [torch.zeros(4, 1, 4, 8)], torch.tensor([[0, 1]])
        )
