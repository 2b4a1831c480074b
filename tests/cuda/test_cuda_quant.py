"""The GGUF quantized-matrix kernels (cuda/quant_matmul.cu) through the CPU emulator:
dequantize bit-exact against gguf.quants.dequantize for every block type, the decode
GEMV against a float64 product of the dequantized weight within float32 summation
bounds, shards as views, the prefill path, the wrapper's refusals, and the same
comparisons through CuPy on a real GPU (the nvcc / NVRTC compile check of the source:
test_cuda_compile.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ringllm.cuda.emulator import THREAD_ORDERS
from ringllm.cuda.quant import BLOCK_FORMATS, CudaQuantOps, block_format, quant_gemv

QTYPES = tuple(BLOCK_FORMATS)  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K
# Where the float16 scales sit in a block of the types gguf cannot quantize.
K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.fixture(scope="module", params=THREAD_ORDERS)
def quant_ops(request) -> CudaQuantOps:
    return CudaQuantOps(backend="emulator", thread_order=request.param)


def make_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Valid [n, row_bytes] blocks: gguf's own quantizer where it has one, else random
    bytes with finite float16 scales (every byte pattern of the quants is valid)."""
    rng = np.random.default_rng(seed)
    if qtype not in K_SCALE_OFFSETS:
        weight = rng.standard_normal((n, k)).astype(np.float32)
        return gguf_quantize(weight, GGMLQuantizationType[qtype])
    fmt = BLOCK_FORMATS[qtype]
    blocks = rng.integers(0, 256, (n, k // fmt.block_elems, fmt.block_bytes), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(blocks.shape[:2]) * 0.05).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(n, -1)


def reference_weight(blocks: np.ndarray, qtype: str) -> np.ndarray:
    return gguf_dequantize(np.ascontiguousarray(blocks), GGMLQuantizationType[qtype])


def assert_within_summation_bound(actual, weight, x, out_dtype):
    """|y - y64| <= gamma_k sum|w||x| + u_out (|y64| + gamma_k sum|w||x|): float32 sums
    of k exact products, then one rounding to the output dtype."""
    w64, x64 = torch.from_numpy(weight).double(), x.double()
    exact = x64 @ w64.T
    k = weight.shape[1]
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    magnitude = x64.abs() @ w64.abs().T
    bound = gamma * magnitude + UNIT_ROUNDOFF[out_dtype] * (exact.abs() + gamma * magnitude)
    error = (actual.double() - exact).abs()
    assert actual.dtype == out_dtype
    assert (error <= bound + 1e-30).all(), f"max excess {(error - bound).max().item():.3e}"


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_is_bit_exact_against_gguf(quant_ops, qtype):
    k = 512
    blocks = make_blocks(qtype, 5, k, seed=1)
    expected = reference_weight(blocks, qtype)
    actual = quant_ops.dequantize(torch.from_numpy(blocks), qtype, 5, k).numpy()
    assert actual.dtype == np.float32
    np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_to_16_bits_rounds_the_exact_value_once(quant_ops, qtype, dtype):
    blocks = make_blocks(qtype, 3, 256, seed=2)
    expected = torch.from_numpy(reference_weight(blocks, qtype)).to(dtype)
    actual = quant_ops.dequantize(torch.from_numpy(blocks), qtype, 3, 256, dtype)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_matches_a_float64_product(quant_ops, qtype, m):
    n, k = 6, 512  # 6 rows: the second CTA of 4 warps has two idle warps
    blocks = make_blocks(qtype, n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    actual = quant_ops.quant_gemv(x, torch.from_numpy(blocks), qtype, n, k)
    assert_within_summation_bound(actual, reference_weight(blocks, qtype), x, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_gemv_on_16_bit_activations(quant_ops, qtype, dtype):
    n, k, m = 5, 256, 8
    blocks = make_blocks(qtype, n, k, seed=5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(dtype)
    actual = quant_ops.quant_gemv(x, torch.from_numpy(blocks), qtype, n, k)
    assert_within_summation_bound(actual, reference_weight(blocks, qtype), x.float(), dtype)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_K"])
def test_row_and_column_shards_are_read_as_views(quant_ops, qtype):
    fmt = block_format(qtype)
    n, k = 6, 2 * 256
    blocks = torch.from_numpy(make_blocks(qtype, n, k, seed=7))
    weight = reference_weight(blocks.numpy(), qtype)
    half_bytes, half_k = fmt.row_bytes(k // 2), k // 2
    column_shard = blocks[1:5, half_bytes:]  # rows 1..4, the second half of the columns
    assert not column_shard.is_contiguous()
    deq = quant_ops.dequantize(column_shard, qtype, 4, half_k).numpy()
    np.testing.assert_array_equal(deq, weight[1:5, half_k:])
    x = torch.randn(2, half_k, generator=torch.Generator().manual_seed(8))
    y = quant_ops.quant_gemv(x, column_shard, qtype, 4, half_k)
    assert_within_summation_bound(y, weight[1:5, half_k:], x, torch.float32)


def test_gemv_writes_into_out_and_reads_a_strided_x(quant_ops):
    n, k = 3, 64
    blocks = torch.from_numpy(make_blocks("Q4_1", n, k, seed=16))
    wide = torch.randn(2, 2 * k, generator=torch.Generator().manual_seed(17))
    x = wide[:, ::2]  # a strided view: the wrapper hands the kernel a contiguous copy
    out = torch.full((2, 5), -3.0)
    quant_ops.quant_gemv(x, blocks, "Q4_1", n, k, out=out[:, 1:4])
    assert_within_summation_bound(
        out[:, 1:4], reference_weight(blocks.numpy(), "Q4_1"), x, torch.float32
    )
    assert (out[:, 0] == -3).all() and (out[:, 4] == -3).all()


def test_dequantize_writes_into_a_tile_of_a_wider_buffer(quant_ops):
    blocks = make_blocks("Q4_0", 4, 64, seed=9)
    buffer = torch.full((4, 96), -7.0)
    quant_ops.dequantize(torch.from_numpy(blocks), "Q4_0", 4, 64, out=buffer[:, 16:80])
    np.testing.assert_array_equal(buffer[:, 16:80].numpy(), reference_weight(blocks, "Q4_0"))
    assert (buffer[:, :16] == -7).all() and (buffer[:, 80:] == -7).all()


def test_quant_linear_takes_the_gemv_for_few_rows_and_tiles_for_many(quant_ops):
    n, k = 7, 256
    blocks = torch.from_numpy(make_blocks("Q4_K", n, k, seed=10))
    weight = torch.from_numpy(reference_weight(blocks.numpy(), "Q4_K"))
    generator = torch.Generator().manual_seed(11)
    few = torch.randn(2, 4, k, generator=generator)  # 8 rows: the GEMV
    assert torch.equal(
        quant_ops.quant_linear(few, blocks, "Q4_K", n, k),
        quant_ops.quant_gemv(few.view(8, k), blocks, "Q4_K", n, k).view(2, 4, n),
    )
    many = torch.randn(12, k, generator=generator)
    tile_bytes = 3 * k * 4  # tiles of 3 weight rows: 3 + 3 + 1
    actual = quant_ops.quant_linear(many, blocks, "Q4_K", n, k, tile_bytes=tile_bytes)
    assert_within_summation_bound(actual, weight.numpy(), many, torch.float32)


def test_module_functions_run_cpu_tensors_on_the_emulator():
    blocks = make_blocks("Q8_0", 2, 32, seed=12)
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(13))
    actual = quant_gemv(x, torch.from_numpy(blocks), GGMLQuantizationType.Q8_0, 2, 32)
    assert_within_summation_bound(actual, reference_weight(blocks, "Q8_0"), x, torch.float32)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda o, b, x: o.quant_gemv(x, b, "Q2_K", 2, 64), "'Q2_K' has no CUDA kernel"),
        (lambda o, b, x: o.quant_gemv(x, b, "Q4_0", 2, 48), "multiple of its 32-element"),
        (lambda o, b, x: o.quant_gemv(x, b, "Q8_0", 2, 64), r"must have shape \(2, 68\)"),
        (lambda o, b, x: o.quant_gemv(x, b.float(), "Q4_0", 2, 64), "2-D uint8"),
        (lambda o, b, x: o.quant_gemv(x[:, :32], b, "Q4_0", 2, 64), r"x \[m, k=64\]"),
        (lambda o, b, x: o.quant_gemv(x.repeat(9, 1), b, "Q4_0", 2, 64), "m <= 8 rows"),
        (lambda o, b, x: o.quant_gemv(x.double(), b, "Q4_0", 2, 64), "x must be float32"),
        (lambda o, b, x: o.quant_gemv(x, b.t().contiguous().t(), "Q4_0", 2, 64), "contiguously"),
    ],
)
def test_wrapper_refuses_bad_shapes_with_a_clear_error(call, message):
    ops = CudaQuantOps(backend="emulator")
    blocks = torch.zeros(2, 36, dtype=torch.uint8)  # Q4_0 [2, 64]: 2 blocks of 18 bytes
    with pytest.raises(ValueError, match=message):
        call(ops, blocks, torch.zeros(1, 64))


# (the source compiling for sm_80 / sm_90 with NVRTC and nvcc: tests/cuda/test_cuda_compile.py)


# ---- the same checks on a real device ----

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gpu_quant_ops() -> CudaQuantOps:
    pytest.importorskip("cupy", reason="needs CuPy (the gpu extra) to launch kernels")
    return CudaQuantOps()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_dequantize_and_gemv(gpu_quant_ops, qtype, dtype):
    n, k = 300, 1024
    blocks = make_blocks(qtype, n, k, seed=14)
    weight = reference_weight(blocks, qtype)
    device_blocks = torch.from_numpy(blocks).cuda()
    deq = gpu_quant_ops.dequantize(device_blocks, qtype, n, k).cpu().numpy()
    np.testing.assert_array_equal(deq.view(np.uint32), weight.view(np.uint32))
    for m in (1, 3, 8):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        y = gpu_quant_ops.quant_gemv(x.cuda(), device_blocks, qtype, n, k).cpu()
        assert_within_summation_bound(y, weight, x.float(), dtype)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(15)).to(dtype)
    y = gpu_quant_ops.quant_linear(x.cuda(), device_blocks, qtype, n, k).float().cpu()
    expected = x.float() @ torch.from_numpy(weight).to(dtype).float().T
    torch.testing.assert_close(y, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
