"""`ringllm bench membw`: how fast this machine streams memory into T threads, in GB/s.

One-user decode on a CPU reads every weight once per token and does a few FLOPs per
byte, so its ceiling is the read bandwidth of the cores it runs on, not their arithmetic.
This bench measures that ceiling the way a decode step spends it: a plain streaming read.

    read   torch.sum over a float32 buffer of --buffer-bytes (default 1 GiB, far past
           the caches): bytes counted = the buffer once
    copy   dst.copy_(src) over two buffers of half that size each: bytes counted =
           read + write (the copy figure is shown beside, as `bench kernels` uses it)

Each is run `--repeats` times with `torch.set_num_threads(--threads)` after one untimed
pass (which also faults the pages in); the best pass is the figure (the machine is
shared: the slower passes measure the neighbours). GB are 1e9 bytes.
`bench llamacpp` calls `measure_bandwidth` to turn decode tok/s into a fraction of it.

The other thing a figure on a shared machine needs is how much of the cores other
processes took meanwhile: `measure_with_neighbours(work)` adds `others_cpu_share` =
(the machine's busy CPU-seconds from /proc/stat - this process's and its finished
children's own) / (cores x wall time) to what `work()` measured.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from typing import Any

from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.flags import check_at_least
from ringllm.tools.bench.report import format_table, machine_info, write_report

GIB = 1 << 30
DEFAULT_BUFFER_BYTES = GIB
DEFAULT_REPEATS = 5
FLOAT32_BYTES = 4


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "membw",
        help="memory bandwidth: a streaming read (torch sum) and a copy, with T threads",
        description=__doc__,
        run=run_membw_command,
    )
    add_membw_args(parser)
    parser.add_argument("--threads", type=int, default=None, help="threads (default: torch's)")
    parser.add_argument(
        "--result-json", "--output-json", dest="result_json", default=None,
        help="also write the results as JSON to this file",
    )  # fmt: skip


def add_membw_args(parser: argparse.ArgumentParser) -> None:
    """The buffer flags; shared with `bench llamacpp`, which measures in the same run."""
    group = parser.add_argument_group("bandwidth")
    group.add_argument(
        "--buffer-bytes", type=int, default=DEFAULT_BUFFER_BYTES,
        help=f"bytes streamed per pass (default {DEFAULT_BUFFER_BYTES}: 1 GiB)",
    )  # fmt: skip
    group.add_argument(
        "--repeats", type=int, default=DEFAULT_REPEATS,
        help=f"timed passes, the best kept (default {DEFAULT_REPEATS})",
    )  # fmt: skip


def check_membw_args(args: argparse.Namespace) -> None:
    check_at_least(args, (("buffer_bytes", "bytes", 1 << 20), ("repeats", "passes", 1)))


def _best_gbps(work, num_bytes: int, repeats: int) -> tuple[float, list[float]]:
    work()  # untimed: pages faulted in, thread pool started
    passes_gbps = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        work()
        passes_gbps.append(num_bytes / (time.perf_counter() - start_s) / 1e9)
    return max(passes_gbps), passes_gbps


def _read_gbps(num_floats: int, repeats: int) -> tuple[float, list[float]]:
    import torch

    buffer = torch.ones(num_floats, dtype=torch.float32)
    return _best_gbps(buffer.sum, num_floats * FLOAT32_BYTES, repeats)


def _copy_gbps(num_floats: int, repeats: int) -> tuple[float, list[float]]:
    import torch

    src = torch.ones(num_floats, dtype=torch.float32)
    dst = torch.empty_like(src)
    return _best_gbps(lambda: dst.copy_(src), 2 * num_floats * FLOAT32_BYTES, repeats)


def measure_bandwidth(
    num_threads: int | None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    repeats: int = DEFAULT_REPEATS,
) -> dict[str, Any]:
    """Best-of-`repeats` read and copy bandwidth in GB/s with `num_threads` torch threads
    (the previous thread count is restored after)."""
    import torch

    threads_before = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        num_floats = buffer_bytes // FLOAT32_BYTES
        read_gbps, read_passes = _read_gbps(num_floats, repeats)
        copy_gbps, copy_passes = _copy_gbps(num_floats // 2, repeats)
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads_before)
    return {
        "threads": threads,
        "buffer_bytes": num_floats * FLOAT32_BYTES,
        "repeats": repeats,
        "method": "read: torch.sum(float32); copy: Tensor.copy_, read + write bytes",
        "read_gbps": read_gbps,
        "copy_gbps": copy_gbps,
        "read_passes_gbps": read_passes,
        "copy_passes_gbps": copy_passes,
    }


# ---- the neighbours ------------------------------------------------------------------


def busy_cpu_s() -> float:
    """CPU-seconds the whole machine has spent busy (Linux /proc/stat; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            jiffies = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = jiffies[3] + jiffies[4]  # idle + iowait
    return (sum(jiffies) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """This process's CPU-seconds (every thread) and its finished children's (llama-bench)."""
    here = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return here.ru_utime + here.ru_stime + children.ru_utime + children.ru_stime


def measure_with_neighbours(work) -> dict[str, Any]:
    """`work()`'s dict plus `others_cpu_share`: the part of the machine's cores that other
    processes took meanwhile (the machine is shared; a round with a busy neighbour is
    slow for a reason that is not the engine's, and llama.cpp's spinning threads suffer
    from it most)."""
    busy0, own0, wall0 = busy_cpu_s(), own_cpu_s(), time.perf_counter()
    measured = work()
    wall_s = time.perf_counter() - wall0
    others_s = max(0.0, (busy_cpu_s() - busy0) - (own_cpu_s() - own0))
    # /proc/stat counts in ticks (10 ms): a very short `work` can read over 1; clipped
    measured["others_cpu_share"] = min(1.0, others_s / ((os.cpu_count() or 1) * wall_s))
    return measured


def membw_rows(bandwidth: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        ("Threads", bandwidth["threads"]),
        ("Buffer (MiB)", bandwidth["buffer_bytes"] // (1 << 20)),
        ("Read bandwidth, best pass (GB/s)", bandwidth["read_gbps"]),
        ("Copy bandwidth, best pass (GB/s)", bandwidth["copy_gbps"]),
    ]


def run_membw_command(args: argparse.Namespace) -> int:
    check_membw_args(args)
    if args.threads is not None:
        check_at_least(args, (("threads", "threads", 1),))
    result = measure_bandwidth(args.threads, args.buffer_bytes, args.repeats)
    result["machine"] = machine_info()
    write_report(result, format_table("Memory Bandwidth", membw_rows(result)), args.result_json)
    return 0
