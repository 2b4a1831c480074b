"""Builds a model from a Hugging Face folder: config, architecture, dtype, weights.

`resolve_model_path(None)` is the demo model's GGUF (fetched on first use); a
missing folder, an unknown architecture, a context longer than the model allows, or a
bad weight file are errors that name what is wrong. `stage` (pipeline parallelism,
models/stages.py) builds one pipeline stage: only its layers, read from the files.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ringllm.pipeline.config import ModelConfig
from ringllm.pipeline.models.gguf_model import resolve_model_path, view_gguf_file
from ringllm.pipeline.models.gguf_weights import GGUFWeightSource
from ringllm.pipeline.models.hf_config import ArchConfig, load_arch_config, torch_dtype
from ringllm.pipeline.models.linear import weight_dtype
from ringllm.pipeline.models.quant_weights import BF16_TILES, bf16_tiles_here
from ringllm.pipeline.models.registry import model_class
from ringllm.pipeline.models.stages import StageInfo, pipeline_stages
from ringllm.pipeline.models.weights import RandomWeights, WeightSource
from ringllm.pipeline.ops import Ops
from ringllm.pipeline.ops.cpu_features import cpu_features

logger = logging.getLogger(__name__)


def resolve_quantization(config: ModelConfig, path: Path) -> str | None:
    """How the matrices are held: "gguf" (a GGUF's blocks, as they are: the default for a
    GGUF unless a dtype is asked for, which dequantizes them at load), "int8" (asked for),
    or None (the checkpoint's dtype)."""
    if view_gguf_file(path) is not None:
        if config.quantization == "int8":
            raise ValueError(
                "quantization: int8 quantizes a 16- or 32-bit checkpoint; a GGUF's matrices "
                "are already quantized (run it as it is, or pass --dtype to dequantize it)"
            )
        return "gguf" if config.dtype == "auto" else None
    return config.quantization


def bf16_tiles_apply(
    config: ModelConfig, arch: ArchConfig, dtype: torch.dtype, on_cpu: bool, quantization
) -> bool:
    """Whether a bfloat16 checkpoint run as `auto` picks (bfloat16 on a CPU with bf16
    arithmetic) takes the AMX tile unit's layout instead (models/quant_weights.py
    BF16_TILES, bf16_tiles_here). An asked-for dtype is kept."""
    if not (
        on_cpu
        and config.dtype == "auto"
        and quantization is None
        and arch.dtype == torch.bfloat16
        and dtype == torch.bfloat16
    ):
        return False
    return bf16_tiles_here()


# the layouts whose matrix products round their float32 activations to bfloat16 or coarser
# (int8 weights and the bf16 tiles on the tile unit, GGUF blocks against int8 rows)
ROUNDED_PRODUCTS = ("int8", "gguf", BF16_TILES)


def attention_tiles_here(ops) -> bool:
    """Whether `ops` can run attention on the AMX tile unit (cpu_kernels' avx512bf16 set,
    csrc/attention_tiles.h): the process owns the tile unit and its quantized products run
    there too (RINGLLM_QUANT_KERNELS, RINGLLM_CPU_ISA and RINGLLM_CPU_KERNELS rule it out).
    `load_model` turns it on for a model in ROUNDED_PRODUCTS, whose attention may round its
    query rows and softmax weights to bfloat16 as its products round their rows; an exact
    float32 or bfloat16 model keeps the vector kernels. The ops are the worker's: a draft
    model loaded after a quantized one shares the choice."""
    if getattr(ops, "kernel_set", None) != "avx512bf16" or not hasattr(ops, "attention_tiles"):
        return False
    from ringllm.pipeline.ops import cpu_kernels
    from ringllm.pipeline.ops.quant import bf16_tiles_available

    return cpu_kernels.attention_tiles_usable() and bf16_tiles_available()


def resolve_dtype(requested: str, arch: ArchConfig, device: str) -> torch.dtype:
    """`auto` keeps the checkpoint's dtype on a GPU. On the CPU it asks the CPU: a bfloat16
    (or float16) checkpoint runs in that dtype only where the CPU computes in it natively,
    else in float32 (weights widened once at load; bf16 products without bf16 instructions
    run ~5x slower than float32 ones), unless float32 weights would not fit in half of the
    memory available now (then the checkpoint's dtype, slow but running). The matrices of
    a 16-bit checkpoint stay 16-bit where the C kernels multiply them (models/linear.py)."""
    if requested != "auto":
        return torch_dtype(requested)
    if device != "cpu":
        return arch.dtype
    chosen = cpu_features().auto_dtype(arch.dtype)
    if chosen.itemsize > arch.dtype.itemsize:
        need = _weight_bytes(arch, chosen, weight_dtype(chosen, arch.dtype, device))
        available = _available_memory_bytes()
        if available is not None and need > available // 2:
            logger.warning(
                "dtype auto: %s weights (%.1f GiB) would not fit in half of the %.1f GiB "
                "available; running %s (pass --dtype to choose)",
                chosen,
                need / 2**30,
                available / 2**30,
                arch.dtype,
            )
            return arch.dtype if arch.dtype != torch.float16 else torch.bfloat16
    return chosen


def _weight_bytes(arch: ArchConfig, compute: torch.dtype, matrices: torch.dtype) -> int:
    """The weights' bytes, from the shapes: the embedding in the compute dtype or the
    checkpoint's, the narrower (looked up: models/llama.py `_embedding`), the matrices (the
    head included) in theirs."""
    h, inter = arch.hidden_size, arch.intermediate_size
    per_layer = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h + 3 * h * inter
    embed = arch.vocab_size * h
    table = min(compute.itemsize, arch.dtype.itemsize)
    return embed * table + (arch.num_hidden_layers * per_layer + embed) * matrices.itemsize


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resolve_max_model_len(requested: int | None, arch: ArchConfig) -> int:
    """A sliding window does not bound the context: those layers attend to their last
    window of keys at any length (ops.paged_attention_*'s sliding_window)."""
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len: {requested} tokens is more than the model allows ({limit} tokens: "
            f"max_position_embeddings in config.json)"
        )
    return requested


def _weight_source(config: ModelConfig, path: Path, device: str):
    if config.load_format != "auto":
        return RandomWeights(config.seed, device)
    gguf_path = view_gguf_file(path)
    return WeightSource(path) if gguf_path is None else GGUFWeightSource(gguf_path)


@dataclasses.dataclass
class LoadedModel:
    model: object
    arch: ArchConfig
    path: Path
    dtype: torch.dtype
    max_model_len: int
    kv_dtype: torch.dtype  # the KV cache's under `auto`


def model_stages(
    config: ModelConfig, pp_size: int, partition: str | None = None
) -> list[StageInfo]:
    """The pipeline stages of `config`'s model (from config.json alone; models/stages.py):
    the check at start that `pp_size` and `partition` fit its decoder layers."""
    arch = load_arch_config(resolve_model_path(config.model))
    return pipeline_stages(arch.num_hidden_layers, pp_size, partition)


def load_model(
    config: ModelConfig, device: str, ops: Ops, comm=None, stage: StageInfo | None = None
) -> LoadedModel:
    """The model of `config` on `device`; `comm`: its tensor-parallel group; `stage`: one
    pipeline stage of it (None: the whole model)."""
    path = resolve_model_path(config.model)
    arch = load_arch_config(path)
    cls = model_class(arch.architecture)
    arch = cls.adapt_config(arch)
    quantization = resolve_quantization(config, path)
    dtype = resolve_dtype(config.dtype, arch, device)
    kv_dtype = dtype
    on_cpu = torch.device(device).type == "cpu"
    if quantization == "gguf":
        # GGUF blocks multiply float32 rows on the CPU (as llama.cpp's CPU backend does);
        # a GPU's kernels (cuda/quant.py) take bfloat16 rows, as a 16-bit checkpoint runs
        dtype = kv_dtype = torch.float32 if on_cpu else torch.bfloat16
    elif quantization == "int8" and on_cpu and config.dtype == "auto":
        # int8 matrices multiply float32 rows as GGUF blocks do, so a step's layers run in
        # one C call (models/decode_plan.py: a batch-64 decode step on the demo model
        # 22.6-26.1 ms against 28.3-28.8 in bfloat16, batch 1 3.2 against 6.8-7.0); the KV
        # cache keeps the dtype the checkpoint would run in (bfloat16 where the CPU
        # computes in it: half a float32 cache's bytes)
        dtype = torch.float32
    elif bf16_tiles_apply(config, arch, dtype, on_cpu, quantization):
        # a bfloat16 checkpoint's matrices as the AMX tile unit's B tiles, which multiply
        # float32 rows (each rounded to bfloat16 as it is read, as oneDNN's bf16 products
        # take them): a step's layers then run in one C call, as int8's do
        # (models/quant_weights.py); the KV cache stays bfloat16
        quantization, dtype = BF16_TILES, torch.float32
    max_model_len = resolve_max_model_len(config.max_model_len, arch)
    source = _weight_source(config, path, device)
    with torch.inference_mode():
        model = cls(
            arch,
            ops,
            dtype,
            device,
            max_positions=max_model_len,
            comm=comm,
            stage=stage,
            quantization=quantization,
        )
        model.load_weights(source)
    if on_cpu and quantization in ROUNDED_PRODUCTS and attention_tiles_here(ops):
        ops.attention_tiles = True
    return LoadedModel(
        model=model,
        arch=arch,
        path=path,
        dtype=dtype,
        max_model_len=max_model_len,
        kv_dtype=kv_dtype,
    )
