"""reshape_and_cache, copy_blocks and swap_blocks in the CPU emulator against TorchOps
(exact copies), and swap_blocks' refusals."""

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


# ---- swap_blocks: between two sets of caches (device tier <-> host tier) -------------------


def _tier(num_layers, num_blocks, shape, dtype, seed):
    return [
        tuple(_randn(num_blocks, *shape, dtype=dtype, seed=seed + 2 * i + j) for j in (0, 1))
        for i in range(num_layers)
    ]


def _clone(tier):
    return [tuple(c.clone() for c in pair) for pair in tier]


def _same(actual, expected):
    return all(
        torch.equal(a, e)
        for pair_a, pair_e in zip(actual, expected, strict=True)
        for a, e in zip(pair_a, pair_e, strict=True)
    )


@pytest.fixture
def swap_kernels(emulated_ops, monkeypatch):
    """The names of the kernels swap_blocks launches (the 16-byte one or the dtype's)."""
    names = []
    kernel = emulated_ops.loader.kernel

    def recording(family, name):
        names.append(name)
        return kernel(family, name)

    monkeypatch.setattr(emulated_ops.loader, "kernel", recording)
    return names


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_out_to_a_larger_tier_and_back(
    emulated_ops, reference_ops, swap_kernels, dtype
):
    shape = (2, 16, 64)  # a block is 2 * 16 * 64 elements: a multiple of 16 bytes
    device, host = _tier(3, 10, shape, dtype, seed=30), _tier(3, 25, shape, dtype, seed=40)
    out = torch.tensor([[0, 24], [3, 0], [9, 11], [3, 7]])  # block 3 to two places
    expected = _clone(host)
    reference_ops.swap_blocks(device, expected, out)
    emulated_ops.swap_blocks(device, host, out)
    assert _same(host, expected)
    assert torch.equal(host[2][1][7], device[2][1][3]) and torch.equal(
        host[0][0][24], device[0][0][0]
    )
    back = torch.tensor([[24, 1], [7, 9], [0, 4]])
    expected = _clone(device)
    reference_ops.swap_blocks(host, expected, back)
    emulated_ops.swap_blocks(host, device, back)
    assert _same(device, expected)
    assert swap_kernels == ["swap_blocks_b16", "swap_blocks_b16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_takes_the_dtype_kernel_where_16_bytes_do_not_align(
    emulated_ops, reference_ops, swap_kernels, dtype
):
    # A block of 3 * 2 * 5 elements is no multiple of 16 bytes in any dtype.
    device, host = _tier(2, 6, (3, 2, 5), dtype, seed=50), _tier(2, 9, (3, 2, 5), dtype, seed=60)
    mapping = torch.tensor([[5, 8], [0, 0], [2, 3]])
    expected = _clone(host)
    reference_ops.swap_blocks(device, expected, mapping)
    emulated_ops.swap_blocks(device, host, mapping)
    assert _same(host, expected)
    # blocks of a multiple of 16 bytes, but a cache that starts 8 bytes past a 16-byte boundary
    block = 2 * 16 * 64
    flat = torch.zeros(9 * block + 8, dtype=dtype)
    odd = flat[8 // flat.element_size() :][: 9 * block].view(9, 2, 16, 64)
    device = _tier(1, 6, (2, 16, 64), dtype, seed=70)
    host = [(odd, torch.zeros(9, 2, 16, 64, dtype=dtype))]
    expected = _clone(host)
    reference_ops.swap_blocks(device, expected, mapping)
    emulated_ops.swap_blocks(device, host, mapping)
    assert _same(host, expected)
    assert odd.is_contiguous() and odd.data_ptr() % 16 == 8
    suffix = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    assert swap_kernels == [f"swap_blocks_{suffix}"] * 2


def test_swap_blocks_with_an_empty_mapping_copies_nothing(emulated_ops, swap_kernels):
    device, host = (
        _tier(2, 4, (1, 16, 8), torch.float16, 80),
        _tier(2, 6, (1, 16, 8), torch.float16, 90),
    )
    before = _clone(host)
    emulated_ops.swap_blocks(device, host, torch.empty(0, 2, dtype=torch.int64))
    emulated_ops.swap_blocks([], [], torch.empty(0, 2, dtype=torch.int64))
    assert _same(host, before) and swap_kernels == []


def _with(caches, layer, index, cache):
    pairs = [list(pair) for pair in caches]
    pairs[layer][index] = cache
    return [tuple(pair) for pair in pairs]


# what is wrong: (the bad call made of a good src [2 layers, 5 blocks of (2, 4, 8)], dst
# [2, 7] and mapping, the message CudaOps and TorchOps raise)
SWAP_REFUSALS = {
    "layers": (lambda s, d, m: (s, d[:1], m), "2 layers in src_caches, 1 in dst_caches"),
    "pair": (lambda s, d, m: (s, [d[0], d[1][:1]], m), r"dst_caches\[1\] must be a \(key_cache"),
    "shape": (
        lambda s, d, m: (s, _with(d, 1, 1, torch.zeros(7, 2, 4, 4)), m),
        r"dst_caches\[1\] value cache is torch.float32 \(7, 2, 4, 4\)",
    ),
    "dtype": (
        lambda s, d, m: (s, _with(d, 0, 0, d[0][0].half()), m),
        r"dst_caches\[0\] key cache is torch.float16",
    ),
    "blocks": (
        lambda s, d, m: (s, _with(d, 1, 1, torch.zeros(6, 2, 4, 8)), m),
        r"has 6 blocks, dst_caches\[0\] keys 7",
    ),
    "contiguous": (
        lambda s, d, m: (s, _with(d, 1, 0, torch.zeros(7, 4, 2, 8).transpose(1, 2)), m),
        r"dst_caches\[1\] key cache is not contiguous",
    ),
    "same cache": (lambda s, d, m: (s, [s[1], s[0]], m), "in both src_caches and dst_caches"),
    "mapping dtype": (lambda s, d, m: (s, d, m.int()), r"int64 \[N, 2\] tensor, got torch.int32"),
    "mapping shape": (
        lambda s, d, m: (s, d, m.view(-1)),
        r"int64 \[N, 2\] tensor, got torch.int64",
    ),
    "src range": (
        lambda s, d, m: (s, d, torch.tensor([[5, 1]])),
        r"src block ids 5..5 outside the src caches' 5 blocks \(0..4\)",
    ),
    "negative": (lambda s, d, m: (s, d, torch.tensor([[-1, 2]])), "src block ids -1..-1 outside"),
    "dst range": (
        lambda s, d, m: (s, d, torch.tensor([[0, 7]])),
        r"dst block ids 7..7 outside the dst caches' 7 blocks \(0..6\)",
    ),
    "duplicate dst": (
        lambda s, d, m: (s, d, torch.tensor([[0, 3], [1, 3], [2, 4]])),
        r"dst blocks \[3\] appear more than once",
    ),
}


@pytest.mark.parametrize("case", SWAP_REFUSALS)
def test_swap_blocks_refuses_before_copying(emulated_ops, reference_ops, case):
    make, message = SWAP_REFUSALS[case]
    good = _tier(2, 5, (2, 4, 8), torch.float32, 1), _tier(2, 7, (2, 4, 8), torch.float32, 2)
    src, dst, mapping = make(*good, torch.tensor([[0, 1], [4, 6]]))
    before = _clone(dst)
    for ops in (emulated_ops, reference_ops):
        with pytest.raises(ValueError, match=message):
            ops.swap_blocks(src, dst, mapping)
    assert _same(dst, before)


def test_swap_blocks_refuses_a_dtype_without_a_kernel(emulated_ops):
    src, dst = _tier(1, 3, (1, 2, 8), torch.float32, 3), _tier(1, 3, (1, 2, 8), torch.float32, 4)
    with pytest.raises(ValueError, match="float32, float16 and bfloat16"):
        emulated_ops.swap_blocks(
            [(c.to(torch.int8), c.to(torch.int8)) for c, _ in src],
            [(c.to(torch.int8), c.to(torch.int8)) for c, _ in dst],
            torch.tensor([[0, 1]]),
        )


def test_swap_blocks_on_cupy_refuses_pageable_host_memory():
    from ringllm.cuda.ops import CudaOps

    # Refused before CuPy or a device is needed, so this runs on any machine.
    src, dst = _tier(1, 3, (1, 2, 8), torch.float16, 5), _tier(1, 4, (1, 2, 8), torch.float16, 6)
    with pytest.raises(ValueError, match=r"src_caches\[0\] key cache is in pageable CPU memory"):
        CudaOps(backend="cupy").swap_blocks(src, dst, torch.tensor([[0, 1]]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_into_an_fp8_cache_rounds_as_torch_does(
    emulated_ops, reference_ops, dtype
):
    """Every float8 e4m3fn value, their midpoints (ties to even), values past 448 and below
    the smallest subnormal, each side of zero: bit for bit torch's conversion."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    mids = (codes[1:] + codes[:-1]) / 2
    values = torch.cat([codes, mids, mids * (1 + 2**-12), torch.tensor([500.0, 1e4, 2**-11])])
    values = torch.cat([values, -values]).to(dtype)
    n = -(-values.numel() // 64) * 64
    key = torch.cat([values, torch.zeros(n - values.numel(), dtype=dtype)]).view(-1, 1, 64)
    slots = torch.arange(key.shape[0] - 1, -1, -1)
    caches = [
        torch.zeros(-(-key.shape[0] // 4), 1, 4, 64, dtype=torch.float8_e4m3fn) for _ in range(4)
    ]
    reference_ops.reshape_and_cache(key, -key, caches[0], caches[1], slots)
    emulated_ops.reshape_and_cache(key, -key, caches[2], caches[3], slots)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


def test_fp8_blocks_copy_and_swap_as_bytes(emulated_ops, reference_ops):
    def fp8(seed):
        return _randn(5, 2, 4, 16, dtype=torch.float32, seed=seed).to(torch.float8_e4m3fn)

    caches = [fp8(s) for s in (1, 2)]
    expected = [c.clone() for c in caches]
    mapping = torch.tensor([[0, 3], [2, 1]])
    reference_ops.copy_blocks([expected[0]], [expected[1]], mapping)
    emulated_ops.copy_blocks([caches[0]], [caches[1]], mapping)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(caches, expected, strict=True)
    )
    dst = [(fp8(3), fp8(4))]
    emulated_ops.swap_blocks([(caches[0], caches[1])], dst, torch.tensor([[4, 0], [1, 2]]))
    for i in range(2):
        assert torch.equal(dst[0][i][0].view(torch.uint8), caches[i][4].view(torch.uint8))
        assert torch.equal(dst[0][i][2].view(torch.uint8), caches[i][1].view(torch.uint8))
