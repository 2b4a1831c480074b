"""`ringllm bench qgemm`: the quantized matrix kernels (pipeline/ops/quant.py) on the CPU.

Two figures per block type and matrix shape [n, k], each against a reference measured in
the same run:

    GEMV (m = 1, decode)   GB/s of weight bytes streamed = qm.nbytes / time per call,
                           and its fraction of the read bandwidth (`bench membw`'s
                           streaming read of --copy-bytes, the ceiling a decode step
                           has) and of the copy bandwidth (a preallocated dst.copy_(src):
                           read + write bytes / time); the calls rotate through copies
                           of the matrix (--rotate-bytes, beyond the last-level cache)
                           so the weights come from memory
    tiled (m = 32 ...)     GOP/s = 2 m n k / time (one int8 multiply-add counted as two)

beside the bfloat16 product the engine runs for a bf16 checkpoint computing in float32
(pipeline/models/linear.py: `prepack(w, float32)` then `linear`), on the same shape. The
weights are random valid blocks (random quants, small finite fp16 scales): the kernels'
time does not depend on the values. Each figure is the median of calls repeated for
--min-time-s after one warm-up call; the machine's other load shows in it. The GEMV also
shows the fastest call, what the kernel does when no neighbour takes its cores (on a
shared machine one descheduled thread stalls the other at the join).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.report import format_table, write_report

DEFAULT_SHAPES = "2048x2048,8960x1536"
DEFAULT_ROWS = "1,32,128,512"


def parse_shapes(text: str, types: str = "all") -> list[tuple[int, int]]:
    """NxK,...: k a multiple of 256 (the K-quants' blocks), or of 32 where `types` names
    none of them (q4_0 .. q8_0, i8, bf16: a model's own shapes, 576 wide)."""
    k_quants = types == "all" or any(t.strip().endswith("_k") for t in types.split(","))
    step = 256 if k_quants else 32
    shapes = []
    for part in text.split(","):
        try:
            n, k = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"shapes: {part!r} is not NxK (e.g. 2048x2048)") from None
        if n < 1 or k < step or k % step:
            raise ValueError(
                f"shapes: {part!r}: n >= 1 and k a multiple of {step}"
                + (" (K-quant blocks)" if k_quants else "")
            )
        shapes.append((n, k))
    return shapes


def random_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Valid GGUF blocks of a [n, k] matrix: random bytes, fp16 scales set small and finite."""
    from ringllm.pipeline.ops.quant import GGML_TYPES

    ggml_type = {name: t for t, name in GGML_TYPES.items()}[qtype]
    block_k, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // block_k, block_bytes), dtype=np.uint8)
    halves = (rng.standard_normal((n, k // block_k, 2)) * 0.01).astype(np.float16)
    if qtype == "q6_k":
        blocks[..., 208:210] = halves[..., :1].view(np.uint8)
    else:
        blocks[..., 0:4] = halves.view(np.uint8).reshape(n, k // block_k, 4)
    return blocks.reshape(n, -1)


def call_times_s(fn: Callable[[], object], min_time_s: float) -> list[float]:
    fn()
    times = []
    start = time.perf_counter()
    while not times or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_call_s(fn: Callable[[], object], min_time_s: float) -> float:
    return statistics.median(call_times_s(fn, min_time_s))


def copy_gbps(copy_bytes: int, min_time_s: float) -> float:
    src = torch.ones(copy_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * copy_bytes / median_call_s(lambda: dst.copy_(src), min_time_s) / 1e9


def make_matrix(qtype: str, n: int, k: int, kernel_set: str, seed: int):
    from ringllm.pipeline.ops import quant

    if qtype in ("i8", "bf16"):
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
        if qtype == "bf16":
            return quant.pack_bf16(weight.to(torch.bfloat16), kernel_set)
        return quant.pack_int8(weight, kernel_set)
    return quant.pack_gguf(qtype, random_blocks(qtype, n, k, seed), n, k, kernel_set)


def cold_copies(qm, rotate_bytes: int) -> list:
    """Enough copies of the matrix to pass `rotate_bytes`: called in turn, each call reads
    its weights from memory, as a decode step reads every layer's (the caches hold none)."""
    from ringllm.pipeline.ops.quant import QuantMatrix

    count = max(1, -(-rotate_bytes // qm.nbytes))
    return [qm] + [
        QuantMatrix(qm.qtype, qm.n, qm.k, qm.data.clone(), qm.kernel_set) for _ in range(count - 1)
    ]


def bench_matrix(
    qm, rows: list[int], threads: int, min_time_s: float, rotate_bytes: int
) -> dict[str, Any]:
    from ringllm.pipeline.ops import quant

    n, k = qm.shape
    result: dict[str, Any] = {"bytes": qm.nbytes, "bits_per_weight": 8 * qm.nbytes / (n * k)}
    cold = cold_copies(qm, rotate_bytes)
    for m in rows:
        x = torch.randn(m, k)
        out = torch.empty(m, n)
        # the GEMV rows are memory-bound: timed over the cold copies; the tiled ones on one
        turn = iter(range(1 << 62))
        mats = cold if m <= 4 else [qm]
        times = call_times_s(
            lambda x=x, out=out, mats=mats, turn=turn: quant.qlinear(
                x, mats[next(turn) % len(mats)], out=out, threads=threads
            ),
            min_time_s,
        )
        t = statistics.median(times)
        result[f"m{m}"] = {
            "time_s": t,
            "weight_gbps": qm.nbytes / t / 1e9,
            "best_weight_gbps": qm.nbytes / min(times) / 1e9,
            "gops": 2 * m * n * k / t / 1e9,
        }
    return result


def bench_bf16(
    n: int, k: int, rows: list[int], min_time_s: float, rotate_bytes: int
) -> dict[str, Any]:
    from ringllm.pipeline.models.linear import linear, prepack

    count = max(1, -(-rotate_bytes // (n * k * 2)))
    weights = [prepack(torch.randn(n, k).to(torch.bfloat16), torch.float32) for _ in range(count)]
    result: dict[str, Any] = {"bytes": n * k * 2}
    for m in rows:
        x = torch.randn(m, k)
        turn = iter(range(1 << 62))
        mats = weights if m <= 4 else weights[:1]
        times = call_times_s(
            lambda x=x, mats=mats, turn=turn: linear(x, mats[next(turn) % len(mats)]), min_time_s
        )
        t = statistics.median(times)
        result[f"m{m}"] = {
            "time_s": t,
            "weight_gbps": n * k * 2 / t / 1e9,
            "best_weight_gbps": n * k * 2 / min(times) / 1e9,
            "gops": 2 * m * n * k / t / 1e9,
        }
    return result


def run_qgemm_bench(args: argparse.Namespace) -> dict[str, Any]:
    from ringllm.pipeline.ops import quant
    from ringllm.tools.bench.membw import measure_bandwidth

    shapes, rows = parse_shapes(args.shapes, args.types), [int(v) for v in args.rows.split(",")]
    if any(m < 1 for m in rows):
        raise ValueError(f"rows: every m must be >= 1, got {args.rows}")
    sets = quant.kernel_sets() if args.kernel_sets == "all" else args.kernel_sets.split(",")
    types = quant.QUANT_TYPES if args.types == "all" else args.types.split(",")
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "threads": args.threads,
        "copy_gbps": copy_gbps(args.copy_bytes, args.min_time_s),
        "read_gbps": measure_bandwidth(args.threads, args.copy_bytes)["read_gbps"],
        "shapes": {},
    }
    for n, k in shapes:
        entry: dict[str, Any] = {"bf16": bench_bf16(n, k, rows, args.min_time_s, args.rotate_bytes)}
        for kernel_set in sets:
            for qtype in types:
                if qtype == "bf16" and kernel_set not in quant.BF16_SETS:
                    continue  # bf16 tiles are the tile unit's only
                qm = make_matrix(qtype, n, k, kernel_set, args.seed)
                entry[f"{qtype}/{kernel_set}"] = bench_matrix(
                    qm, rows, args.threads, args.min_time_s, args.rotate_bytes
                )
        result["shapes"][f"{n}x{k}"] = entry
    return result


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def qgemm_table(result: dict[str, Any]) -> str:
    copy, read = result["copy_gbps"], result["read_gbps"]
    rows: list[tuple[str, Any]] = [
        ("CPU", result["cpu_model"]),
        ("Threads", result["threads"]),
        ("Read bandwidth (GB/s, bench membw)", read),
        ("Copy bandwidth (GB/s, read+write)", copy),
    ]
    for shape, entry in result["shapes"].items():
        rows.append((f" {shape} ", None))
        ms = [key for key in entry["bf16"] if key.startswith("m")]
        for name, r in entry.items():
            gemv = r.get("m1")
            if gemv:
                median, best = gemv["weight_gbps"], gemv["best_weight_gbps"]
                rows.append(
                    (
                        f"{name} m=1 GB/s (x read, x copy), best",
                        f"{median:.1f} ({median / read:.2f}, {median / copy:.2f}), "
                        f"{best:.1f} ({best / read:.2f})",
                    )
                )
            tiled = " ".join(f"{r[m]['gops']:.0f}" for m in ms if m != "m1")
            if tiled:
                rows.append((f"{name} GOP/s at {','.join(m[1:] for m in ms if m != 'm1')}", tiled))
    return format_table("Quantized GEMM Benchmark", rows)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers `qgemm` under `ringllm bench`."""
    parser = add_command(
        bench_subparsers,
        "qgemm",
        help="quantized matrix kernels: GEMV GB/s vs memory bandwidth, tiled GOP/s vs bf16",
        description=__doc__,
        run=run_qgemm_command,
    )
    parser.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help=f"NxK,... (default {DEFAULT_SHAPES})"
    )
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"m values (default {DEFAULT_ROWS})")
    parser.add_argument("--types", default="all", help="q4_0,q4_k,... or all")
    parser.add_argument("--kernel-sets", default="all", help="generic,avx2,... or all")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-time-s", type=float, default=0.3, help="timed calls per figure")
    parser.add_argument(
        "--copy-bytes", type=int, default=256 << 20,
        help="buffer bytes of the read and copy bandwidth figures",
    )  # fmt: skip
    parser.add_argument(
        "--rotate-bytes", type=int, default=128 << 20,
        help="GEMV rows (m <= 4) rotate through copies of the matrix totalling this, so the "
        "weights come from memory, not the caches (0: one copy, cache-hot)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results")
    return parser


def run_qgemm_command(args: argparse.Namespace) -> int:
    if args.json and not Path(args.json).absolute().parent.is_dir():
        raise ValueError(f"json: folder {Path(args.json).absolute().parent} does not exist")
    result = run_qgemm_bench(args)
    write_report(result, qgemm_table(result), args.json)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m ringllm.tools.bench.qgemm")
    add_parser(_parser.add_subparsers())
    _args = _parser.parse_args(["qgemm", *__import__("sys").argv[1:]])
    raise SystemExit(_args.func(_args))
