"""--kv-cache-dtype at the worker: the cache's element type, the blocks a byte budget holds,
and the clear errors for what the flag cannot take."""

from __future__ import annotations

import pytest
import torch

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.worker.model_runner import ModelRunner, kv_cache_dtype

BUDGET = 8 << 20  # bytes of KV cache


def _blocks(model, kv: str, dtype: str = "float32") -> tuple[int, torch.dtype]:
    config = EngineConfig.from_kwargs(
        model=str(model), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=BUDGET,
        max_num_seqs=512,
    )  # fmt: skip
    runner = ModelRunner(config)
    num_blocks = runner.determine_num_blocks()
    runner.initialize_kv_cache(num_blocks)
    assert runner.kv_caches[0][0].dtype == runner.kv_dtype
    assert (
        runner.kv_caches[0][0].numel() * runner.kv_dtype.itemsize * 2 * len(runner.kv_caches)
        == num_blocks * runner.kv_bytes_per_block
    )
    return num_blocks, runner.kv_dtype


def test_the_same_bytes_hold_twice_the_tokens_in_fp8(model_factory):
    model = model_factory()
    f32, f32_type = _blocks(model, "auto")
    bf16, bf16_type = _blocks(model, "bfloat16")
    fp8, fp8_type = _blocks(model, "fp8")
    assert (f32_type, bf16_type, fp8_type) == (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
    assert bf16 == 2 * f32 and fp8 == 2 * bf16
    assert _blocks(model, "fp8_e4m3") == (fp8, torch.float8_e4m3fn)


def test_what_the_flag_cannot_take_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype: 'int4' is not one of"):
        EngineConfig.from_kwargs(kv_cache_dtype="int4")
    assert kv_cache_dtype("auto", torch.bfloat16, "cuda") is torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16, "cuda") is torch.float8_e4m3fn
    # the CUDA kernels read a cache of the activations' own type, or fp8
    with pytest.raises(ValueError, match="bfloat16 under float32 activations runs on the CPU"):
        kv_cache_dtype("bfloat16", torch.float32, "cuda")
