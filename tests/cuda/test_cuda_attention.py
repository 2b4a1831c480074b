"""Paged attention kernels (decode, partitioned decode, prefill over a cached prefix) in
the CPU emulator against TorchOps, in both thread orders, on awkward shapes: context
lengths 1, block_size - 1, block_size + 1 and several hundred; GQA ratios 1, 2, 4; head
sizes 64 and 128; all three dtypes (tolerances in conftest.py); sliding windows of one
key, inside a block, across blocks and past the context; fp8 and int8 caches."""

from __future__ import annotations

import math

import pytest
import torch

from ringllm.cuda.ops import CudaOps
from ringllm.pipeline.ops import kv_int8

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
    assert ops._decode_partitions(max_attended=512, single_pass_ctas=8) == 1
    assert ops._decode_partitions(max_attended=513, single_pass_ctas=8) == 2
    assert ops._decode_partitions(max_attended=4096, single_pass_ctas=1024) == 1


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


def _prefill_case(requests: list[tuple[int, int]], gqa: int, head_size: int, dtype: torch.dtype):
    """paged_attention_prefill's arguments for (cached prefix, new tokens) per request."""
    seq_lens = [prefix + new for prefix, new in requests]
    key_cache, value_cache, block_tables = _paged_cache(
        seq_lens, head_size, dtype, seed=gqa + head_size
    )
    q_lens = [new for _, new in requests]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = _randn(sum(q_lens), NUM_KV_HEADS * gqa, head_size, dtype=dtype, seed=11) * 2
    return (query, key_cache, value_cache, block_tables, query_start_loc,
            torch.tensor(seq_lens, dtype=torch.int32), 1 / math.sqrt(head_size))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_prefill_matches_reference(
    emulated_ops, reference_ops, assert_close, gqa, head_size, dtype
):
    args = _prefill_case(PREFILL_REQUESTS, gqa, head_size, dtype)
    assert_close(
        emulated_ops.paged_attention_prefill(*args), reference_ops.paged_attention_prefill(*args)
    )


@pytest.mark.parametrize("window", [0, 7])
def test_chunked_prefill_then_decode_equals_dense_causal_attention(emulated_ops, window):
    """End to end through the kernels only: write a prompt's KV in two chunks with
    reshape_and_cache, attend each chunk with prefill, then one decode step; the outputs
    must equal plain causal softmax attention over the dense sequence (an oracle
    independent of TorchOps' paged code), with a sliding window too (7: the second
    chunk's window starts in the second block, the decode's in the third)."""
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
                q[start:end], *caches, block_table, loc, lens, scale, sliding_window=window
            )
        )
    emulated_ops.reshape_and_cache(k[prompt_len:], v[prompt_len:], *caches, slots[prompt_len:])
    lens = torch.tensor([total], dtype=torch.int32)
    outputs.append(
        emulated_ops.paged_attention_decode(
            q[prompt_len:], *caches, block_table, lens, scale, sliding_window=window
        )
    )
    keys = k.repeat_interleave(gqa, dim=1).transpose(0, 1)  # [H, L, D]
    values = v.repeat_interleave(gqa, dim=1).transpose(0, 1)
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    if window:  # query p sees keys p - window + 1 .. p
        causal &= ~torch.ones(total, total, dtype=torch.bool).tril(-window)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=causal, scale=scale
    ).transpose(0, 1)
    torch.testing.assert_close(torch.cat(outputs), dense, atol=1e-5, rtol=1e-5)


# ---- sliding window ----

# One key; inside a block; across three blocks (and past the shorter contexts); past
# every context (the same as no window).
WINDOWS = [1, 5, 2 * BLOCK_SIZE + 8, 1000]
WINDOW_HEAD_SIZE = 32  # the window does not depend on it; a small head keeps these fast
WINDOW_SEQ_LENS = [1, 9, 40, 70]
# (cached prefix, new tokens): one token; a fresh prompt over three query tiles, its later
# rows' windows sliding off the first keys; a chunk after a cached prefix, crossing the
# window's edge; a short chunk after a long prefix.
WINDOW_PREFILL_REQUESTS = [(0, 1), (0, 37), (30, 20), (50, 3)]


def _hide_before(cache: torch.Tensor, block_tables: torch.Tensor, first_keys: list[int]):
    """A copy of the cache with request r's positions before first_keys[r] set to NaN.
    A window's hidden keys must weigh exactly nothing and the kernels must not read them
    (an engine may free their blocks): one NaN read would spread to the output."""
    hidden = cache.clone()
    block_size = cache.shape[2]
    for r, first in enumerate(first_keys):
        for pos in range(first):
            hidden[block_tables[r, pos // block_size], :, pos % block_size] = float("nan")
    return hidden


def _decode_with_window(ops, reference_ops, args, window: int):
    """(kernel's output on a cache NaN before each window, TorchOps' on the clean cache)."""
    query, key_cache, value_cache, tables, lens, scale = args
    first_keys = [max(0, n - window) for n in lens.tolist()]
    hidden = [_hide_before(c, tables, first_keys) for c in (key_cache, value_cache)]
    return (
        ops.paged_attention_decode(query, *hidden, tables, lens, scale, sliding_window=window),
        reference_ops.paged_attention_decode(*args, sliding_window=window),
    )


def _prefill_with_window(ops, reference_ops, args, window: int):
    """As _decode_with_window; what no query of a chunk sees is before its first row's window."""
    query, key_cache, value_cache, tables, loc, lens, scale = args
    q_lens = (loc[1:] - loc[:-1]).tolist()
    first_keys = [max(0, n - q - window + 1) for n, q in zip(lens.tolist(), q_lens, strict=True)]
    hidden = [_hide_before(c, tables, first_keys) for c in (key_cache, value_cache)]
    return (
        ops.paged_attention_prefill(
            query, *hidden, tables, loc, lens, scale, sliding_window=window
        ),
        reference_ops.paged_attention_prefill(*args, sliding_window=window),
    )


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_with_sliding_window_matches_reference(
    emulated_ops, reference_ops, assert_close, window, gqa
):
    args = _decode_case(gqa, WINDOW_HEAD_SIZE, torch.float32, WINDOW_SEQ_LENS)
    assert_close(*_decode_with_window(emulated_ops, reference_ops, args, window))


@pytest.mark.parametrize("window", [40, 100])
def test_partitioned_decode_with_sliding_window_matches_reference(
    partitioned_ops, reference_ops, assert_close, window
):
    # 48-token partitions count from the window's start: 40 fits one wherever it starts
    # (70 - 40 = 30 is mid-partition in absolute terms), 100 of 150 takes 48 + 48 + 4.
    args = _decode_case(2, WINDOW_HEAD_SIZE, torch.float32, [1, 47, 70, 150])
    assert_close(*_decode_with_window(partitioned_ops, reference_ops, args, window))


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_with_sliding_window_matches_reference(
    emulated_ops, reference_ops, assert_close, window, gqa
):
    args = _prefill_case(WINDOW_PREFILL_REQUESTS, gqa, WINDOW_HEAD_SIZE, torch.float32)
    assert_close(*_prefill_with_window(emulated_ops, reference_ops, args, window))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sliding_window_in_16_bit(emulated_ops, reference_ops, assert_close, dtype):
    args = _decode_case(2, WINDOW_HEAD_SIZE, dtype, WINDOW_SEQ_LENS)
    assert_close(*_decode_with_window(emulated_ops, reference_ops, args, 20))
    args = _prefill_case(WINDOW_PREFILL_REQUESTS, 2, WINDOW_HEAD_SIZE, dtype)
    assert_close(*_prefill_with_window(emulated_ops, reference_ops, args, 20))


@pytest.mark.parametrize("window", [70, 2**40])
def test_window_covering_the_context_is_bit_for_bit_no_window(
    emulated_ops, partitioned_ops, window
):
    """70: exactly the longest context; 2**40: past int32, clamped by the wrapper."""
    args = _decode_case(2, WINDOW_HEAD_SIZE, torch.float32, WINDOW_SEQ_LENS)
    for ops in (emulated_ops, partitioned_ops):
        windowed = ops.paged_attention_decode(*args, sliding_window=window)
        assert torch.equal(windowed, ops.paged_attention_decode(*args))
    args = _prefill_case(WINDOW_PREFILL_REQUESTS, 2, WINDOW_HEAD_SIZE, torch.float32)
    windowed = emulated_ops.paged_attention_prefill(*args, sliding_window=window)
    assert torch.equal(windowed, emulated_ops.paged_attention_prefill(*args))


def test_negative_sliding_window_is_refused(emulated_ops):
    message = r"sliding_window must be >= 0 tokens \(0: no window\), got -1"
    with pytest.raises(ValueError, match=message):
        emulated_ops.paged_attention_decode(
            *_decode_case(1, WINDOW_HEAD_SIZE, torch.float32, [3]), sliding_window=-1
        )
    args = _prefill_case([(0, 3)], 1, WINDOW_HEAD_SIZE, torch.float32)
    with pytest.raises(ValueError, match=message):
        emulated_ops.paged_attention_prefill(*args, sliding_window=-1)


# ---- an fp8 KV cache (--kv-cache-dtype fp8) -------------------------------------------------


def _as_fp8(args):
    """The same case over float8 e4m3fn caches (the key and value caches are args 1, 2)."""
    args = list(args)
    args[1], args[2] = (
        args[1].float().to(torch.float8_e4m3fn),
        args[2].float().to(torch.float8_e4m3fn),
    )
    return args


# ---- an int8 KV cache (--kv-cache-dtype int8): values times a scale per (block, KV head) ----


def _quantize_int8(cache: torch.Tensor) -> torch.Tensor:
    """The cache's rows written into an int8 cache by kv_int8.write_rows (its rule), every
    block's rows in order: blocks of their own scales, some grown row by row."""
    num_blocks, kv_heads, block_size, head_size = cache.shape
    quantized = kv_int8.new_cache(tuple(cache.shape), torch.int8, "cpu")
    rows = cache.transpose(1, 2).reshape(num_blocks * block_size, kv_heads, head_size)
    kv_int8.write_rows(quantized, rows, torch.arange(num_blocks * block_size))
    return quantized


def _as_int8(args):
    """The same case over int8 caches (the key and value caches are args 1, 2), each block's
    values scaled differently so that a wrong (block, head) scale shows."""
    args = list(args)
    num_blocks, kv_heads = args[1].shape[:2]
    spread = torch.linspace(0.5, 2.0, num_blocks * kv_heads).view(num_blocks, kv_heads, 1, 1)
    args[1], args[2] = (_quantize_int8(args[i].float() * spread) for i in (1, 2))
    return args


@pytest.mark.parametrize("as_8_bit", [_as_fp8, _as_int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 4])
def test_decode_over_an_8_bit_cache_matches_reference(
    emulated_ops, partitioned_ops, reference_ops, assert_close, gqa, dtype, as_8_bit
):
    args = as_8_bit(_decode_case(gqa, 64, dtype, CONTEXT_LENS))
    expected = reference_ops.paged_attention_decode(*args)
    assert_close(emulated_ops.paged_attention_decode(*args), expected)
    assert_close(partitioned_ops.paged_attention_decode(*args), expected)


@pytest.mark.parametrize("as_8_bit", [_as_fp8, _as_int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_over_an_8_bit_cache_matches_reference(
    emulated_ops, reference_ops, assert_close, dtype, as_8_bit
):
    args = as_8_bit(_prefill_case(PREFILL_REQUESTS, 2, 64, dtype))
    assert_close(
        emulated_ops.paged_attention_prefill(*args), reference_ops.paged_attention_prefill(*args)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_cache_written_and_read_by_the_kernels_matches_reference(
    emulated_ops, reference_ops, assert_close, dtype
):
    """A prompt in two chunks (the second starting mid-block), then a decode token whose
    larger keys and values grow its block's scales: written by the kernel and by TorchOps
    into two int8 caches, which must be equal, then attended by each over its own (TorchOps
    over an int8 cache computing in float32, as the kernels do)."""
    head_size, gqa, prompt_len, chunk = 32, 2, 37, 21
    total = prompt_len + 1
    q = _randn(total, NUM_KV_HEADS * gqa, head_size, dtype=dtype, seed=31)
    kv = _randn(total, 2, NUM_KV_HEADS, head_size, dtype=torch.float32, seed=32)
    kv[-1] *= 8
    key, value = kv.to(dtype).unbind(1)
    shape = (5, NUM_KV_HEADS, BLOCK_SIZE, head_size)
    caches = [kv_int8.new_cache(shape, torch.int8, "cpu") for _ in range(4)]
    block_table = torch.tensor([[3, 0, 4]], dtype=torch.int32)
    slots = block_table[0].long().repeat_interleave(BLOCK_SIZE) * BLOCK_SIZE
    slots = (slots + torch.arange(BLOCK_SIZE).repeat(3))[:total]
    scale = 1 / math.sqrt(head_size)
    for start, end in ((0, chunk), (chunk, prompt_len), (prompt_len, total)):
        emulated_ops.reshape_and_cache(
            key[start:end], value[start:end], *caches[:2], slots[start:end]
        )
        reference_ops.reshape_and_cache(
            key[start:end], value[start:end], *caches[2:], slots[start:end]
        )
        for actual, expected in zip(caches[:2], caches[2:], strict=True):
            assert torch.equal(actual, expected)
            assert torch.equal(kv_int8.kv_scales(actual), kv_int8.kv_scales(expected))
        lens = torch.tensor([end], dtype=torch.int32)
        if end < total:
            loc = torch.tensor([0, end - start], dtype=torch.int32)
            args = (q[start:end], block_table, loc, lens, scale)
            run = "paged_attention_prefill"
        else:
            args = (q[start:end], block_table, lens, scale)
            run = "paged_attention_decode"
        actual = getattr(emulated_ops, run)(args[0], *caches[:2], *args[1:])
        assert_close(actual, getattr(reference_ops, run)(args[0], *caches[2:], *args[1:]))
