"""Paged attention kernels (decode, partitioned decode, prefill over a cached prefix) in
the CPU emulator against TorchOps, in both thread orders, on awkward shapes: context
lengths 1, block_size - 1, block_size + 1 and several hundred; GQA ratios 1, 2, 4; head
sizes 64 and 128; all three dtypes (tolerances in conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

from ringllm.cuda.ops import CudaOps

BLOCK_SIZE = 16
NUM_KV_HEADS = 2
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CONTEXT_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE + 1, 300]


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


def _paged_cache(
    seq_lens: list[int], head_size: int, dtype: torch.dtype, seed: int, block_size: int = BLOCK_SIZE
):
    """Random key/value caches and block tables that scatter each request's blocks."""
    blocks_per_seq = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * blocks_per_seq + 3
    shape = (num_blocks, NUM_KV_HEADS, block_size, head_size)
    key_cache, value_cache = (
        _randn(*shape, dtype=dtype, seed=seed),
        _randn(*shape, dtype=dtype, seed=seed + 1),
    )
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 2))
    block_tables = order[: len(seq_lens) * blocks_per_seq].view(len(seq_lens), blocks_per_seq)
    return key_cache, value_cache, block_tables.to(torch.int32)


@pytest.fixture(scope="session", params=["forward", "reverse"])
def partitioned_ops(request) -> CudaOps:
    """Decode split into 48-token partitions whatever the context, to test that plan."""
    return CudaOps(
        backend="emulator", thread_order=request.param, partition_tokens=48, partition_mode="always"
    )


def _decode_case(gqa: int, head_size: int, dtype: torch.dtype, seq_lens: list[int]):
    key_cache, value_cache, block_tables = _paged_cache(
        seq_lens, head_size, dtype, seed=gqa * head_size
    )
    query = _randn(len(seq_lens), NUM_KV_HEADS * gqa, head_size, dtype=dtype, seed=7) * 2
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, lens, 1 / math.sqrt(head_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_decode_matches_reference(emulated_ops, reference_ops, assert_close, gqa, head_size, dtype):
    args = _decode_case(gqa, head_size, dtype, CONTEXT_LENS)
    assert_close(
        emulated_ops.paged_attention_decode(*args), reference_ops.paged_attention_decode(*args)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 4])
def test_partitioned_decode_matches_reference(
    partitioned_ops, reference_ops, assert_close, gqa, dtype
):
    # 47/48/49: a partial, an exact and a spilled partition; 300: seven partitions
    args = _decode_case(gqa, 64, dtype, [1, 47, 48, 49, 300])
    assert_close(
        partitioned_ops.paged_attention_decode(*args), reference_ops.paged_attention_decode(*args)
    )


def test_partitioned_decode_head_size_128(partitioned_ops, reference_ops, assert_close):
    args = _decode_case(2, 128, torch.float32, [BLOCK_SIZE + 1, 200])
    assert_close(
        partitioned_ops.paged_attention_decode(*args), reference_ops.paged_attention_decode(*args)
    )


def test_auto_mode_partitions_only_long_contexts_on_small_grids():
    ops = CudaOps(backend="emulator", partition_tokens=512)
    assert ops._decode_partitions(max_seq_len=512, single_pass_ctas=8) == 1
    assert ops._decode_partitions(max_seq_len=513, single_pass_ctas=8) == 2
    assert ops._decode_partitions(max_seq_len=4096, single_pass_ctas=1024) == 1


def test_decode_rejects_heads_that_do_not_group(emulated_ops):
    args = list(_decode_case(1, 64, torch.float32, [3]))
    args[0] = torch.zeros(1, 3, 64)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="num_heads 3 is not a multiple of num_kv_heads 2"):
        emulated_ops.paged_attention_decode(*args)


@pytest.mark.parametrize("block_size", [1, 32])
def test_attention_with_odd_head_size_wide_groups_and_other_block_sizes(
    emulated_ops, reference_ops, assert_close, block_size
):
    """head_size 80 (not a multiple of 32), GQA ratio 8, blocks of 1 and 32 tokens."""
    head_size, num_heads = 80, NUM_KV_HEADS * 8
    seq_lens = [1, 33, 70]
    key_cache, value_cache, tables = _paged_cache(seq_lens, head_size, torch.float32, 5, block_size)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = _randn(3, num_heads, head_size, dtype=torch.float32, seed=6)
    args = (query, key_cache, value_cache, tables, lens, 0.1)
    assert_close(
        emulated_ops.paged_attention_decode(*args), reference_ops.paged_attention_decode(*args)
    )
    q_lens = [1, 20, 70]
    loc = torch.tensor([0, 1, 21, 91], dtype=torch.int32)
    prompt = _randn(sum(q_lens), num_heads, head_size, dtype=torch.float32, seed=8)
    args = (prompt, key_cache, value_cache, tables, loc, lens, 0.1)
    assert_close(
        emulated_ops.paged_attention_prefill(*args), reference_ops.paged_attention_prefill(*args)
    )


# (cached prefix, new tokens) per request: a 1-token chunk, chunks around the block size,
# a chunk after a prefix that ends mid-block, and a long prompt.
PREFILL_REQUESTS = [
    (0, 1),
    (0, BLOCK_SIZE - 1),
    (5, BLOCK_SIZE + 1),
    (BLOCK_SIZE + 3, 2),
    (20, 260),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_prefill_matches_reference(
    emulated_ops, reference_ops, assert_close, gqa, head_size, dtype
):
    seq_lens = [prefix + new for prefix, new in PREFILL_REQUESTS]
    key_cache, value_cache, block_tables = _paged_cache(
        seq_lens, head_size, dtype, seed=gqa + head_size
    )
    q_lens = [new for _, new in PREFILL_REQUESTS]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = _randn(sum(q_lens), NUM_KV_HEADS * gqa, head_size, dtype=dtype, seed=11) * 2
    args = (query, key_cache, value_cache, block_tables, query_start_loc,
            torch.tensor(seq_lens, dtype=torch.int32), 1 / math.sqrt(head_size))  # fmt: skip
    assert_close(
        emulated_ops.paged_attention_prefill(*args), reference_ops.paged_attention_prefill(*args)
    )


def test_chunked_prefill_then_decode_equals_dense_causal_attention(emulated_ops):
    """End to end through the kernels only: write a prompt's KV in two chunks with
    reshape_and_cache, attend each chunk with prefill, then one decode step; the outputs
    must equal plain causal softmax attention over the dense sequence (an oracle
    independent of TorchOps' paged code)."""
    head_size, gqa, prompt_len, chunk = 64, 2, 40, 23
    total = prompt_len + 1
    num_heads = NUM_KV_HEADS * gqa
    q = _randn(total, num_heads, head_size, dtype=torch.float32, seed=21)
    k = _randn(total, NUM_KV_HEADS, head_size, dtype=torch.float32, seed=22)
    v = _randn(total, NUM_KV_HEADS, head_size, dtype=torch.float32, seed=23)
    caches = [torch.zeros(6, NUM_KV_HEADS, BLOCK_SIZE, head_size) for _ in range(2)]
    block_table = torch.tensor([[4, 0, 2, 5]], dtype=torch.int32)
    slots = torch.tensor(
        [int(block_table[0, t // BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE for t in range(total)]
    )
    scale = 1 / math.sqrt(head_size)
    outputs = []
    for start, end in ((0, chunk), (chunk, prompt_len)):
        emulated_ops.reshape_and_cache(k[start:end], v[start:end], *caches, slots[start:end])
        loc = torch.tensor([0, end - start], dtype=torch.int32)
        lens = torch.tensor([end], dtype=torch.int32)
        outputs.append(
            emulated_ops.paged_attention_prefill(
                q[start:end], *caches, block_table, loc, lens, scale
            )
        )
    emulated_ops.reshape_and_cache(k[prompt_len:], v[prompt_len:], *caches, slots[prompt_len:])
    lens = torch.tensor([total], dtype=torch.int32)
    outputs.append(
        emulated_ops.paged_attention_decode(q[prompt_len:], *caches, block_table, lens, scale)
    )
    keys = k.repeat_interleave(gqa, dim=1).transpose(0, 1)  # [H, L, D]
    values = v.repeat_interleave(gqa, dim=1).transpose(0, 1)
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=causal, scale=scale
    ).transpose(0, 1)
    torch.testing.assert_close(torch.cat(outputs), dense, atol=1e-5, rtol=1e-5)
