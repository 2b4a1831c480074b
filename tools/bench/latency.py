"""`ringllm bench latency`: how long one whole batch takes, end to end.

`--batch-size` random prompts of `--input-len` tokens each generate `--output-len` tokens
(EOS ignored, so every iteration does the same work) in one `LLM.generate` call; that
call is timed `--num-iters` times after `--num-iters-warmup` untimed ones. The same
prompts are used every iteration, and the prefix cache is emptied before each one
(off the clock), so no iteration reuses another's KV blocks.

Results use vLLM's names: `avg_latency`, `latencies`, `percentiles` ({"50": s, ...}),
plus the shared `mean/median/p<P>_latency_s` summary.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from ringllm.pipeline.config import add_cli_args, from_cli_args
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.datasets.text import random_requests
from ringllm.tools.bench.flags import check_at_least
from ringllm.tools.bench.report import (
    add_report_args,
    check_result_json_path,
    format_table,
    machine_info,
    parse_percentiles,
    summarize,
    summary_rows,
    write_report,
)
from ringllm.tools.bench.throughput import make_llm, workload_config


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "latency",
        help="latency of one whole batch, over several iterations",
        description=__doc__,
        run=run_latency_command,
    )
    group = parser.add_argument_group("workload")
    group.add_argument("--batch-size", type=int, default=8, help="requests per batch")
    group.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    group.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    group.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    group.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first")
    group.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default greedy)"
    )
    add_report_args(parser)
    add_cli_args(parser)


def _check_counts(args: argparse.Namespace) -> None:
    check_at_least(
        args,
        (
            ("batch_size", "requests", 1),
            ("input_len", "tokens", 1),
            ("output_len", "tokens", 1),
            ("num_iters", "iterations", 1),
            ("num_iters_warmup", "iterations", 0),
        ),
    )


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Builds the engine, times the iterations, and returns the result dict."""
    from ringllm.pipeline import SamplingParams

    _check_counts(args)
    percentiles = parse_percentiles(args.metric_percentiles)
    check_result_json_path(args.result_json)
    config = from_cli_args(args)
    load_before = machine_info()
    llm = make_llm(config)
    requests = random_requests(
        llm.get_tokenizer(), args.batch_size, args.input_len, args.output_len, 0.0,
        config.model.seed,
    )  # fmt: skip
    prompts = [{"prompt_token_ids": r.prompt} for r in requests]
    params = SamplingParams(
        max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature
    )

    def one_iteration() -> float:
        llm.reset_prefix_cache()
        start_s = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start_s

    for _ in range(args.num_iters_warmup):
        one_iteration()
    latencies_s = [one_iteration() for _ in range(args.num_iters)]
    result: dict[str, Any] = {
        "avg_latency": sum(latencies_s) / len(latencies_s),
        "latencies": latencies_s,
        "percentiles": {f"{p:g}": float(np.percentile(latencies_s, p)) for p in percentiles},
    }
    result.update(summarize("latency_s", latencies_s, percentiles))
    result["config"] = workload_config(args, config)
    result["config"]["workload"].update(
        {k: getattr(args, k) for k in ("batch_size", "input_len", "output_len", "num_iters")}
    )
    result["machine_before"] = load_before
    result["machine_after"] = machine_info()
    return result


def latency_table(result: dict[str, Any]) -> str:
    # The JSON keeps seconds (vLLM's unit); the table shows milliseconds, easier to read.
    keys = {
        k.replace("_latency_s", "_latency_ms"): 1e3 * v
        for k, v in result.items()
        if k.endswith("_latency_s")
    }
    rows: list[tuple[str, Any]] = [("Iterations", len(result["latencies"]))]
    rows += summary_rows("Batch latency", "latency_ms", "ms", keys)
    return format_table("Latency Benchmark Result", rows)


def run_latency_command(args: argparse.Namespace) -> int:
    result = run_latency(args)
    write_report(result, latency_table(result), args.result_json)
    return 0
