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
    key = runner.kv_caches[0][0]
    assert key.dtype == runner.kv_dtype
    # the budget's bytes are the tensors' (an int8 cache's scales included)
    held = key.untyped_storage().nbytes() * 2 * len(runner.kv_caches)
    assert held == num_blocks * runner.kv_bytes_per_block <= BUDGET
    return num_blocks, runner.kv_dtype


def test_the_same_bytes_hold_twice_the_tokens_in_fp8(model_factory):
    model = model_factory()
    f32, f32_type = _blocks(model, "auto")
    bf16, bf16_type = _blocks(model, "bfloat16")
    fp8, fp8_type = _blocks(model, "fp8")
    assert (f32_type, bf16_type, fp8_type) == (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
    assert bf16 == 2 * f32 and fp8 == 2 * bf16
    assert _blocks(model, "fp8_e4m3") == (fp8, torch.float8_e4m3fn)


def test_int8_holds_as_many_tokens_as_fp8_less_its_scales(model_factory):
    model = model_factory()
    bf16, _ = _blocks(model, "bfloat16")
    int8, int8_type = _blocks(model, "int8")
    assert int8_type is torch.int8
    # 4 bytes of scale per block_size * head_size values: 1.6% at this model's 16 x 16,
    # 0.4% at the demo model's 16 x 64
    assert 1.96 * bf16 <= int8 < 2 * bf16


def test_what_the_flag_cannot_take_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype: 'int4' is not one of"):
        EngineConfig.from_kwargs(kv_cache_dtype="int4")
    assert kv_cache_dtype("auto", torch.bfloat16, "cuda") is torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16, "cuda") is torch.float8_e4m3fn
    # the CUDA kernels read a cache of the activations' own type, or fp8
    assert kv_cache_dtype("int8", torch.bfloat16, "cuda") is torch.int8
    with pytest.raises(ValueError, match="bfloat16 under float32 activations runs on the CPU"):
        kv_cache_dtype("bfloat16", torch.float32, "cuda")


def test_an_int8_model_computes_in_float32_and_keeps_the_checkpoints_cache(model_factory):
    """`--quantization int8` under `--dtype auto` on the CPU: float32 activations (so a step's
    layers run in one C call, models/decode_plan.py), the KV cache in the dtype the
    checkpoint would compute in here (bfloat16 where the CPU has bf16 instructions, else
    float32), the embedding in the checkpoint's, and an asked-for dtype kept as asked."""
    from ringllm.pipeline.worker.model_loader import load_arch_config, resolve_dtype

    model = model_factory(dtype="bfloat16")
    checkpoint_compute = resolve_dtype("auto", load_arch_config(model), "cpu")
    config = EngineConfig.from_kwargs(
        model=str(model), quantization="int8", kv_cache_memory_bytes=BUDGET
    )
    runner = ModelRunner(config)
    assert runner.dtype is torch.float32
    assert runner.kv_dtype is checkpoint_compute
    # the embedding stays bfloat16 (half the bytes); its rows are widened as looked up
    embed, ids = runner.model.embed, torch.tensor([3, 1, 4, 1, 5])
    assert embed.dtype is torch.bfloat16
    assert torch.equal(runner.model._embed(ids), embed.float()[ids])
    runner.initialize_kv_cache(runner.determine_num_blocks())
    assert runner.kv_caches[0][0].dtype is checkpoint_compute
    asked = ModelRunner(
        EngineConfig.from_kwargs(
            model=str(model), quantization="int8", dtype="bfloat16", kv_cache_memory_bytes=BUDGET
        )
    )
    assert asked.dtype is asked.kv_dtype is torch.bfloat16
