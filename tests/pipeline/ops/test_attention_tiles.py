"""Paged attention on the AMX tile unit (csrc/attention_tiles.h, `CpuOps.attention_tiles`):
against dense float64 attention within the bound of rounding the query rows and softmax
weights to bfloat16, a token's output the same bits in any item, batch or thread count, the
layouts it does not take falling back to the vector kernels, and the loader's choice. Runs
where this process owns the tile unit (a Sapphire Rapids class Xeon or later)."""

from __future__ import annotations

import pytest
import torch
from test_cpu_ops import make_cache
from test_torch_ops import dense_kv, dense_reference

from ringllm.pipeline.ops import cpu_kernels
from ringllm.pipeline.ops.cpu import CpuOps, kernel_sets

pytestmark = pytest.mark.skipif(
    "avx512bf16" not in kernel_sets() or not cpu_kernels.attention_tiles_usable(),
    reason="the CPU (or the OS, for this process) offers no AMX tile unit",
)

# Rounding a query row and the softmax weights to bfloat16 (8 significant bits) moves an
# output of magnitude ~1 by a few units of 2^-9: the bound a bfloat16 output has anyway.
TILE_TOL = 1.6e-2
SHAPES = [  # num_heads, num_kv_heads, head_size, block_size
    (9, 3, 64, 16),  # the demo model
    (8, 1, 128, 32),
    (4, 2, 256, 16),  # Gemma 3's head size
    (4, 4, 64, 64),
    (64, 1, 64, 16),  # 64 rows a token: four blocks of 16 rows per item
]


def tile_ops(threads: int | None = None) -> CpuOps:
    ops = CpuOps("avx512bf16", threads=threads)
    ops.attention_tiles = True
    return ops


def poison_unwritten(cache, tables, contexts):
    """NaN in every slot past a request's length in its last block: a cache slot never
    written may hold anything, and a weight of 0 times NaN is NaN."""
    block_size = cache.shape[2]
    for r, n in enumerate(contexts):
        last = int(tables[r, (n - 1) // block_size])
        cache[last, :, (n - 1) % block_size + 1 :] = float("nan")


def inputs(shape, contexts, q_lens, dtype, seed):
    num_heads, num_kv_heads, head_size, block_size = shape
    key_cache, value_cache, tables, gen = make_cache(
        num_kv_heads, block_size, head_size, contexts, torch.bfloat16, seed
    )
    poison_unwritten(key_cache, tables, contexts)
    poison_unwritten(value_cache, tables, contexts)
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_cache, value_cache, tables, starts, torch.tensor(contexts, dtype=torch.int32)


@pytest.mark.parametrize("window", [0, 5, 19, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_tiles_match_dense_attention(shape, dtype, window):
    """Prompt chunks after cached prefixes and decodes, contexts across chunks of 256 keys,
    windows within a block, across blocks and across chunks."""
    head_size = shape[2]
    contexts, q_lens = [9, 40, 17, 300, 600], [9, 12, 1, 30, 70]
    query, kc, vc, tables, starts, seq_lens = inputs(shape, contexts, q_lens, dtype, seed=0)
    scale = head_size**-0.5
    ops = tile_ops()
    out = ops.paged_attention_prefill(query, kc, vc, tables, starts, seq_lens, scale, window)
    last = query[starts[1:] - 1]
    decoded = ops.paged_attention_decode(last, kc, vc, tables, seq_lens, scale, window)
    for r, (n, q_len) in enumerate(zip(contexts, q_lens, strict=True)):
        k, v = dense_kv(kc, tables[r], n), dense_kv(vc, tables[r], n)
        ref = dense_reference(query[starts[r] : starts[r + 1]], k, v, n - q_len, scale, window)
        got = out[starts[r] : starts[r + 1]].double()
        assert torch.allclose(got, ref, atol=TILE_TOL, rtol=TILE_TOL)
        assert torch.allclose(decoded[r].double(), ref[-1], atol=TILE_TOL, rtol=TILE_TOL)
    # the tile unit ran: float32 queries are rounded, which the vector kernels never do
    if dtype == torch.float32:
        vector = CpuOps("avx512bf16").paged_attention_decode(
            last, kc, vc, tables, seq_lens, scale, window
        )
        assert not torch.equal(vector, decoded)


@pytest.mark.parametrize("window", [0, 40])
def test_a_token_is_the_same_bits_in_any_item_batch_or_thread_count(window):
    """Each token of a prompt chunk against the same token decoded alone (its own item, its
    own batch, one thread): one request's chunk of 70 tokens spans two items of queries."""
    shape = (9, 3, 64, 16)
    contexts, q_lens = [33, 290, 600], [33, 70, 5]
    query, kc, vc, tables, starts, seq_lens = inputs(shape, contexts, q_lens, torch.float32, seed=2)
    chunked = tile_ops().paged_attention_prefill(
        query, kc, vc, tables, starts, seq_lens, 0.125, window
    )
    alone = tile_ops(threads=1)
    for r, (n, q_len) in enumerate(zip(contexts, q_lens, strict=True)):
        for i in range(q_len):
            row = int(starts[r]) + i
            one = alone.paged_attention_decode(
                query[row : row + 1],
                kc,
                vc,
                tables[r : r + 1],
                torch.tensor([n - q_len + i + 1], dtype=torch.int32),
                0.125,
                window,
            )
            assert torch.equal(one[0], chunked[row]), (r, i)


@pytest.mark.parametrize(
    "cache_dtype, shape",
    [
        (torch.float16, (9, 3, 64, 16)),  # a float16 cache
        (torch.bfloat16, (6, 1, 80, 16)),  # head size 80
        (torch.bfloat16, (4, 4, 64, 8)),  # blocks of 8 keys
    ],
)
def test_layouts_the_tile_unit_does_not_take_run_the_vector_kernels(cache_dtype, shape):
    num_heads, num_kv_heads, head_size, block_size = shape
    contexts = [5, 70]
    key_cache, value_cache, tables, gen = make_cache(
        num_kv_heads, block_size, head_size, contexts, cache_dtype, seed=3
    )
    query = torch.randn(len(contexts), num_heads, head_size, generator=gen)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    args = (query, key_cache, value_cache, tables, seq_lens, 0.1)
    tiles = tile_ops().paged_attention_decode(*args)
    assert torch.equal(tiles, CpuOps("avx512bf16").paged_attention_decode(*args))
