"""swap_blocks on the CPU: CpuOps' memcpy kernel and TorchOps' index copies against a
block-by-block oracle, bit for bit, between two tiers of different block counts, both ways;
an empty mapping; and the same refusals, word for word, from TorchOps, CpuOps and CudaOps
(whose checks are a copy: cuda/ cannot import pipeline/)."""

from __future__ import annotations

import pytest
import torch

from ringllm.cuda.ops import CudaOps
from ringllm.pipeline.ops import TorchOps, kv_int8
from ringllm.pipeline.ops.cpu import CpuOps

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]
SHAPE = (3, 16, 64)  # num_kv_heads, block_size, head_size


@pytest.fixture(params=["torch", "cpu-1-thread", "cpu-2-threads"])
def ops(request):
    return {
        "torch": TorchOps(),
        "cpu-1-thread": CpuOps(threads=1),
        "cpu-2-threads": CpuOps(threads=2),
    }[request.param]


def random_bits(*shape, dtype, seed):
    """Tensors of random bit patterns (NaNs with payloads, infinities, subnormals among
    them): a copy must move the bits, not the values."""
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    bits = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=gen)
    return bits.view(dtype).view(shape)


def cache(num_blocks, dtype, seed):
    """A cache of random bits; an int8 one is the int8 KV cache, its scales random too
    (kv_int8.py: they follow the values, and move with their blocks)."""
    bits = random_bits(num_blocks, *SHAPE, dtype=dtype, seed=seed)
    if dtype is not torch.int8:
        return bits
    made = kv_int8.new_cache(bits.shape, dtype, "cpu")
    made.copy_(bits)
    gen = torch.Generator().manual_seed(seed)
    kv_int8.kv_scales(made).copy_(torch.rand(num_blocks, SHAPE[0], generator=gen))
    return made


def tier(num_layers, num_blocks, dtype, seed):
    return [
        tuple(cache(num_blocks, dtype, seed + 2 * i + j) for j in (0, 1)) for i in range(num_layers)
    ]


def _clone(c):
    if c.dtype is not torch.int8:
        return c.clone()
    made = kv_int8.new_cache(c.shape, c.dtype, "cpu")
    made.copy_(c)
    kv_int8.kv_scales(made).copy_(kv_int8.kv_scales(c))
    return made


def clone(caches):
    return [tuple(_clone(c) for c in pair) for pair in caches]


def oracle(src_caches, dst_caches, mapping):
    """dst_caches after the swap, block by block."""
    out = clone(dst_caches)
    for (s_key, s_value), (d_key, d_value) in zip(src_caches, out, strict=True):
        for s, d in mapping.tolist():
            d_key[d], d_value[d] = s_key[s], s_value[s]
            if d_key.dtype is torch.int8:
                for src, dst in ((s_key, d_key), (s_value, d_value)):
                    kv_int8.kv_scales(dst)[d] = kv_int8.kv_scales(src)[s]
    return out


def bits_equal(actual, expected):
    return all(
        torch.equal(a.view(torch.uint8), e.view(torch.uint8))
        and (a.dtype is not torch.int8 or torch.equal(kv_int8.kv_scales(a), kv_int8.kv_scales(e)))
        for pa, pe in zip(actual, expected, strict=True)
        for a, e in zip(pa, pe, strict=True)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_out_to_the_host_tier_and_back_moves_the_bits(ops, dtype):
    device, host = tier(4, 12, dtype, seed=0), tier(4, 40, dtype, seed=100)
    gen = torch.Generator().manual_seed(1)
    out = torch.stack(
        [torch.randperm(12, generator=gen)[:9], torch.randperm(40, generator=gen)[:9]], 1
    )
    expected = oracle(device, host, out)
    ops.swap_blocks(device, host, out)
    assert bits_equal(host, expected)
    back = torch.stack([out[:, 1], torch.randperm(12, generator=gen)[:9]], 1)
    expected = oracle(host, device, back)
    ops.swap_blocks(host, device, back)
    assert bits_equal(device, expected)


def test_cpu_ops_and_torch_ops_agree_on_one_source_block_sent_to_many(ops):
    src, dst = tier(2, 3, torch.bfloat16, seed=5), tier(2, 8, torch.bfloat16, seed=6)
    mapping = torch.tensor([[1, 0], [1, 7], [1, 3], [0, 4]])
    expected = clone(dst)
    TorchOps().swap_blocks(src, expected, mapping)
    ops.swap_blocks(src, dst, mapping)
    assert bits_equal(dst, expected) and bits_equal(dst, oracle(src, clone(dst), mapping))


def test_an_empty_mapping_copies_nothing(ops):
    src, dst = tier(2, 3, torch.float16, seed=7), tier(2, 5, torch.float16, seed=8)
    before = clone(dst)
    ops.swap_blocks(src, dst, torch.empty(0, 2, dtype=torch.int64))
    ops.swap_blocks([], [], torch.empty(0, 2, dtype=torch.int64))
    assert bits_equal(dst, before)


def _replace(caches, layer, index, cache):
    """caches with one tensor swapped for `cache`."""
    pairs = list(caches)
    pair = list(pairs[layer])
    pair[index] = cache
    pairs[layer] = tuple(pair)
    return pairs


# what is wrong: (the bad call made of a good src [2 layers, 5 blocks], dst [2, 7] and
# mapping, the message it raises)
REFUSALS = {
    "layers": (lambda s, d, m: (s, d[:1], m), "2 layers in src_caches, 1 in dst_caches"),
    "pair": (
        lambda s, d, m: (s, [d[0], d[1][:1]], m),
        r"dst_caches\[1\] must be a \(key_cache, value_cache\) pair, got 1 tensors",
    ),
    "head size": (
        lambda s, d, m: (s, _replace(d, 1, 1, torch.zeros(7, 3, 16, 32)), m),
        r"dst_caches\[1\] value cache is torch.float32 \(7, 3, 16, 32\); every cache must be "
        r"torch.float32 \[num_blocks, 3, 16, 64\] like src_caches\[0\]'s keys",
    ),
    "dtype": (
        lambda s, d, m: (s, _replace(d, 0, 0, d[0][0].half()), m),
        r"dst_caches\[0\] key cache is torch.float16",
    ),
    "src dtype": (
        lambda s, d, m: (_replace(s, 1, 1, s[1][1].bfloat16()), d, m),
        r"src_caches\[1\] value cache is torch.bfloat16",
    ),
    "blocks": (
        lambda s, d, m: (s, _replace(d, 1, 1, torch.zeros(6, *SHAPE)), m),
        r"dst_caches\[1\] value cache has 6 blocks, dst_caches\[0\] keys 7",
    ),
    "contiguous": (
        lambda s, d, m: (s, _replace(d, 1, 1, torch.zeros(7, 16, 3, 64).transpose(1, 2)), m),
        r"dst_caches\[1\] value cache is not contiguous",
    ),
    "same cache": (
        lambda s, d, m: (s, [s[1], s[0]], m),
        "a cache is in both src_caches and dst_caches",
    ),
    "mapping dtype": (
        lambda s, d, m: (s, d, m.int()),
        r"block_mapping must be an int64 \[N, 2\] tensor, got torch.int32 \(2, 2\)",
    ),
    "mapping shape": (
        lambda s, d, m: (s, d, m.view(-1)),
        r"int64 \[N, 2\] tensor, got torch.int64 \(4,\)",
    ),
    "mapping type": (lambda s, d, m: (s, d, [[0, 1]]), r"int64 \[N, 2\] tensor, got list"),
    "src range": (
        lambda s, d, m: (s, d, torch.tensor([[5, 1]])),
        r"src block ids 5..5 outside the src caches' 5 blocks \(0..4\)",
    ),
    "negative": (
        lambda s, d, m: (s, d, torch.tensor([[0, 1], [-1, 2]])),
        "src block ids -1..0 outside",
    ),
    "dst range": (
        lambda s, d, m: (s, d, torch.tensor([[0, 7]])),
        r"dst block ids 7..7 outside the dst caches' 7 blocks \(0..6\)",
    ),
    "duplicate dst": (
        lambda s, d, m: (s, d, torch.tensor([[0, 3], [1, 3], [2, 4], [3, 4]])),
        r"dst blocks \[3, 4\] appear more than once in block_mapping",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_every_implementation_refuses_the_same_calls_and_copies_nothing(case):
    make, message = REFUSALS[case]
    good = tier(2, 5, torch.float32, seed=9), tier(2, 7, torch.float32, seed=10)
    src, dst, mapping = make(*good, torch.tensor([[0, 1], [4, 6]]))
    before = clone(dst)
    # CudaOps checks before it compiles or launches anything: no g++ or GPU needed here.
    for ops in (TorchOps(), CpuOps(), CudaOps(backend="emulator")):
        with pytest.raises(ValueError, match=message):
            ops.swap_blocks(src, dst, mapping)
    assert bits_equal(dst, before)
