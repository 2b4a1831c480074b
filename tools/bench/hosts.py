"""`ringllm bench hosts`: what a host hop adds to an engine step (#21), side by side.

For each parallel layout of `--layouts` (`pp2`, `tp2`, `pp2xtp2`, ...), two engines alike
but for where their ranks run:

    one host    every rank a process of this host (the batch ring straight to each)
    two hosts   half the ranks behind `ringllm serve --headless --node-rank 1`, started
                here on `--master-addr` (default 127.0.0.1: a "host" on loopback; give a
                second machine's own run of it with --external-headless to cross a real
                network): the records go over its NodeLink and its ring, and the stage
                boundary (PP) or the all-reduces (TP) over TCP between the hosts

Each runs one request of `--input-len` tokens decoding `--output-len` tokens, in process
(`EngineCore.step`, no front end), `--num-iters` times; the figure is the median time of a
step that returned a token, and the hop's cost the difference two hosts minus one. Rounds
alternate the engines so a noisy machine slows them alike. Every rank gets `--num-threads`
threads (default 1): on one machine the "hosts" share its cores, so a layout that gave each
host's ranks every core would oversubscribe them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import subprocess
import sys
import time
from typing import Any

from ringllm.pipeline.config import EngineConfig, add_cli_args, config_to_dict, from_cli_args
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.flags import parse_names
from ringllm.tools.bench.report import (
    add_report_args,
    check_result_json_path,
    format_table,
    machine_info,
    write_report,
)

LAYOUTS = {
    "pp2": dict(pipeline_parallel_size=2),
    "tp2": dict(tensor_parallel_size=2),
    "pp2xtp2": dict(pipeline_parallel_size=2, tensor_parallel_size=2),
}
SKIPPED = ("tensor_parallel_size", "pipeline_parallel_size", "nnodes", "node_rank")
AGENT_SETTLE_S = 3.0  # a headless host with bad flags exits within this


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "hosts",
        help="the step time a host hop adds (one host vs two, PP and TP)",
        description=__doc__,
        run=run_hosts_command,
    )
    group = parser.add_argument_group("workload")
    group.add_argument("--layouts", default="pp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    group.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    group.add_argument("--output-len", type=int, default=128, help="tokens decoded per run")
    group.add_argument("--num-iters", type=int, default=3, help="timed runs of each engine")
    group.add_argument(
        "--external-headless",
        action="store_true",
        help="the second host's `ringllm serve --headless` runs elsewhere (not started here)",
    )
    add_report_args(parser)
    add_cli_args(parser, skip=SKIPPED)


def parse_layouts(text: str) -> list[str]:
    return parse_names("layouts", text, tuple(LAYOUTS))


def run_hosts_command(args: argparse.Namespace) -> None:
    try:
        layouts = parse_layouts(args.layouts)
        if args.input_len < 1 or args.output_len < 2 or args.num_iters < 1:
            raise ValueError("input_len >= 1, output_len >= 2 and num_iters >= 1, please")
        check_result_json_path(args.result_json)
        if args.num_threads is None:
            args.num_threads = 1
        base = from_cli_args(args)
    except ValueError as exc:
        raise SystemExit(f"ringllm bench hosts: {exc}") from None
    rows, results = [], {}
    for name in layouts:
        one, two = measure_layout(base, LAYOUTS[name], args)
        results[name] = {"one_host_step_ms": one, "two_hosts_step_ms": two, "hop_ms": two - one}
        rows += [
            (name, None),
            ("Step, one host (ms, median)", f"{one:.3f}"),
            ("Step, two hosts (ms, median)", f"{two:.3f}"),
            ("Added by the host hop (ms)", f"{two - one:+.3f}"),
        ]
    result = {"machine": machine_info(), "layouts": results}
    write_report(result, format_table("Host Hop Benchmark Result", rows), args.result_json)


def measure_layout(base: EngineConfig, layout: dict, args) -> tuple[float, float]:
    """Median step ms on one host and on two (alternating rounds)."""
    one_host = _config(base, layout, nnodes=1)
    two_hosts = _config(base, layout, nnodes=2)
    steps: dict[bool, list[float]] = {False: [], True: []}
    with _engine(one_host, args) as single, _engine(two_hosts, args) as pair:
        for _ in range(args.num_iters):
            for across, core in ((False, single), (True, pair)):
                steps[across] += _decode_steps(core, args.input_len, args.output_len)
    return statistics.median(steps[False]) * 1e3, statistics.median(steps[True]) * 1e3


def _config(base: EngineConfig, layout: dict, nnodes: int) -> EngineConfig:
    parallel = dataclasses.replace(base.parallel, nnodes=nnodes, node_rank=0, **layout)
    return dataclasses.replace(base, parallel=parallel)


@contextlib.contextmanager
def _engine(config: EngineConfig, args):
    from ringllm.pipeline.engine.engine_core import EngineCore

    agent = None
    if config.parallel.nnodes > 1 and not args.external_headless:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in _headless_args(config).items()]
        agent = subprocess.Popen(
            [sys.executable, "-m", "ringllm.server.cli", "--headless", *flags],
            stdout=subprocess.DEVNULL,
        )
        time.sleep(AGENT_SETTLE_S)
        if agent.poll() is not None:  # else the head would wait for it START_TIMEOUT_S
            raise SystemExit(f"ringllm bench hosts: the headless host exited ({agent.returncode})")
    try:
        core = EngineCore(config)
        try:
            _decode_steps(core, 8, 4)  # warm-up
            yield core
        finally:
            core.shutdown()
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)


def _headless_args(config: EngineConfig) -> dict[str, Any]:
    """The second host's flags: the layout and where the head is (the rest of the engine's
    arguments it takes from the head)."""
    parallel = config.parallel
    return {
        "nnodes": parallel.nnodes,
        "node_rank": 1,
        "master_addr": parallel.master_addr,
        "master_port": parallel.master_port,
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "model": config_to_dict(config)["model"],
    }


def _decode_steps(core, input_len: int, output_len: int) -> list[float]:
    """The times of the steps that returned a token, for one request alone."""
    from ringllm.pipeline.messages import EngineCoreRequest
    from ringllm.pipeline.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    rid = f"bench-{time.monotonic_ns()}"
    core.add_request(EngineCoreRequest(rid, list(range(3, 3 + input_len)), params, (), 0.0))
    times = []
    while core.has_work():
        started = time.perf_counter()
        outputs = core.step()
        if any(o.new_token_ids for o in outputs):
            times.append(time.perf_counter() - started)
    return times[1:]  # the first carries the prefill
