"""The same comparisons on a real device: CudaOps through CuPy on CUDA tensors against
TorchOps. Skipped where there is no CUDA device (or no CuPy to launch with)."""

from __future__ import annotations

import math

import pytest
import torch

from ringllm.pipeline.ops import TorchOps
from ringllm.pipeline.ops.rope import cos_sin_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
DTYPES = tuple(TOLERANCES)
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def gpu_ops():
    pytest.importorskip("cupy", reason="needs CuPy (the gpu extra) to launch kernels")
    from ringllm.cuda.ops import CudaOps

    return CudaOps()


@pytest.fixture(scope="module")
def partitioned_gpu_ops(gpu_ops):
    from ringllm.cuda.ops import CudaOps

    return CudaOps(partition_tokens=64, partition_mode="always")


def _randn(*shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).cuda()


def _close(actual, expected):
    assert actual.device.type == "cuda"
    torch.testing.assert_close(actual, expected, **TOLERANCES[expected.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_activation_rotary_on_device(gpu_ops, dtype):
    ref = TorchOps()
    x, residual, weight = (
        _randn(9, 1000, dtype=dtype, seed=1),
        _randn(9, 1000, dtype=dtype, seed=2),
        _randn(1000, dtype=dtype, seed=3),
    )
    _close(gpu_ops.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))
    for actual, expected in zip(
        gpu_ops.rms_norm(x, weight, 1e-6, residual),
        ref.rms_norm(x, weight, 1e-6, residual),
        strict=True,
    ):
        _close(actual, expected)
    gate_up = _randn(9, 2 * 700, dtype=dtype, seed=4)
    _close(gpu_ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))
    cache = cos_sin_cache(128, 2048, 10000.0, None).cuda()
    positions = torch.tensor([0, 5, 2047, 9], device="cuda")
    q, k = _randn(4, 8, 128, dtype=dtype, seed=5), _randn(4, 2, 128, dtype=dtype, seed=6)
    q_ref, k_ref = q.clone(), k.clone()
    ref.rotary_embedding(positions, q_ref, k_ref, cache)
    gpu_ops.rotary_embedding(positions, q, k, cache)
    _close(q, q_ref)
    _close(k, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_ops_on_device(gpu_ops, dtype):
    ref = TorchOps()
    caches = [_randn(20, 2, BLOCK_SIZE, 64, dtype=dtype, seed=s) for s in (7, 8)]
    expected = [c.clone() for c in caches]
    key, value = _randn(5, 2, 64, dtype=dtype, seed=9), _randn(5, 2, 64, dtype=dtype, seed=10)
    slots = torch.tensor([0, -1, 17, 319, 40], device="cuda")
    ref.reshape_and_cache(key, value, *expected, slots)
    gpu_ops.reshape_and_cache(key, value, *caches, slots)
    mapping = torch.tensor([[0, 3], [5, 6]], device="cuda")
    ref.copy_blocks([expected[0]], [expected[1]], mapping)
    gpu_ops.copy_blocks([caches[0]], [caches[1]], mapping)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def _paged(seq_lens, num_kv_heads, head_size, dtype):
    per_seq = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    num_blocks = len(seq_lens) * per_seq + 1
    shape = (num_blocks, num_kv_heads, BLOCK_SIZE, head_size)
    tables = torch.randperm(num_blocks)[: len(seq_lens) * per_seq].view(len(seq_lens), per_seq)
    return (
        _randn(*shape, dtype=dtype, seed=11),
        _randn(*shape, dtype=dtype, seed=12),
        tables.int().cuda(),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_attention_on_device(gpu_ops, partitioned_gpu_ops, dtype, head_size, gqa):
    ref = TorchOps()
    seq_lens = [1, BLOCK_SIZE - 1, BLOCK_SIZE + 1, 700]
    key_cache, value_cache, tables = _paged(seq_lens, 2, head_size, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(head_size)
    query = _randn(len(seq_lens), 2 * gqa, head_size, dtype=dtype, seed=13)
    expected = ref.paged_attention_decode(query, key_cache, value_cache, tables, lens, scale)
    _close(
        gpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, scale), expected
    )
    _close(
        partitioned_gpu_ops.paged_attention_decode(
            query, key_cache, value_cache, tables, lens, scale
        ),
        expected,
    )
    q_lens = [1, BLOCK_SIZE - 1, BLOCK_SIZE + 1, 500]
    loc = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )
    prompt = _randn(sum(q_lens), 2 * gqa, head_size, dtype=dtype, seed=14)
    args = (prompt, key_cache, value_cache, tables, loc, lens, scale)
    _close(gpu_ops.paged_attention_prefill(*args), ref.paged_attention_prefill(*args))
