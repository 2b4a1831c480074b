"""rms_norm (plain and fused with the residual add), silu_and_mul and rotary_embedding:
the kernels in the CPU emulator against TorchOps, in both thread orders and all dtypes."""

from __future__ import annotations

import pytest
import torch

from ringllm.pipeline.ops.rope import cos_sin_cache

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [1, 100, 1100])  # < a warp, odd, > the block
def test_rms_norm_matches_reference(emulated_ops, reference_ops, assert_close, dtype, hidden_size):
    x = _randn(2, 3, hidden_size, dtype=dtype, seed=1) * 3
    weight = _randn(hidden_size, dtype=dtype, seed=2)
    expected = reference_ops.rms_norm(x, weight, 1e-6)
    assert_close(emulated_ops.rms_norm(x, weight, 1e-6), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_returns_norm_and_new_residual(
    emulated_ops, reference_ops, assert_close, dtype
):
    x, residual = _randn(5, 300, dtype=dtype, seed=3), _randn(5, 300, dtype=dtype, seed=4)
    weight = _randn(300, dtype=dtype, seed=5)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = emulated_ops.rms_norm(x, weight, 1e-5, residual=residual)
    expected_out, expected_residual = reference_ops.rms_norm(x, weight, 1e-5, residual=residual)
    assert_close(out, expected_out)
    assert torch.equal(new_residual, expected_residual)  # x + residual, rounded once: exact
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_rejects_a_weight_of_another_dtype(emulated_ops):
    with pytest.raises(ValueError, match="weight must have dtype torch.float16"):
        emulated_ops.rms_norm(torch.ones(2, 8, dtype=torch.float16), torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate_size", [7, 600])
def test_silu_and_mul_matches_reference(
    emulated_ops, reference_ops, assert_close, dtype, intermediate_size
):
    x = _randn(3, 2, 2 * intermediate_size, dtype=dtype, seed=6) * 4
    assert_close(emulated_ops.silu_and_mul(x), reference_ops.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_matches_reference(emulated_ops, reference_ops, assert_close, dtype):
    x = _randn(3, 2, 2 * 600, dtype=dtype, seed=16) * 4
    assert_close(emulated_ops.gelu_tanh_and_mul(x), reference_ops.gelu_tanh_and_mul(x))


ROPE_SCALINGS = {
    "default": None,
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
def test_rotary_embedding_matches_reference(
    emulated_ops, reference_ops, assert_close, dtype, head_size, scaling
):
    cache = cos_sin_cache(head_size, 4096, 500000.0, ROPE_SCALINGS[scaling])
    positions = torch.tensor([0, 1, 17, 4095, 300, 5, 5])
    # q and k as views of one fused projection: a token stride wider than the heads.
    qkv = _randn(7, (4 + 2 + 2) * head_size, dtype=dtype, seed=7)
    query = qkv[:, : 4 * head_size].view(7, 4, head_size)
    key = qkv[:, 4 * head_size : 6 * head_size].view(7, 2, head_size)
    value_before = qkv[:, 6 * head_size :].clone()
    expected_q, expected_k = query.clone(), key.clone()
    reference_ops.rotary_embedding(positions, expected_q, expected_k, cache)
    emulated_ops.rotary_embedding(positions, query, key, cache)
    assert_close(query, expected_q)
    assert_close(key, expected_k)
    assert torch.equal(qkv[:, 6 * head_size :], value_before)  # the stride was honoured


def test_rotary_embedding_rotates_a_non_contiguous_view_in_place(
    emulated_ops, reference_ops, assert_close
):
    cache = cos_sin_cache(64, 32, 10000.0, None)
    positions = torch.arange(5)
    query = _randn(4, 5, 64, dtype=torch.float32, seed=8).transpose(
        0, 1
    )  # [5, 4, 64], heads strided
    key = _randn(5, 1, 64, dtype=torch.float32, seed=9)
    expected_q, expected_k = query.clone(), key.clone()
    reference_ops.rotary_embedding(positions, expected_q, expected_k, cache)
    emulated_ops.rotary_embedding(positions, query, key, cache)
    assert_close(query, expected_q)
    assert_close(key, expected_k)
