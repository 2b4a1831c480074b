"""reshape_and_cache, copy_blocks and swap_blocks in the CPU emulator against TorchOps
(exact copies), and swap_blocks' refusals; the int8 cache's write against
kv_int8.write_rows (its rule), and its blocks moving with their scales."""

from __future__ import annotations

import pytest
import torch

from ringllm.pipeline.ops import kv_int8

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
            [(c.to(torch.int16), c.to(torch.int16)) for c, _ in src],
            [(c.to(torch.int16), c.to(torch.int16)) for c, _ in dst],
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


# ---- an int8 KV cache (--kv-cache-dtype int8): kv_int8.py's rule and layout ---------------

INT8_BLOCK_SIZE = 4


def _int8_cache(
    num_blocks: int, kv_heads: int, head_size: int, seed: int, block_size: int = INT8_BLOCK_SIZE
) -> torch.Tensor:
    """An int8 cache (values and scales behind them) holding earlier writes: random values
    and small scales, which the rows written later grow."""
    cache = kv_int8.new_cache((num_blocks, kv_heads, block_size, head_size), torch.int8, "cpu")
    generator = torch.Generator().manual_seed(seed)
    cache.copy_(torch.randint(-127, 128, cache.shape, generator=generator, dtype=torch.int8))
    kv_int8.kv_scales(cache).copy_(torch.rand(num_blocks, kv_heads, generator=generator) * 1e-2)
    return cache


def _int8_clone(cache: torch.Tensor) -> torch.Tensor:
    twin = kv_int8.new_cache(tuple(cache.shape), torch.int8, "cpu")
    twin.copy_(cache)
    kv_int8.kv_scales(twin).copy_(kv_int8.kv_scales(cache))
    return twin


def _int8_equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.equal(actual, expected) and torch.equal(
        kv_int8.kv_scales(actual), kv_int8.kv_scales(expected)
    )


def _slots(*runs: tuple[int, list[int]]) -> list[int]:
    """Slots of (block, rows) runs, in order; a block of -1 gives that many -1 slots."""
    return [
        block * INT8_BLOCK_SIZE + row if block >= 0 else -1 for block, rows in runs for row in rows
    ]


# A prefill batch: request A's chunk after a prefix that ends mid-block (block 5's rows 2, 3),
# a whole block (1, a -1 inside its run) and part of one (6); request B's chunk (block 3's
# rows 0..2); -1 padding. Then a decode batch: A's next token at block 6's row 3, B's at
# block 3's row 3, padding. `grow` (token, factor): rows whose larger max raises their
# block's scale, re-rounding the rows before them (A's decode token grows block 6).
INT8_STEPS = [
    {
        "slots": _slots((5, [2, 3]), (1, [0, 1]), (-1, [0]), (1, [2, 3]), (6, [0, 1, 2]),
                        (3, [0, 1, 2]), (-1, [0, 0])),
        "grow": {1: 3.0, 5: 4.0, 8: 2.5, 11: 5.0},
    },
    {"slots": _slots((6, [3]), (3, [3]), (-1, [0])), "grow": {0: 10.0, 1: 0.1}},
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [2, 5])
def test_reshape_and_cache_into_an_int8_cache_follows_the_write_rule(emulated_ops, dtype, kv_heads):
    """Bit for bit kv_int8.write_rows: the int8 values and the float32 scales, a prefill
    chunk over several blocks in part, then a decode write that grows a block's scale. 5
    heads: 10 (cache, head) pairs over a CTA's 8 warps; head size 36: lanes 0..3 own 2
    columns each."""
    head_size, num_blocks = 36, 8
    expected = [_int8_cache(num_blocks, kv_heads, head_size, seed) for seed in (1, 2)]
    caches = [_int8_clone(c) for c in expected]
    for step, case in enumerate(INT8_STEPS):
        slots = torch.tensor(case["slots"])
        kv = _randn(len(slots), 2, kv_heads, head_size, dtype=torch.float32, seed=10 + step)
        for token, factor in case["grow"].items():
            kv[token] *= factor
        key, value = kv.to(dtype).unbind(1)  # views: a token stride of two tokens' heads
        before = kv_int8.kv_scales(expected[0])[6].clone()
        for cache, rows in zip(expected, (key, value), strict=True):
            kv_int8.write_rows(cache, rows, slots)
        emulated_ops.reshape_and_cache(key, value, *caches, slots)
        assert _int8_equal(caches[0], expected[0]) and _int8_equal(caches[1], expected[1])
    # the decode step did grow block 6's scale (and re-round its rows 0..2)
    assert bool((kv_int8.kv_scales(expected[0])[6] > before).all())


def test_int8_cache_write_of_zero_rows_keeps_a_zero_scale(emulated_ops):
    """A zero row starting a block: scale 0, values 0; a later zero row leaves them so."""
    caches = [_int8_cache(2, 1, 8, seed) for seed in (3, 4)]
    zeros = torch.zeros(2, 1, 8)
    emulated_ops.reshape_and_cache(zeros, zeros, *caches, torch.tensor([4, 5]))
    for cache in caches:
        assert float(kv_int8.kv_scales(cache)[1, 0]) == 0.0
        assert not cache[1, 0, :2].any()


def _int8_tier(num_layers: int, num_blocks: int, block_size: int, seed: int):
    return [
        tuple(_int8_cache(num_blocks, 2, 4, seed + 2 * i + j, block_size) for j in (0, 1))
        for i in range(num_layers)
    ]


def _int8_tier_clone(tier):
    return [tuple(_int8_clone(c) for c in pair) for pair in tier]


def _int8_tiers_equal(actual, expected) -> bool:
    return all(
        _int8_equal(a, e)
        for pair_a, pair_e in zip(actual, expected, strict=True)
        for a, e in zip(pair_a, pair_e, strict=True)
    )


def test_int8_copy_blocks_moves_the_scales(emulated_ops, reference_ops):
    caches = [_int8_cache(6, 2, 8, seed) for seed in range(4)]  # 2 layers' keys, values
    expected = [_int8_clone(c) for c in caches]
    mapping = torch.tensor([[0, 5], [3, 1], [3, 2]])
    reference_ops.copy_blocks(expected[:2], expected[2:], mapping)
    emulated_ops.copy_blocks(caches[:2], caches[2:], mapping)
    assert all(_int8_equal(a, e) for a, e in zip(caches, expected, strict=True))
    assert torch.equal(kv_int8.kv_scales(caches[3])[2], kv_int8.kv_scales(caches[3])[3])


@pytest.mark.parametrize(
    ("block_size", "values_kernel"), [(4, "swap_blocks_b16"), (3, "swap_blocks_u8")]
)
def test_int8_swap_blocks_moves_the_scales(
    emulated_ops, reference_ops, swap_kernels, block_size, values_kernel
):
    """Out to a larger tier and back (the scales sit after a different number of blocks on
    each side); blocks of 2 * 4 * 4 bytes go 16 at a time, of 2 * 3 * 4 bytes one by one."""
    device, host = _int8_tier(2, 5, block_size, 30), _int8_tier(2, 9, block_size, 40)
    for src, dst, mapping in (
        (device, host, torch.tensor([[0, 8], [3, 0], [4, 5]])),
        (host, device, torch.tensor([[8, 1], [2, 4]])),
    ):
        expected = _int8_tier_clone(dst)
        reference_ops.swap_blocks(src, expected, mapping)
        emulated_ops.swap_blocks(src, dst, mapping)
        assert _int8_tiers_equal(dst, expected)
    assert torch.equal(kv_int8.kv_scales(device[1][1])[1], kv_int8.kv_scales(host[1][1])[8])
    assert swap_kernels == [values_kernel, "copy_block_scales"] * 2


def test_int8_caches_without_their_scales_are_refused(emulated_ops):
    """The kernels read and write past an int8 cache's values: a bare int8 tensor (no
    scales behind it) is refused by every op before a launch."""
    bare = [torch.zeros(3, 1, INT8_BLOCK_SIZE, 8, dtype=torch.int8) for _ in range(2)]
    good = [_int8_cache(3, 1, 8, seed) for seed in (5, 6)]
    message = "must be a KV cache made by kv_int8.new_cache"
    rows = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match=f"reshape_and_cache: .*{message}"):
        emulated_ops.reshape_and_cache(rows, rows, *bare, torch.tensor([0]))
    with pytest.raises(ValueError, match=f"copy_blocks: .*{message}"):
        emulated_ops.copy_blocks([good[0]], [bare[0]], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=f"swap_blocks: .*{message}"):
        emulated_ops.swap_blocks([tuple(good)], [tuple(bare)], torch.tensor([[0, 1]]))
