"""`ringllm bench kernels`: the paged-attention decode kernel against the device's copy bandwidth.

Decode attention is memory-bound: per step it reads every cached key and value of every
running request once and does a few FLOPs per byte. So its figure of merit is achieved
bandwidth, compared with the best the device does on a plain copy, measured in the same run:

    bytes moved per call = K and V read    2 * R * Hk * L * D * itemsize
                         + query read          R * Hq * D * itemsize
                         + output written      R * Hq * D * itemsize
    copy bytes           = read + write    2 * copy_bytes (dst.copy_(src), >= 1 GiB on GPU)
    fraction_of_copy     = (bytes moved / decode time) / (copy bytes / copy time)

(R requests of L context tokens, Hq query heads, Hk KV heads, head size D.) The block
tables and the partitioned variant's float32 partials are left out on purpose: they are
overhead, not useful traffic, so a plan that moves more of them scores lower.

Each variant is timed two ways:

    call    `ops.paged_attention_decode(...)` back to back, one clock mark per call: what
            the engine pays, host work included (CudaOps reads max(seq_lens) back, which
            waits for the device, so the GPU idles while Python prepares the next launch)
    kernel  the launches alone: each kernel the call launches is replayed `iterations`
            times back to back between two marks (after one untimed launch, so the
            device is already busy when the first mark is taken); CudaOps only. Exact
            while a launch outlasts the host's work to issue the next (tens of us): the
            partitioned plan's small reduce kernel does not, so its figure is an upper bound

The target (>= 70% of copy bandwidth) is judged on the kernel time of the variant the
engine's "auto" plan picks for this shape, and only when every variant's output matches
TorchOps within the bf16/fp16/fp32 tolerances of the kernel tests. Devices: "cuda" runs
CudaOps through CuPy with CUDA events; "cpu" runs the engine's C kernels (CpuOps, every
kernel set the CPU has) beside TorchOps, or with `--cpu-kernels torch|emulator` TorchOps
alone or the .cu kernels through the CPU emulator, with `time.perf_counter`; the CPU's
default shape is the demo model's decode step (64 requests, 9/3 heads of 64).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ringllm.cuda.ops import MIN_SINGLE_PASS_CTAS
from ringllm.pipeline.ops import TorchOps, kv_int8
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.report import format_table, write_report

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# the cache's own type (--kv-cache-dtype): auto is the query's
KV_CACHE_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
# The kernel tests' tolerances against TorchOps (tests/cuda): both sides round once from
# float32, so they may differ by one unit in the last place of the output dtype.
TOLERANCES = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
# Llama-3-8B attention on the GPU; a shape the CPU (and the emulator) finishes in seconds.
DEFAULT_SHAPES = {
    "cuda": {"batch_size": 256, "context_len": 1024, "num_heads": 32, "num_kv_heads": 8,
             "head_size": 128, "block_size": 16, "dtype": "bfloat16"},
    "cpu": {"batch_size": 64, "context_len": 96, "num_heads": 9, "num_kv_heads": 3,
            "head_size": 64, "block_size": 16, "dtype": "bfloat16"},
}  # fmt: skip
DEFAULT_COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}
TARGET_FRACTION_OF_COPY = 0.70


@dataclass(frozen=True)
class DecodeShape:
    """One decode step: batch_size requests, each with context_len cached tokens."""

    batch_size: int
    context_len: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("batch_size", "context_len", "num_heads", "num_kv_heads", "head_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads: {self.num_heads} query heads are not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two tokens, got {self.block_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} is not auto or one of "
                f"{sorted(KV_CACHE_DTYPES)}"
            )

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.context_len // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.batch_size * self.blocks_per_seq

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def cache_torch_dtype(self) -> torch.dtype:
        return (
            DTYPES[self.dtype]
            if self.kv_cache_dtype == "auto"
            else KV_CACHE_DTYPES[self.kv_cache_dtype]
        )


def decode_bytes_moved(shape: DecodeShape) -> dict[str, int]:
    """The useful traffic of one decode call (see the module docstring)."""
    kv_read_bytes = (
        2 * shape.batch_size * shape.num_kv_heads * shape.context_len * shape.head_size
    ) * shape.cache_torch_dtype.itemsize
    query_bytes = shape.batch_size * shape.num_heads * shape.head_size * shape.itemsize
    return {
        "kv_read_bytes": kv_read_bytes,
        "query_bytes": query_bytes,
        "out_bytes": query_bytes,
        "total_bytes": kv_read_bytes + 2 * query_bytes,
    }


@dataclass
class DecodeInputs:
    query: torch.Tensor  # [R, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, Hk, block_size, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [R, blocks_per_seq] int32, a shuffle of all block ids
    seq_lens: torch.Tensor  # [R] int32, all context_len
    scale: float

    def args(self) -> tuple:
        return (
            self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
            self.scale,
        )  # fmt: skip


def make_decode_inputs(shape: DecodeShape, device: str, seed: int) -> DecodeInputs:
    """Random q / K / V; each request's blocks are scattered over the cache, as after a
    while of serving, so the kernel cannot profit from neighbouring requests' blocks."""
    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[shape.dtype]
    cache_shape = (shape.num_blocks, shape.num_kv_heads, shape.block_size, shape.head_size)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=generator, device=device, dtype=dtype)

    def cache() -> torch.Tensor:
        if shape.cache_torch_dtype is not torch.int8:
            return randn(*cache_shape).to(shape.cache_torch_dtype)
        made = kv_int8.new_cache(cache_shape, torch.int8, device)  # with its scales
        made.copy_(torch.randint(-127, 128, cache_shape, generator=generator, device=device))
        kv_int8.kv_scales(made).uniform_(0.005, 0.03, generator=generator)
        return made

    order = torch.randperm(shape.num_blocks, generator=torch.Generator().manual_seed(seed))
    return DecodeInputs(
        query=randn(shape.batch_size, shape.num_heads, shape.head_size),
        key_cache=cache(),
        value_cache=cache(),
        block_tables=order.view(shape.batch_size, shape.blocks_per_seq).int().to(device),
        seq_lens=torch.full((shape.batch_size,), shape.context_len, dtype=torch.int32).to(device),
        scale=1.0 / math.sqrt(shape.head_size),
    )


class EventClock:
    """CUDA events on torch's current stream: marks are device timestamps."""

    name = "cuda_events"

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds_between(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3  # elapsed_time is in ms

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class HostClock:
    """`time.perf_counter` on the CPU, where every op has finished when it returns."""

    name = "perf_counter"

    def mark(self) -> float:
        return time.perf_counter()

    def seconds_between(self, start: float, end: float) -> float:
        return end - start

    def synchronize(self) -> None:
        pass


def clock_for(device: str) -> EventClock | HostClock:
    return EventClock() if device == "cuda" else HostClock()


def time_calls(fn: Callable[[], object], iterations: int, warmup: int, clock) -> list[float]:
    """Seconds of each of `iterations` back-to-back calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    clock.synchronize()
    marks = [clock.mark()]
    for _ in range(iterations):
        fn()
        marks.append(clock.mark())
    clock.synchronize()
    return [clock.seconds_between(a, b) for a, b in zip(marks, marks[1:], strict=False)]


def timing_summary(times_s: list[float], bytes_per_call: int) -> dict[str, float]:
    median_s = sorted(times_s)[len(times_s) // 2]
    return {
        "median_s": median_s,
        "mean_s": sum(times_s) / len(times_s),
        "min_s": min(times_s),
        "gb_per_s": bytes_per_call / median_s / 1e9,
    }


def measure_copy_bandwidth(copy_bytes: int, device: str, iterations: int, warmup: int, clock):
    """A device-to-device copy of `copy_bytes`: each call reads and writes them once."""
    if copy_bytes < 1:
        raise ValueError(f"copy_bytes: must be >= 1 byte, got {copy_bytes}")
    src = torch.ones(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times_s = time_calls(lambda: dst.copy_(src), iterations, warmup, clock)
    if not torch.equal(dst[-4096:], src[-4096:]):
        raise RuntimeError("copy bandwidth: the destination does not hold the copied bytes")
    return {"copy_bytes": copy_bytes, **timing_summary(times_s, 2 * copy_bytes)}


class ReplayingLoader:
    """Stands in for a CudaOps' kernel loader: every launch through it runs once untimed,
    then `repeats` times back to back between two clock marks. Decode and reduce only
    write buffers they do not read, so repeating a launch leaves the same result."""

    def __init__(self, loader, clock, repeats: int):
        self._loader = loader
        self._clock = clock
        self.repeats = repeats
        self.spans: list[tuple[str, object, object]] = []

    def kernel(self, family: str, name: str) -> Callable[..., None]:
        inner = self._loader.kernel(family, name)

        def launch(grid, block, args, shared_mem: int = 0) -> None:
            inner(grid, block, args, shared_mem=shared_mem)
            start = self._clock.mark()
            for _ in range(self.repeats):
                inner(grid, block, args, shared_mem=shared_mem)
            self.spans.append((name, start, self._clock.mark()))

        return launch

    def seconds_per_launch(self) -> dict[str, float]:
        self._clock.synchronize()
        per_kernel: dict[str, float] = {}
        for name, start, end in self.spans:
            seconds = self._clock.seconds_between(start, end) / self.repeats
            per_kernel[name] = per_kernel.get(name, 0.0) + seconds
        return per_kernel


def time_kernels(ops, inputs: DecodeInputs, iterations: int, clock) -> dict[str, float]:
    """Device seconds per launch of each kernel one decode call launches (CudaOps only)."""
    loader = ops.loader
    replay = ReplayingLoader(loader, clock, iterations)
    ops.loader = replay
    try:
        ops.paged_attention_decode(*inputs.args())
        return replay.seconds_per_launch()
    finally:
        ops.loader = loader


def check_output(actual: torch.Tensor, expected: torch.Tensor, dtype: str) -> dict[str, Any]:
    """Max abs difference from TorchOps, and whether it is within the kernel tests' tolerance."""
    diff = (actual.float() - expected.float()).abs()
    tolerance = TOLERANCES[dtype]
    bound = tolerance + tolerance * expected.float().abs()
    return {
        "max_abs_diff": float(diff.max()),
        "tolerance": tolerance,
        "correct": bool(torch.isfinite(actual).all() and (diff <= bound).all()),
    }


def make_variants(device: str, cpu_kernels: str, partition_tokens: int) -> dict[str, dict]:
    """name -> {ops, partition_mode}: the decode plans this run compares."""
    if device == "cpu" and cpu_kernels == "torch":
        return {"torch_ref": {"ops": TorchOps(), "partition_mode": None}}
    if device == "cpu" and cpu_kernels == "c":
        from ringllm.pipeline.ops.cpu import CpuOps, kernel_sets
        from ringllm.pipeline.ops.cpu_kernels import attention_tiles_usable

        variants = {"torch_ref": {"ops": TorchOps(), "partition_mode": None}}
        for kernel_set in kernel_sets():
            variants["c_" + kernel_set] = {"ops": CpuOps(kernel_set), "partition_mode": None}
        if "avx512bf16" in kernel_sets() and attention_tiles_usable():
            # the AMX tile unit, as a model with int8 / GGUF / bf16-tile matrices runs it: query
            # rows and softmax weights rounded to bfloat16, so judged at bfloat16's tolerance
            tiles = CpuOps("avx512bf16")
            tiles.attention_tiles = True
            variants["c_avx512bf16_tiles"] = {
                "ops": tiles,
                "partition_mode": None,
                "tolerance_dtype": "bfloat16",
            }
        return variants
    from ringllm.cuda.ops import CudaOps

    backend = "cupy" if device == "cuda" else "emulator"
    if backend == "cupy" and importlib.util.find_spec("cupy") is None:
        raise ValueError("device: cuda runs CudaOps, which needs CuPy: pip install -e '.[gpu]'")
    return {
        name: {
            "ops": CudaOps(backend, partition_tokens=partition_tokens, partition_mode=mode),
            "partition_mode": mode,
        }
        for name, mode in (("single_pass", "never"), ("partitioned", "always"))
    }


def auto_plan(shape: DecodeShape, partition_tokens: int, variants: dict) -> str:
    """The variant the engine would run for this shape: on the CPU the fastest C kernel set
    (CpuOps' default) when those are measured, else the torch reference; on CUDA the one
    CudaOps' "auto" plan picks (ringllm.cuda.ops)."""
    c_sets = [n for n in variants if n.startswith("c_") and not n.endswith("_tiles")]
    if c_sets:
        return c_sets[-1]
    if "torch_ref" in variants:
        return "torch_ref"
    single_pass_ctas = shape.batch_size * shape.num_kv_heads
    if shape.context_len <= partition_tokens or single_pass_ctas >= MIN_SINGLE_PASS_CTAS:
        return "single_pass"
    return "partitioned"


def bench_variant(variant: dict, inputs: DecodeInputs, expected, shape, args, clock, copy):
    ops = variant["ops"]
    got = ops.paged_attention_decode(*inputs.args())
    check = check_output(got, expected, variant.get("tolerance_dtype", shape.dtype))
    moved = decode_bytes_moved(shape)["total_bytes"]
    call = timing_summary(
        time_calls(lambda: ops.paged_attention_decode(*inputs.args()), args.iterations,
                   args.warmup, clock),
        moved,
    )  # fmt: skip
    call["fraction_of_copy"] = call["gb_per_s"] / copy["gb_per_s"]
    kernel = None
    if hasattr(ops, "loader"):
        per_kernel_s = time_kernels(ops, inputs, args.iterations, clock)
        seconds = sum(per_kernel_s.values())
        kernel = {"seconds": seconds, "per_kernel_s": per_kernel_s,
                  "gb_per_s": moved / seconds / 1e9}  # fmt: skip
        kernel["fraction_of_copy"] = kernel["gb_per_s"] / copy["gb_per_s"]
    partitions = 1
    if variant["partition_mode"] == "always":
        partitions = -(-shape.context_len // args.partition_tokens)
    return {"partition_mode": variant["partition_mode"], "num_partitions": partitions,
            **check, "call": call, "kernel": kernel}  # fmt: skip


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device: cuda asked for, but torch {torch.__version__} (built for CUDA "
            f"{torch.version.cuda}) sees no CUDA device; check the driver, or use --device cpu"
        )
    return device


def shape_from_args(args: argparse.Namespace, device: str) -> DecodeShape:
    fields = {k: getattr(args, k) for k in DEFAULT_SHAPES[device]}
    return DecodeShape(**{k: DEFAULT_SHAPES[device][k] if v is None else v
                          for k, v in fields.items()},
                       kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))  # fmt: skip


def device_info(device: str) -> dict[str, Any]:
    info = {"device": device, "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if device == "cuda":
        import cupy

        info.update(name=torch.cuda.get_device_name(), cupy=cupy.__version__,
                    cuda_runtime=cupy.cuda.runtime.runtimeGetVersion())  # fmt: skip
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


def run_kernel_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Builds the inputs, measures the copy and every variant; returns the result dict."""
    if args.iterations < 1 or args.warmup < 0:
        raise ValueError(f"iterations >= 1 and warmup >= 0, got {args.iterations}/{args.warmup}")
    device = resolve_device(args.device)
    shape = shape_from_args(args, device)
    clock = clock_for(device)
    copy_bytes = args.copy_bytes or DEFAULT_COPY_BYTES[device]
    copy = measure_copy_bandwidth(copy_bytes, device, args.iterations, args.warmup, clock)
    inputs = make_decode_inputs(shape, device, args.seed)
    expected = TorchOps().paged_attention_decode(*inputs.args())
    variants = make_variants(device, args.cpu_kernels, args.partition_tokens)
    results = {
        name: bench_variant(v, inputs, expected, shape, args, clock, copy)
        for name, v in variants.items()
    }
    judged = auto_plan(shape, args.partition_tokens, variants)
    timing = results[judged]["kernel"] or results[judged]["call"]
    all_correct = all(r["correct"] for r in results.values())
    return {
        "benchmark": "paged_attention_decode",
        "device": device_info(device),
        "shape": {**asdict(shape), "num_blocks": shape.num_blocks},
        "partition_tokens": args.partition_tokens,
        "timing": {"clock": clock.name, "iterations": args.iterations, "warmup": args.warmup},
        "bytes_moved": decode_bytes_moved(shape),
        "copy": copy,
        "variants": results,
        "judged_variant": judged,
        "judged_timing": "kernel" if results[judged]["kernel"] else "call",
        "fraction_of_copy": timing["fraction_of_copy"],
        "target_fraction_of_copy": TARGET_FRACTION_OF_COPY,
        "all_correct": all_correct,
        "meets_target": all_correct and timing["fraction_of_copy"] >= TARGET_FRACTION_OF_COPY,
    }


def kernels_table(result: dict[str, Any]) -> str:
    shape = result["shape"]
    rows: list[tuple[str, Any]] = [
        ("Device", result["device"]["name"]),
        ("Shape (R x L, Hq/Hk, D)", f"{shape['batch_size']}x{shape['context_len']}, "
         f"{shape['num_heads']}/{shape['num_kv_heads']}, {shape['head_size']}"),
        ("dtype, KV cache dtype", f"{shape['dtype']}, {shape['kv_cache_dtype']}"),
        ("Bytes moved per call (MB)", result["bytes_moved"]["total_bytes"] / 1e6),
        ("Copy bandwidth (GB/s)", result["copy"]["gb_per_s"]),
    ]  # fmt: skip
    for name, v in result["variants"].items():
        rows += [(name, None), ("Max abs diff vs TorchOps", f"{v['max_abs_diff']:.2e}"),
                 ("Call median (us)", 1e6 * v["call"]["median_s"]),
                 ("Call GB/s (fraction of copy)",
                  f"{v['call']['gb_per_s']:.1f} ({v['call']['fraction_of_copy']:.0%})")]  # fmt: skip
        if v["kernel"]:
            rows += [("Kernel time (us)", 1e6 * v["kernel"]["seconds"]),
                     ("Kernel GB/s (fraction of copy)",
                      f"{v['kernel']['gb_per_s']:.1f} ({v['kernel']['fraction_of_copy']:.0%})")]  # fmt: skip
    rows += [("Verdict", None), ("Judged on", f"{result['judged_variant']} {result['judged_timing']}"),
             ("Fraction of copy (target >= 70%)", f"{result['fraction_of_copy']:.0%}"),
             ("Meets target (and correct)", str(result["meets_target"]))]  # fmt: skip
    return format_table("Paged-Attention Decode Benchmark", rows)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers `kernels` under `ringllm bench`."""
    parser = add_command(
        bench_subparsers,
        "kernels",
        help="paged-attention decode: achieved GB/s vs the device's copy bandwidth",
        description=__doc__,
        run=run_kernels_command,
    )
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--cpu-kernels", choices=("c", "torch", "emulator"), default="c",
        help="on --device cpu: the C kernels the engine runs (every set this CPU has, beside "
        "TorchOps; default), TorchOps alone, or the .cu kernels through the CPU emulator (slow)",
    )  # fmt: skip
    for name, help_text in (
        ("batch-size", "requests in the step"), ("context-len", "cached tokens per request"),
        ("num-heads", "query heads"), ("num-kv-heads", "KV heads"),
        ("head-size", "elements per head"), ("block-size", "tokens per KV-cache block"),
    ):  # fmt: skip
        defaults = "/".join(str(DEFAULT_SHAPES[d][name.replace("-", "_")]) for d in ("cuda", "cpu"))
        parser.add_argument(f"--{name}", type=int, default=None,
                            help=f"{help_text} (default cuda/cpu: {defaults})")  # fmt: skip
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="query (and by default cache) dtype (default bfloat16)",
    )
    parser.add_argument("--kv-cache-dtype", choices=["auto", *KV_CACHE_DTYPES], default="auto",
                        help="the cache's own type (auto: --dtype's); bytes moved count it")  # fmt: skip
    parser.add_argument("--partition-tokens", type=int, default=512,
                        help="context tokens per CTA in the partitioned variant")  # fmt: skip
    parser.add_argument("--iterations", type=int, default=50, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before them")
    parser.add_argument("--copy-bytes", type=int, default=None,
                        help="copy-bandwidth buffer size (default cuda 1 GiB, cpu 64 MiB)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results")
    return parser


def run_kernels_command(args: argparse.Namespace) -> int:
    if args.json and not Path(args.json).absolute().parent.is_dir():
        raise ValueError(f"json: folder {Path(args.json).absolute().parent} does not exist")
    result = run_kernel_bench(args)
    write_report(result, kernels_table(result), args.json)
    return 0 if result["all_correct"] else 1
