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


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_attention_on_device(gpu_ops, partitioned_gpu_ops, dtype):
    """Windows of one key, inside a block, across partitions, and past every context."""
    ref = TorchOps()
    seq_lens = [1, BLOCK_SIZE + 1, 300, 700]
    key_cache, value_cache, tables = _paged(seq_lens, 2, 128, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    query = _randn(len(seq_lens), 8, 128, dtype=dtype, seed=15)
    q_lens = [1, BLOCK_SIZE, 200, 500]  # the last two after a cached prefix of 100 and 200
    loc = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )
    prompt = _randn(sum(q_lens), 8, 128, dtype=dtype, seed=16)
    for window in (1, 5, 100, 1000):
        decode_args = (query, key_cache, value_cache, tables, lens, 1 / math.sqrt(128))
        expected = ref.paged_attention_decode(*decode_args, sliding_window=window)
        for ops in (gpu_ops, partitioned_gpu_ops):
            _close(ops.paged_attention_decode(*decode_args, sliding_window=window), expected)
        prefill_args = (prompt, key_cache, value_cache, tables, loc, lens, 1 / math.sqrt(128))
        _close(
            gpu_ops.paged_attention_prefill(*prefill_args, sliding_window=window),
            ref.paged_attention_prefill(*prefill_args, sliding_window=window),
        )


def _pinned_tier(num_layers, num_blocks, dtype, seed, device):
    """(keys, values) per layer: on the GPU, or in pinned host memory (device "cpu")."""
    caches = []
    for i in range(num_layers):
        pair = []
        for j in (0, 1):
            generator = torch.Generator().manual_seed(seed + 2 * i + j)
            cache = torch.randn(num_blocks, 2, BLOCK_SIZE, 64, generator=generator).to(dtype)
            pair.append(cache.pin_memory() if device == "cpu" else cache.to(device))
        caches.append(tuple(pair))
    return caches


def _on_cpu(caches):
    return [tuple(c.cpu() for c in pair) for pair in caches]


def _same(actual, expected):
    return all(
        torch.equal(a.cpu(), e.cpu())
        for pa, pe in zip(actual, expected, strict=True)
        for a, e in zip(pa, pe, strict=True)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stream_kind", ["current", "torch", "cupy"])
def test_swap_blocks_between_pinned_host_and_device(gpu_ops, dtype, stream_kind):
    """The kernel reads and writes pinned host memory through unified addressing, on a
    side stream the caller then waits on with an event, as a step would."""
    import cupy

    ref = TorchOps()
    device = _pinned_tier(3, 20, dtype, seed=20, device="cuda")
    host = _pinned_tier(3, 50, dtype, seed=40, device="cpu")
    stream = {
        "current": None,
        "torch": torch.cuda.Stream(),
        "cupy": cupy.cuda.Stream(non_blocking=True),
    }[stream_kind]
    done = torch.cuda.Event()
    out = torch.tensor([[0, 49], [7, 3], [19, 20], [7, 0]])
    back = torch.tensor([[49, 1], [3, 2], [20, 19], [11, 5]])
    within = torch.tensor([[1, 0], [2, 6]])
    other_device = _pinned_tier(3, 8, dtype, seed=60, device="cuda")
    for src, dst, mapping in (
        (device, host, out),
        (host, device, back),
        (device, other_device, within),
    ):
        expected = _on_cpu(dst)
        ref.swap_blocks(_on_cpu(src), expected, mapping)
        torch.cuda.synchronize()  # the caches were written on the current stream
        gpu_ops.swap_blocks(src, dst, mapping, stream=stream)
        if stream_kind == "cupy":
            done = torch.cuda.ExternalStream(stream.ptr).record_event()
        else:
            done.record(stream or torch.cuda.current_stream())
        torch.cuda.current_stream().wait_event(done)
        done.synchronize()
        assert _same(dst, expected)


def test_swap_blocks_on_device_takes_unaligned_caches_and_refuses_what_it_cannot_reach(gpu_ops):
    ref = TorchOps()
    # 2 * 16 * 5 float16 elements: a block of 320 bytes, but the host cache starts 2 bytes in
    flat = torch.zeros(9 * 160 + 1, dtype=torch.float16).pin_memory()
    host = [
        (flat[1:].view(9, 2, 16, 5), torch.zeros(9, 2, 16, 5, dtype=torch.float16).pin_memory())
    ]
    device = [tuple(_randn(4, 2, 16, 5, dtype=torch.float16, seed=s) for s in (70, 71))]
    mapping = torch.tensor([[3, 8], [0, 0]])
    expected = _on_cpu(host)
    ref.swap_blocks(_on_cpu(device), expected, mapping)
    gpu_ops.swap_blocks(device, host, mapping)
    torch.cuda.synchronize()
    assert _same(host, expected)
    pageable = [tuple(torch.zeros(9, 2, 16, 5, dtype=torch.float16) for _ in (0, 1))]
    with pytest.raises(ValueError, match=r"dst_caches\[0\] key cache is in pageable CPU memory"):
        gpu_ops.swap_blocks(device, pageable, mapping)
    with pytest.raises(ValueError, match="must include CUDA ones"):
        gpu_ops.swap_blocks(host, [tuple(c.pin_memory() for c in pageable[0])], mapping)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_moe_experts_on_device(gpu_ops, dtype, num_tokens, activation):
    """moe.cu against TorchOps' loop over the experts (8 of them, 2 per token; H and I
    not multiples of a warp), bit-identical on a repeat; MoeWeights.forward through it."""
    from ringllm.pipeline.models.moe import MoeWeights

    ref = TorchOps()
    num_experts, top_k, hidden, intermediate = 8, 2, 264, 200
    h = _randn(num_tokens, hidden, dtype=dtype, seed=80)
    router = _randn(num_experts, hidden, dtype=dtype, seed=81)
    w_gate_up = _randn(num_experts, 2 * intermediate, hidden, dtype=dtype, seed=82) * hidden**-0.5
    w_down = _randn(num_experts, hidden, intermediate, dtype=dtype, seed=83) * intermediate**-0.5
    probs = torch.softmax(h @ router.T, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    args = (h, weights.to(dtype), experts, w_gate_up, w_down, activation)
    out = gpu_ops.moe_experts(*args)
    _close(out, ref.moe_experts(*args))
    assert torch.equal(gpu_ops.moe_experts(*args), out)
    moe = MoeWeights(
        router, [w.clone() for w in w_gate_up], [w.clone() for w in w_down], top_k, True
    )
    expected = moe.forward(ref, h)
    _close(moe.forward(gpu_ops, h), expected)
    assert moe.stacked is not None and moe.stacked.dense
