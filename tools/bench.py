"""`ringllm bench`: the benchmark tools, one sub-subcommand each.

This module only wires them: `throughput` and `latency` (offline, through `LLM`) are
always there; `ipc` comes from `ringllm.tools.bench_ipc` when that module is installed.
Every tool shares the datasets of `ringllm.tools.datasets` and the reporting of
`ringllm.tools.bench_report`.
"""

from __future__ import annotations

import argparse
import importlib

from ringllm.tools import bench_latency, bench_throughput

OPTIONAL_TOOLS = ("ringllm.tools.bench_ipc", "ringllm.tools.bench_kernels", "ringllm.tools.bench_serve")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks: throughput, latency (and ipc when installed)"
    )
    bench_subparsers = parser.add_subparsers(
        dest="bench_command", required=True, metavar="BENCHMARK"
    )
    bench_throughput.add_parser(bench_subparsers)
    bench_latency.add_parser(bench_subparsers)
    for name in OPTIONAL_TOOLS:
        module = _import_optional(name)
        if module is not None:
            module.add_parser(bench_subparsers)


def _import_optional(name: str):
    """The module, or None when it is not there; an error inside it still surfaces."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        return None
