"""`ringllm bench`: the benchmark tools, one sub-subcommand each, and the one way to add one.

A bench module (`throughput`, `latency`, `serve`, ...) registers its command with
`add_command`, which gives every `ringllm bench NAME` the same shape: the module's docstring
as its description and `args.func` set to the module's runner. This module then only lists
the modules, in the order `ringllm bench --help` names them; a later bench is one name in
`COMMAND_MODULES`. The benches: `throughput`, `latency` (offline, through `LLM`), `serve`
(online, over HTTP or the IPC client), `ipc` (rings vs pyzmq+msgpack) and `kernels` (the
paged-attention decode kernel vs copy bandwidth), `step` (one decode step and its profile),
`lifecycle` (restart after kill -9, sleep mode's memory), `spec` (speculative decoding vs
plain), `mm` (images vs text of the same prompt length), `tiers` (the KV tiers: swap vs
recompute preemption, multi-turn prefix offload), `pp` (pipeline parallelism vs one
process), `hosts` (the step time a host hop adds), `qgemm` (the quantized matrix kernels vs the
bf16 product and copy bandwidth), `qgemm-ab` (two builds of those kernels called in turn),
`llamacpp` and `llamacpp-serve` (a GGUF file here and in llama.cpp, one user and many), `llamacpp-greedy` (the two engines' greedy tokens, and where
they part), `membw` (the memory bandwidth the decode figures are read against), `kv-capacity` (long
sequences held at once with sliding-window layers freeing their blocks, and without),
`embed` (embeddings per second against sentence-transformers and vLLM), `lora` (what
LoRA adapters cost against the base model). A module named `a_b` is the command `a-b`. Every bench takes its requests from
`ringllm.tools.bench.datasets` and writes its table and result JSON through
`ringllm.tools.bench.report`.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

# Modules under ringllm.tools.bench, each with an `add_parser(bench_subparsers)`.
COMMAND_MODULES = (
    "throughput",
    "latency",
    "serve",
    "ipc",
    "kernels",
    "step",
    "lifecycle",
    "spec",
    "mm",
    "tiers",
    "pp",
    "hosts",
    "qgemm",
    "qgemm_ab",
    "llamacpp",
    "llamacpp_serve",
    "llamacpp_greedy",
    "membw",
    "kv_capacity",
    "embed",
    "lora",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds `bench` under the `ringllm` console script, one sub-subcommand per module."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: throughput, latency, serve, spec, mm, tiers, pp, hosts, ipc, kernels, "
        "qgemm, qgemm-ab, llamacpp, llamacpp-serve, llamacpp-greedy, membw, kv-capacity, embed, lora",
    )
    bench_subparsers = parser.add_subparsers(
        dest="bench_command", required=True, metavar="BENCHMARK"
    )
    for name in COMMAND_MODULES:
        importlib.import_module(f"ringllm.tools.bench.{name}").add_parser(bench_subparsers)


def add_command(
    bench_subparsers: argparse._SubParsersAction,
    name: str,
    *,
    help: str,
    description: str | None,
    run: Callable[[argparse.Namespace], int | None],
) -> argparse.ArgumentParser:
    """Registers `ringllm bench NAME`: the parser its module then adds its flags to.

    `description` is the module's docstring (shown as written: its line breaks kept);
    `run(args)` is what the command does, its return the exit status."""
    parser = bench_subparsers.add_parser(
        name,
        help=help,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=run)
    return parser
