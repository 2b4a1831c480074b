"""CudaOps' own behaviour around the kernels: construction errors, empty batches, dtype
checks and the Kernel wrapper's argument rules (the same for CuPy and the emulator)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringllm.cuda.loader import Kernel, KernelLoader, read_source
from ringllm.cuda.ops import CudaOps, decode_tile_tokens, prefill_tiles
from ringllm.pipeline.ops.rope import cos_sin_cache


def test_construction_rejects_unknown_settings():
    with pytest.raises(ValueError, match="backend must be one of"):
        CudaOps(backend="opencl")
    with pytest.raises(ValueError, match="partition_mode must be one of"):
        CudaOps(backend="emulator", partition_mode="sometimes")
    with pytest.raises(ValueError, match="partition_tokens must be >= 1 token, got 0"):
        CudaOps(backend="emulator", partition_tokens=0)
    with pytest.raises(ValueError, match="unknown kernel family 'gemm'"):
        read_source("gemm")


def test_empty_batches_launch_nothing_and_keep_shapes(emulated_ops):
    x = torch.empty(0, 64)
    assert emulated_ops.rms_norm(x, torch.ones(64), 1e-6).shape == (0, 64)
    out, residual = emulated_ops.rms_norm(x, torch.ones(64), 1e-6, residual=x)
    assert out.shape == residual.shape == (0, 64)
    assert emulated_ops.silu_and_mul(torch.empty(0, 128)).shape == (0, 64)
    q, k = torch.empty(0, 4, 64), torch.empty(0, 2, 64)
    emulated_ops.rotary_embedding(
        torch.empty(0, dtype=torch.int64), q, k, cos_sin_cache(64, 8, 1e4, None)
    )
    cache = torch.zeros(2, 2, 16, 64)
    emulated_ops.reshape_and_cache(k, k, cache, cache.clone(), torch.empty(0, dtype=torch.int64))
    assert not cache.any()
    tables, lens = torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    assert emulated_ops.paged_attention_decode(q, cache, cache, tables, lens, 1.0).shape == (
        0,
        4,
        64,
    )
    loc = torch.zeros(1, dtype=torch.int32)
    assert emulated_ops.paged_attention_prefill(q, cache, cache, tables, loc, lens, 1.0).shape == (
        0,
        4,
        64,
    )


def test_unsupported_dtype_is_named(emulated_ops):
    with pytest.raises(
        ValueError, match="float32, float16 and bfloat16 tensors, got torch.float64"
    ):
        emulated_ops.silu_and_mul(torch.zeros(2, 8, dtype=torch.float64))


def test_rotary_checks_the_cache_layout(emulated_ops):
    q, k = torch.zeros(1, 2, 64), torch.zeros(1, 2, 64)
    with pytest.raises(ValueError, match=r"cos_sin_cache must be float32 \[max_positions, 64\]"):
        emulated_ops.rotary_embedding(torch.zeros(1, dtype=torch.int64), q, k, torch.zeros(8, 32))


def test_shared_memory_plans_fit_cuda_default_limit():
    assert decode_tile_tokens(num_groups=1, head_size=128) == 64
    assert decode_tile_tokens(num_groups=8, head_size=256) == 16
    with pytest.raises(ValueError, match="do not fit the kernel's shared memory"):
        decode_tile_tokens(num_groups=64, head_size=256)
    assert prefill_tiles(128)[:2] == (16, 16) and prefill_tiles(128)[2] <= 48 * 1024
    assert prefill_tiles(64)[:2] == (16, 32)


def test_cupy_kernel_wrapper_rejects_python_numbers_and_cpu_tensors():
    class FakeRawKernel:  # stands in for cupy.RawKernel: argument conversion happens first
        def __call__(self, *args, **kwargs):
            raise AssertionError("conversion should have failed before the launch")

    kernel = Kernel("k", FakeRawKernel(), backend="cupy")
    with pytest.raises(TypeError, match="argument 0: got float"):
        kernel._to_cupy(0, 1.5)
    with pytest.raises(TypeError, match="argument 1: expected a CUDA tensor, got cpu"):
        kernel._to_cupy(1, torch.zeros(1))
    assert kernel._to_cupy(2, np.int32(7)) == 7


def test_loader_compiles_each_family_once():
    loader = KernelLoader("emulator")
    first = loader.kernel("activation", "silu_and_mul_f32")
    assert loader.kernel("activation", "silu_and_mul_f32") is first
    assert loader._module("activation") is loader._module("activation")


def test_contexts_longer_than_their_block_table_are_refused(emulated_ops):
    cache = torch.zeros(4, 2, 16, 64)
    tables = torch.zeros(1, 2, dtype=torch.int32)  # room for 32 tokens
    lens = torch.tensor([33], dtype=torch.int32)
    message = "seq_lens reaches 33 tokens but block_tables holds 2 blocks of 16 = 32 tokens"
    with pytest.raises(ValueError, match=message):
        emulated_ops.paged_attention_decode(torch.zeros(1, 2, 64), cache, cache, tables, lens, 1.0)
    loc = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        emulated_ops.paged_attention_prefill(
            torch.zeros(1, 2, 64), cache, cache, tables, loc, lens, 1.0
        )
