"""`ringllm bench`: the benchmark tools, one sub-subcommand each.

This module only wires them: `throughput`, `latency` (offline, through `LLM`), `serve`
(online, over HTTP or the IPC client), `ipc` (rings vs pyzmq+msgpack) and `kernels` (the
paged-attention decode kernel vs copy bandwidth), `lifecycle` (restart after kill -9, sleep
mode's memory), `mm` (images vs text of the same prompt length: TTFT, the encoder's share,
throughput), `tiers` (the KV tiers: swap vs recompute preemption, multi-turn prefix
offload), `pp` (pipeline parallelism vs one process: throughput, TTFT, each stage's
waits and bubble), `hosts` (the step time a host hop adds: one host against two). Every tool shares the datasets of
`ringllm.tools.datasets` and the reporting of `ringllm.tools.bench_report`.
"""

from __future__ import annotations

import argparse

from ringllm.tools import (
    bench_hosts,
    bench_ipc,
    bench_kernels,
    bench_latency,
    bench_lifecycle,
    bench_mm,
    bench_pp,
    bench_serve,
    bench_spec,
    bench_step,
    bench_throughput,
    bench_tiers,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: throughput, latency, serve, spec, mm, tiers, pp, hosts, ipc, kernels",
    )
    bench_subparsers = parser.add_subparsers(
        dest="bench_command", required=True, metavar="BENCHMARK"
    )
    for module in (
        bench_throughput,
        bench_latency,
        bench_serve,
        bench_ipc,
        bench_kernels,
        bench_step,
        bench_lifecycle,
        bench_spec,
        bench_mm,
        bench_tiers,
        bench_pp,
        bench_hosts,
    ):
        module.add_parser(bench_subparsers)
