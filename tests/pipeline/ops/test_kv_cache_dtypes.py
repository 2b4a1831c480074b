"""KV caches whose element type is not the activations' (`--kv-cache-dtype`): float8 e4m3fn
and 16-bit caches under float32 activations, on every CPU kernel set this machine runs.

Oracles: torch's own float -> float8_e4m3fn conversion (bit for bit, the cache write), float64
attention over the values the cache holds (the read: exact, so only float32 arithmetic is
left), and float64 attention over the unrounded keys and values (what the 8-bit cache costs).
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_ops import OUT_TOL, SHAPES, make_cache
from test_torch_ops import dense_kv, dense_reference

from ringllm.pipeline.ops import TorchOps
from ringllm.pipeline.ops.cpu import CpuOps, kernel_sets

FP8 = torch.float8_e4m3fn
ACT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=kernel_sets())
def ops(request):
    return CpuOps(request.param)


def every_fp8_edge() -> torch.Tensor:
    """Every e4m3fn value, the midpoints between neighbours (ties: to even), points just
    either side of them, values past 448 and below the smallest subnormal, and zeros."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # +0 .. 448 (0x7f is NaN)
    values = codes.view(FP8).double()
    mids = (values[1:] + values[:-1]) / 2
    edges = torch.cat(
        [
            values,
            mids,
            mids * (1 + 2**-12),
            mids * (1 - 2**-12),
            torch.tensor([449.0, 463.9, 464.0, 480.0, 1e4, 2**-10, 2**-11, 3 * 2**-11, -0.0]),
        ]
    )
    return torch.cat([edges, -edges]).float()


@pytest.mark.parametrize("dtype", ACT_DTYPES)
def test_the_fp8_write_rounds_as_torch_does(ops, dtype):
    # values of the activation dtype: the write converts them once, as torch's .to() does
    x = every_fp8_edge().to(dtype)
    n = -(-x.numel() // 32) * 32
    x = torch.cat([x, torch.zeros(n - x.numel(), dtype=dtype)]).view(-1, 2, 16)
    slots = torch.arange(x.shape[0], dtype=torch.int64).flip(0)
    num_blocks = -(-x.shape[0] // 8)
    caches = [torch.zeros(num_blocks, 2, 8, 16, dtype=FP8) for _ in range(4)]
    ops.reshape_and_cache(x, -x, caches[0], caches[1], slots)
    TorchOps().reshape_and_cache(x, -x, caches[2], caches[3], slots)
    bits = [c.view(torch.uint8) for c in caches]
    assert torch.equal(bits[0], bits[2]) and torch.equal(bits[1], bits[3])
    assert float(caches[0].float().abs().max()) == 448.0  # saturated, never NaN
    assert not caches[0].float().isnan().any()


def _fp8_caches(num_kv_heads, block_size, head_size, contexts, seed, spread=1.0):
    key_cache, value_cache, tables, gen = make_cache(
        num_kv_heads, block_size, head_size, contexts, torch.float32, seed=seed
    )
    return key_cache * spread, value_cache * spread, tables, gen


@pytest.mark.parametrize("act", ACT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_reads_an_fp8_cache_exactly(ops, shape, act):
    """The kernels read each fp8 value exactly: their output is float64 attention over the
    cache's own values, within the activation dtype's rounding."""
    num_heads, num_kv_heads, head_size, block_size = shape
    contexts = [1, block_size - 1, block_size + 1, 70]
    k32, v32, tables, gen = _fp8_caches(num_kv_heads, block_size, head_size, contexts, 3, 4.0)
    key_cache, value_cache = k32.to(FP8), v32.to(FP8)
    query = torch.randn(len(contexts), num_heads, head_size, generator=gen).to(act)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    out = ops.paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, 0.1)
    ref_ops = TorchOps().paged_attention_decode(
        query, key_cache, value_cache, tables, seq_lens, 0.1
    )
    assert out.dtype == act
    for r, n in enumerate(contexts):
        k, v = dense_kv(key_cache, tables[r], n), dense_kv(value_cache, tables[r], n)
        ref = dense_reference(query[r : r + 1], k, v, n - 1, 0.1)
        tol = 4 * OUT_TOL[act]  # values up to ~16 here
        assert torch.allclose(out[r : r + 1].double(), ref, atol=tol, rtol=OUT_TOL[act])
        # and never further from it than the torch reference over the same fp8 cache
        err = (out[r : r + 1].double() - ref).abs().max()
        assert err <= (ref_ops[r : r + 1].double() - ref).abs().max() + OUT_TOL[act]


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7])
def test_prefill_reads_an_fp8_cache_exactly(ops, act, window):
    num_heads, num_kv_heads, head_size, block_size = 9, 3, 64, 16
    contexts, q_lens = [9, 40, 17, 100], [9, 12, 1, 70]
    k32, v32, tables, gen = _fp8_caches(num_kv_heads, block_size, head_size, contexts, 4)
    key_cache, value_cache = k32.to(FP8), v32.to(FP8)
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(act)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    extra = {"sliding_window": window} if window else {}
    out = ops.paged_attention_prefill(
        query, key_cache, value_cache, tables, starts, seq_lens, 0.125, **extra
    )
    for r, (n, q_len) in enumerate(zip(contexts, q_lens, strict=True)):
        k, v = dense_kv(key_cache, tables[r], n), dense_kv(value_cache, tables[r], n)
        ref = dense_reference(query[starts[r] : starts[r + 1]], k, v, n - q_len, 0.125, window)
        got = out[starts[r] : starts[r + 1]].double()
        assert torch.allclose(got, ref, atol=OUT_TOL[act], rtol=OUT_TOL[act])


@pytest.mark.parametrize("cache", [torch.bfloat16, torch.float16])
def test_a_16_bit_cache_under_float32_activations(ops, cache):
    num_heads, num_kv_heads, head_size, block_size = 32, 4, 128, 32
    contexts = [5, 33, 64]
    k32, v32, tables, gen = _fp8_caches(num_kv_heads, block_size, head_size, contexts, 5)
    key_cache, value_cache = k32.to(cache), v32.to(cache)
    query = torch.randn(len(contexts), num_heads, head_size, generator=gen)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    out = ops.paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, 0.09)
    assert out.dtype == torch.float32
    for r, n in enumerate(contexts):
        k, v = dense_kv(key_cache, tables[r], n), dense_kv(value_cache, tables[r], n)
        ref = dense_reference(query[r : r + 1], k, v, n - 1, 0.09)
        assert torch.allclose(out[r : r + 1].double(), ref, atol=1e-5, rtol=1e-5)
    # the write under float32 activations rounds as torch's .to() does
    key = torch.randn(3, num_kv_heads, head_size, generator=gen)
    slots = torch.tensor([0, 40, 95])
    mine = [torch.zeros_like(key_cache) for _ in range(2)]
    theirs = [torch.zeros_like(key_cache) for _ in range(2)]
    ops.reshape_and_cache(key, key * 3, *mine, slots)
    TorchOps().reshape_and_cache(key, key * 3, *theirs, slots)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_what_the_fp8_cache_costs_attention(ops):
    """The stated tolerance (docs/performance.md, the KV cache's element type): keys and
    values of unit scale, rounded to e4m3 (3 mantissa bits: each within 1/16 of itself),
    move a decode's output (entries of about 0.1-1) by at most 0.12 and by 0.01 on average,
    against float64 attention over the unrounded values (measured: 0.082 and 0.0046); a
    bfloat16 cache moves it by 0.01 at most (0.0075, 0.0003)."""
    num_heads, num_kv_heads, head_size, block_size = 9, 3, 64, 16
    contexts = [16, 100, 512, 1000]
    k32, v32, tables, gen = _fp8_caches(num_kv_heads, block_size, head_size, contexts, 6)
    query = torch.randn(len(contexts), num_heads, head_size, generator=gen)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    scale = head_size**-0.5
    errors = {}
    for cache in (FP8, torch.bfloat16):
        out = ops.paged_attention_decode(
            query, k32.to(cache), v32.to(cache), tables, seq_lens, scale
        )
        worst, mean = 0.0, []
        for r, n in enumerate(contexts):
            ref = dense_reference(
                query[r : r + 1], dense_kv(k32, tables[r], n), dense_kv(v32, tables[r], n),
                n - 1, scale,
            )  # fmt: skip
            diff = (out[r : r + 1].double() - ref).abs()
            worst = max(worst, float(diff.max()))
            mean.append(float(diff.mean()))
        errors[cache] = (worst, sum(mean) / len(mean))
    assert errors[FP8][0] < 0.12 and errors[FP8][1] < 0.01, errors
    assert errors[torch.bfloat16][0] < 0.01, errors
    assert errors[FP8][1] > errors[torch.bfloat16][1]  # the test can tell the two apart
