"""Engine configuration: one frozen dataclass per concern, combined into `EngineConfig`.

Each component takes the sub-config (or the scalars) it needs; nothing reads a global.
Every field carries its help text in `metadata`, and `add_cli_args` / `from_cli_args`
generate the command-line flags from the same fields, spelled as vLLM spells them
(`max_num_seqs` -> `--max-num-seqs`). Validation raises `ValueError` naming the field
and its unit.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("auto", "swap", "recompute")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("int8",)
# The rotary scalings a checkpoint may ask for (ops/rope.py computes them; models/hf_config.py
# refuses others at load).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# vLLM's spellings; fp8 is fp8_e4m3 (float8 e4m3fn, unit scale); int8 keeps a scale per
# (block, KV head)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "int8")


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(
        default=None,
        metadata=_help(
            "HF model folder, or a GGUF file (or a folder holding one), served as it is; "
            "default: the demo model (SmolLM2-135M-Instruct, Q4_1 GGUF)"
        ),
    )
    tokenizer: str | None = field(
        default=None, metadata=_help("tokenizer folder; default: the model folder")
    )
    dtype: str = field(
        default="auto",
        metadata=_help(
            "weight and activation dtype (a GGUF: auto keeps its block formats, a dtype "
            "dequantizes it at load)",
            choices=DTYPES,
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=_help(
            "int8: a 16- / 32-bit checkpoint's linear layers quantized at load (one scale "
            "per output row; activations quantized per token group) and run on the integer "
            "kernels; on a CPU under dtype auto the activations are float32 and the KV "
            "cache the checkpoint's compute dtype",
            choices=QUANTIZATIONS,
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_help("context length in tokens (prompt + output); default: the model's"),
    )
    seed: int = field(default=0, metadata=_help("seed for weights made at random and for sampling"))
    served_model_name: str | None = field(default=None, metadata=_help("model name the API shows"))
    load_format: str = field(
        default="auto",
        metadata=_help(
            "auto: safetensors; dummy: random weights made on the device (benchmarks)",
            choices=LOAD_FORMATS,
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_help(
            "chat template: a Jinja file, or a shipped one by name (hermes: tool calling for "
            "ChatML models); default: the model's own"
        ),
    )
    pooler_config: str | None = field(
        default=None,
        metadata=_help(
            'how the model pools for embeddings, as JSON: {"pooling_type": "LAST" | "MEAN" | '
            '"CLS", "normalize": true}; default: its sentence-transformers files, else it '
            "does not pool"
        ),
    )
    enable_sleep_mode: bool = field(
        default=False,
        metadata=_help("allow sleep / wake_up: the weights' and KV cache's memory given back"),
    )

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            # a Path too (rank processes get the config as JSON)
            object.__setattr__(self, "model", os.fspath(self.model))
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: {self.load_format!r} is not one of {LOAD_FORMATS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {DTYPES}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization: {self.quantization!r} is not one of {QUANTIZATIONS} (a GGUF "
                "file needs none: pass its path as the model)"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be >= 1 token, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=_help("tokens per KV-cache block"))
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=_help(
            "KV-cache budget in bytes (CPU default: 1 GiB; GPU default: memory utilization)"
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_help(
            "the KV cache's element type (auto: the model's activations, or an int8 "
            "model's checkpoint dtype on a CPU); fp8 / fp8_e4m3 "
            "holds twice the tokens of a 16-bit cache in the same bytes, values saturating "
            "at +-448; int8 as many, with a scale per block and KV head",
            choices=KV_CACHE_DTYPES,
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_help("fraction of GPU memory the engine may use (weights + KV cache)"),
    )
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=_help("use exactly this many KV-cache blocks (testing)")
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_help("reuse cached KV blocks of shared prefixes")
    )
    disable_hybrid_kv_cache_manager: bool = field(
        default=False,
        metadata=_help(
            "keep every block in every layer (by default a sliding-window layer's blocks "
            "that fell out of its window go back to the pool; the host KV tier then only swaps)"
        ),
    )
    swap_space: float = field(
        default=4.0,
        metadata=_help(
            "GiB of host memory per worker for a second KV tier: swapped-out requests and "
            "prefix-cache blocks evicted from the device (0: neither)"
        ),
    )
    kv_offload_dir: str | None = field(
        default=None,
        metadata=_help(
            "a folder for a third KV tier on local disk (prefix-cache blocks evicted from "
            "host memory; kept across restarts of the same model); none: no disk tier"
        ),
    )
    kv_offload_max_gib: float = field(
        default=16.0, metadata=_help("GiB the disk KV tier may take per worker")
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space: must be >= 0 GiB, got {self.swap_space}")
        if self.kv_offload_dir is not None and not self.swap_space:
            raise ValueError(
                "kv_offload_dir: the disk tier sits behind the host tier; give swap_space > 0"
            )
        if not self.kv_offload_max_gib > 0:
            raise ValueError(
                f"kv_offload_max_gib: must be above 0 GiB, got {self.kv_offload_max_gib}"
            )
        if self.block_size < 1 or self.block_size > 256 or self.block_size & (self.block_size - 1):
            raise ValueError(
                f"block_size: must be a power of two in [1, 256] tokens, got {self.block_size}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes: must be > 0 bytes, got {self.kv_cache_memory_bytes}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization: must be a fraction in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override: must be >= 1 block, got {self.num_gpu_blocks_override}"
            )


# `target_itl auto`: a step that carries prompt tokens beside decodes may take this many
# times a step of the decodes alone. Measured (`bench serve`, 64 in / 32 out, concurrency
# 16; docs/server.md): on Zen 3 (demo Q4_1, 2026-12-04) 2x held the P99 ITL at 112-115 ms
# against vLLM's 128-294 at 1.6-1.8x its rate, and 3x let it reach 144-197 ms. On Zen 5
# (the demo's bf16 folder, 2026-12-07, once the step cost kept a margin and only recent
# decode steps) 2x let it reach 39-52 ms against vLLM's 36-43, and 1.5x held it at 33-38
# (vLLM's 33-124) at 1.15-1.6x vLLM's rate, the first token 1.3-2.6x sooner.
AUTO_ITL_FACTOR = 1.5


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=256, metadata=_help("most requests running in one step"))
    max_num_batched_tokens: int = field(
        default=2048, metadata=_help("most tokens computed in one step")
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=_help("split long prompts across steps")
    )
    scheduling_policy: str = field(default="fcfs", metadata=_help("queue order", choices=POLICIES))
    preemption_mode: str = field(
        default="auto",
        metadata=_help(
            "what a preempted request loses: swap (its KV moves to host memory and back), "
            "recompute (thrown away, computed again), auto (the scheduler chooses)",
            choices=PREEMPTION_MODES,
        ),
    )
    target_itl: str = field(
        default="off",
        metadata=_help(
            "while requests are decoding, a step carries only the prompt tokens that its "
            "measured cost says fit in this inter-token target, so a prompt's prefill does "
            "not stall the streams beside it: off (the token budget alone), auto (1.5x the "
            "measured time of a recent step of the decodes alone), another multiple (3x, 2x) or "
            "milliseconds (`serve` on a CPU: auto)"
        ),
    )
    async_scheduling: bool = field(
        default=False,
        metadata=_help(
            "plan step N+1 while step N runs (vLLM's async scheduling): a decoding request "
            "is scheduled again before its token is back, the worker fills that token in, and "
            "step N's outputs are taken in while step N+1 runs; not with speculative decoding "
            "or pipeline stages (docs/architecture.md, Async scheduling)"
        ),
    )
    structured_outputs_compile_timeout_s: float = field(
        default=10.0,
        metadata=_help("longest a request's grammar may take to compile (then it is refused)"),
    )

    @property
    def itl_target(self) -> tuple[str, float]:
        """`target_itl` read: ("off", 0), ("auto", factor: auto or Nx) or ("ms", milliseconds)."""
        text = str(self.target_itl).strip().lower()
        if text == "off":
            return "off", 0.0
        if text == "auto":
            return "auto", AUTO_ITL_FACTOR
        if text.endswith("x"):  # a multiple of the decode step, as auto's 1.5x
            try:
                factor = float(text[:-1])
            except ValueError:
                factor = math.nan
            if factor >= 1 and math.isfinite(factor):
                return "auto", factor
            raise ValueError(
                f"target_itl: a multiple of the decode step is at least 1x, got {self.target_itl!r}"
            )
        try:
            ms = float(text.removesuffix("ms"))
        except ValueError:
            ms = math.nan
        if not (ms > 0 and math.isfinite(ms)):
            raise ValueError(
                f"target_itl: off, auto or a number of milliseconds > 0, got {self.target_itl!r}"
            )
        return "ms", ms

    def __post_init__(self) -> None:
        if not self.structured_outputs_compile_timeout_s > 0:
            raise ValueError(
                "structured_outputs_compile_timeout_s: must be > 0 seconds, got "
                f"{self.structured_outputs_compile_timeout_s}"
            )
        self.itl_target  # noqa: B018 (raises on a bad value)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1 request, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens: must be >= 1 token, got {self.max_num_batched_tokens}"
            )
        if self.scheduling_policy not in POLICIES:
            raise ValueError(
                f"scheduling_policy: {self.scheduling_policy!r} is not one of {POLICIES}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode: {self.preemption_mode!r} is not one of {PREEMPTION_MODES}"
            )


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(default=1, metadata=_help("ranks one model is split across"))
    data_parallel_size: int = field(default=1, metadata=_help("independent engine cores"))
    pipeline_parallel_size: int = field(
        default=1, metadata=_help("stages the decoder layers are split into (one rank group each)")
    )
    pipeline_layer_partition: str | None = field(
        default=None,
        metadata=_help("decoder layers per stage, comma-separated (default: an even split)"),
    )
    # several hosts (pipeline/executor/placement.py): the ranks are shared out between nnodes
    # hosts; the head (node rank 0) runs the engine core and its own ranks, every other
    # host a `ringllm serve --headless` agent with its ranks
    nnodes: int = field(default=1, metadata=_help("hosts the worker ranks run on"))
    node_rank: int = field(default=0, metadata=_help("this host's index (0: the head)"))
    master_addr: str = field(
        default="127.0.0.1",
        metadata=_help("the head's address every host reaches (its rendezvous listens there)"),
    )
    master_port: int = field(
        default=29500, metadata=_help("the head's rendezvous port (torch.distributed TCPStore)")
    )
    distributed_timeout_s: float = field(
        default=600.0,
        metadata=_help("how long a collective waits for its slowest rank before it fails"),
    )
    host_heartbeat_timeout_s: float = field(
        default=3.0,
        metadata=_help(
            "how long another host's link may stay silent before the host counts as lost "
            "(heartbeats go every 0.5 s; its requests then end with 503 host_lost)"
        ),
    )
    distributed_executor_backend: str = field(
        default="mp",
        metadata=_help(
            "how the worker ranks start: mp (processes; --nnodes for several hosts) or ray "
            "(actors in a placement group of a Ray cluster: RAY_ADDRESS, else a local one)",
            choices=EXECUTOR_BACKENDS,
        ),
    )

    def __post_init__(self) -> None:
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend: {self.distributed_executor_backend!r} is not "
                f"one of {EXECUTOR_BACKENDS}"
            )
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise ValueError(
                "nnodes: not with distributed_executor_backend ray (Ray places the ranks on "
                "its cluster's hosts; start the cluster with `ray start`)"
            )
        if self.nnodes < 1:
            raise ValueError(f"nnodes: must be >= 1 host, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank: must be in [0, {self.nnodes}) for nnodes {self.nnodes}, "
                f"got {self.node_rank}"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port: {self.master_port} is not a TCP port")
        if self.distributed_timeout_s <= 0:
            raise ValueError(
                f"distributed_timeout_s: must be > 0 seconds, got {self.distributed_timeout_s}"
            )
        if self.host_heartbeat_timeout_s < 1.0:
            raise ValueError(
                "host_heartbeat_timeout_s: must be >= 1 second (heartbeats go every 0.5 s), "
                f"got {self.host_heartbeat_timeout_s}"
            )
        if self.nnodes > 1:
            ranks = self.tensor_parallel_size * self.pipeline_parallel_size
            if ranks % self.nnodes:
                raise ValueError(
                    f"nnodes: {ranks} worker ranks ({self.pipeline_parallel_size} stages x "
                    f"{self.tensor_parallel_size} tensor-parallel) do not share out evenly "
                    f"between {self.nnodes} hosts"
                )
            if self.data_parallel_size > 1:
                raise ValueError(
                    "data_parallel_size: not with nnodes > 1 yet (one engine core spans the "
                    "hosts); run one multi-host engine per replica"
                )
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size: must be >= 1 stage, got {self.pipeline_parallel_size}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size: must be >= 1 rank, got {self.tensor_parallel_size}"
            )
        if self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size: must be >= 1 engine, got {self.data_parallel_size}"
            )


# The nodes a GPU driver opens (NVIDIA's, WSL's, ROCm's): none, no device torch can see.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/dev/kfd")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = field(default="auto", metadata=_help("where the model runs", choices=DEVICES))
    num_threads: int | None = field(default=None, metadata=_help("CPU threads for torch ops"))

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device: {self.device!r} is not one of {DEVICES}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1 thread, got {self.num_threads}")

    def resolve(self) -> str:
        """The concrete device: `auto` means cuda when torch sees one, else cpu. NOTE: with
        no GPU device node no driver can answer, so that is cpu without importing torch: a
        front end that only asks (`ringllm serve`'s) would hold it, about 200 MiB."""
        if self.device != "auto":
            return self.device
        if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


SPEC_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config` as vLLM spells it: a dict (a JSON object on the command line)
    with `method` ("ngram" or "draft_model"; a `model` alone means draft_model),
    `num_speculative_tokens`, `prompt_lookup_min` / `prompt_lookup_max` (ngram; one given
    alone sets both; neither: 5 and 5, as vLLM), `model` (the draft model's folder) and
    `disable_by_batch_size` (no proposals in a step of more requests than this)."""

    speculative_config: dict | str | None = field(
        default=None,
        metadata=_help(
            'speculative decoding, a JSON object: {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4} or {"method": '
            '"draft_model", "model": DIR, "num_speculative_tokens": 4}; '
            '"disable_by_batch_size": N turns it off in steps of more than N requests'
        ),
    )

    def __post_init__(self) -> None:
        value = self.speculative_config
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not a JSON object ({e})") from None
        if value is not None:
            value = _check_speculative(value)
        object.__setattr__(self, "speculative_config", value)

    @property
    def enabled(self) -> bool:
        return self.speculative_config is not None

    def get(self, key: str):
        return (self.speculative_config or {}).get(key)

    @property
    def method(self) -> str | None:
        return self.get("method")

    @property
    def num_speculative_tokens(self) -> int:
        return self.get("num_speculative_tokens") or 0

    @property
    def disable_by_batch_size(self) -> int | None:
        return self.get("disable_by_batch_size")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots the scheduler reserves past a speculating request's scheduled tokens:
        a draft model writes its drafts' keys and values there before they are verified."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


def _check_speculative(value: Any) -> dict[str, Any]:
    """The normalized speculative config (every key present), or a ValueError naming the key."""
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config: must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {list(_SPEC_KEYS)}")
    spec = dict(value)
    method = spec.get("method") or ("draft_model" if spec.get("model") else None)
    if method not in SPEC_METHODS:
        raise ValueError(f"speculative_config.method: {method!r} is not one of {SPEC_METHODS}")
    spec["method"] = method

    def _int(key: str, low: int, high: int | None = None) -> None:
        v = spec.get(key)
        if v is None:
            return
        if isinstance(v, bool) or not isinstance(v, int) or v < low or (high and v > high):
            bound = f"in [{low}, {high}]" if high else f">= {low}"
            raise ValueError(f"speculative_config.{key}: must be an integer {bound}, got {v!r}")

    if spec.get("num_speculative_tokens") is None:
        raise ValueError("speculative_config.num_speculative_tokens: required")
    _int("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    _int("prompt_lookup_min", 1, 64)
    _int("prompt_lookup_max", 1, 64)
    _int("disable_by_batch_size", 1)
    if method == "ngram":
        if spec.get("model") is not None:
            raise ValueError("speculative_config.model: the ngram method takes no model")
        low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        low, high = (low or high or 5), (high or low or 5)
        if low > high:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({low}) is above prompt_lookup_max ({high})"
            )
        spec["prompt_lookup_min"], spec["prompt_lookup_max"] = low, high
    else:
        if not isinstance(spec.get("model"), str) or not spec["model"]:
            raise ValueError("speculative_config.model: draft_model needs the draft model's folder")
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if spec.get(key) is not None:
                raise ValueError(f"speculative_config.{key}: only for the ngram method")
    return {key: spec.get(key) for key in _SPEC_KEYS}


MM_MODALITIES = ("image",)


@dataclass(frozen=True)
class MultiModalConfig:
    """Images in prompts (a model that takes them): where they may come from, how many and
    how big, who preprocesses them, and the engine's encoder budget."""

    limit_mm_per_prompt: dict | str | None = field(
        default=None,
        metadata=_help('most images one prompt may hold, a JSON object: {"image": 4} (default 4)'),
    )
    allowed_local_media_path: str | None = field(
        default=None,
        metadata=_help("a folder whose files image_url may name (file://); none: no local files"),
    )
    allowed_media_domains: str | None = field(
        default=None,
        metadata=_help(
            "http(s) image URLs are fetched only from these hosts (comma-separated; '*': any "
            "host); none: http(s) URLs are refused"
        ),
    )
    media_fetch_timeout_s: float = field(
        default=5.0, metadata=_help("seconds one http(s) image fetch may take, redirects included")
    )
    max_media_bytes: int = field(
        default=20 << 20, metadata=_help("bytes of one encoded image, from any source")
    )
    max_image_pixels: int = field(
        default=1 << 25, metadata=_help("width x height of one image, checked before decoding")
    )
    media_loading_threads: int = field(
        default=4, metadata=_help("threads that fetch, decode and preprocess images (servers)")
    )
    max_num_encoder_input_tokens: int | None = field(
        default=None,
        metadata=_help(
            "image feature positions the vision encoder makes per step (default: "
            "max_num_batched_tokens, at least one image)"
        ),
    )
    mm_transfer_mib: int = field(
        default=256,
        metadata=_help(
            "MiB of shared memory per front end for preprocessed images on their way to the "
            "engine (touched only as used)"
        ),
    )

    def __post_init__(self) -> None:
        value = self.limit_mm_per_prompt
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as e:
                raise ValueError(f"limit_mm_per_prompt: not a JSON object ({e})") from None
        if value is not None:
            if not isinstance(value, dict):
                raise ValueError(
                    f"limit_mm_per_prompt: must be a JSON object, got {type(value).__name__}"
                )
            unknown = sorted(set(value) - set(MM_MODALITIES))
            if unknown:
                raise ValueError(
                    f"limit_mm_per_prompt: unknown modality {unknown}; known: {list(MM_MODALITIES)}"
                )
            for key, count in value.items():
                if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                    raise ValueError(
                        f"limit_mm_per_prompt.{key}: must be an integer >= 0, got {count!r}"
                    )
        object.__setattr__(self, "limit_mm_per_prompt", value)
        for name, low in (
            ("max_media_bytes", 1),
            ("max_image_pixels", 1),
            ("media_loading_threads", 1),
            ("mm_transfer_mib", 1),
        ):
            if getattr(self, name) < low:
                raise ValueError(f"{name}: must be >= {low}, got {getattr(self, name)}")
        if not self.media_fetch_timeout_s > 0:
            raise ValueError(
                f"media_fetch_timeout_s: must be above 0 s, got {self.media_fetch_timeout_s}"
            )
        budget = self.max_num_encoder_input_tokens
        if budget is not None and budget < 1:
            raise ValueError(f"max_num_encoder_input_tokens: must be >= 1 position, got {budget}")

    def limit(self, modality: str = "image") -> int:
        """The most items of `modality` one prompt may hold."""
        return (self.limit_mm_per_prompt or {}).get(modality, DEFAULT_MM_LIMIT)

    def media_domains(self) -> tuple[str, ...] | None:
        """The hosts http(s) URLs may name (("*",): any); None: no http(s) URLs."""
        if not self.allowed_media_domains:
            return None
        hosts = tuple(h.strip().lower() for h in self.allowed_media_domains.split(",") if h.strip())
        return hosts or None


DEFAULT_MM_LIMIT = 4


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters on the base model (models/lora.py): whether they are taken, how many
    one step may mix and the highest rank; the adapters themselves are loaded at run time
    (LLM / AsyncLLM `add_lora`, `ringllm serve --lora-modules`, /v1/load_lora_adapter)."""

    enable_lora: bool = field(
        default=False, metadata=_help("serve LoRA adapters (PEFT folders) on the base model")
    )
    max_loras: int = field(
        default=1,
        metadata=_help(
            "adapters one step may mix (the slots the workers hold); requests for others wait "
            "for a slot"
        ),
    )
    max_lora_rank: int = field(
        default=16, metadata=_help("highest adapter rank taken (each slot's size)")
    )
    max_cpu_loras: int | None = field(
        default=None,
        metadata=_help(
            "adapters loaded at once (default: max(max_loras, 8)); loading one more fails"
        ),
    )

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank: must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}"
            )

    @property
    def max_adapters(self) -> int:
        """Adapters loaded at once."""
        return self.max_cpu_loras or max(self.max_loras, 8)


SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "device": DeviceConfig,
    "speculative": SpeculativeConfig,
    "multimodal": MultiModalConfig,
    "lora": LoRAConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.scheduler.async_scheduling and self.speculative.enabled:
            raise ValueError(
                "async_scheduling: not with speculative_config (a step's drafts come from "
                "the tokens of the step before it, which async scheduling does not wait for)"
            )
        if self.scheduler.async_scheduling and self.parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "async_scheduling: not with pipeline_parallel_size > 1 (the stages already "
                "keep one batch in flight per stage)"
            )
        if self.speculative.enabled and self.parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "speculative_config: not with pipeline_parallel_size > 1 (the stages would "
                "need every verified run; use tensor parallelism)"
            )
        if self.speculative.method == "draft_model" and self.parallel.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config: the draft_model method runs on one rank only; with "
                "tensor_parallel_size > 1 use the ngram method"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Builds the config from flat engine arguments (`max_num_seqs=8, dtype="float32"`)."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        owner = {
            f.name: name for name, klass in SECTIONS.items() for f in dataclasses.fields(klass)
        }
        for key, value in kwargs.items():
            if key not in owner:
                raise ValueError(f"unknown engine argument {key!r}; known: {sorted(owner)}")
            sections[owner[key]][key] = value
        return cls(**{name: SECTIONS[name](**sections[name]) for name in SECTIONS})


def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Adds one flag per config field (`--max-num-seqs`), with the field's help and type."""
    for klass in SECTIONS.values():
        group = parser.add_argument_group(klass.__name__)
        for f in dataclasses.fields(klass):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            kind = _field_type(f)
            if kind is bool:
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=None, help=meta["help"]
                )
            else:
                group.add_argument(
                    flag, type=kind, default=None, help=meta["help"], choices=meta.get("choices")
                )


def from_cli_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config from parsed flags; flags not given keep the field defaults."""
    given = {}
    for klass in SECTIONS.values():
        for f in dataclasses.fields(klass):
            value = getattr(args, f.name, None)
            if value is not None:
                given[f.name] = value
    return EngineConfig.from_kwargs(**given)


def _field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if text.startswith(name):
            return kind
    return str


def config_to_dict(config: EngineConfig) -> dict[str, Any]:
    """Flat engine arguments (the inverse of `EngineConfig.from_kwargs`), JSON-ready."""
    return {
        f.name: getattr(getattr(config, section), f.name)
        for section, klass in SECTIONS.items()
        for f in dataclasses.fields(klass)
    }
