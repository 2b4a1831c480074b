"""`ringllm bench kv-capacity`: how many long sequences the KV cache holds at once, with the
sliding-window layers freeing their blocks (the hybrid KV cache) and with every layer
keeping every block (`--disable-hybrid-kv-cache-manager`), in the same bytes.

Each way, one engine in this process with the flags given (set the budget with
--kv-cache-memory-bytes): `--num-requests` requests of `--context-len` tokens each
(`--context-len` - `--output-len` random prompt tokens, then `--output-len` greedy tokens,
distinct prompts: no prefix is shared) are added at once and stepped until the first one
finishes. The first request decodes one token a step while the others prefill, so with
enough output tokens every request the cache can hold is running by then. Reported:

    held at once        the most requests running in one step, and the tokens they had
                        in the cache together then
    predicted           how many such sequences the blocks hold by the manager's own
                        arithmetic: decoding, a sliding group holds its window; one
                        request at a time prefills, its sliding groups holding a chunk more
    preemptions         requests pushed out for room (0: the cache held all it admitted)
    first request       its greedy tokens and their logprobs, compared between the two
                        ways (the same keys are read, so the same numbers are expected)

`--num-requests` 0 (default): one more than the hybrid cache is predicted to hold.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from ringllm.pipeline.config import EngineConfig, add_cli_args, from_cli_args
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.flags import check_at_least, check_one_process
from ringllm.tools.bench.report import (
    add_report_args,
    check_result_json_path,
    format_table,
    machine_info,
    write_report,
)

MODES = ("hybrid", "every block")


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "kv-capacity",
        help="long sequences held at once: sliding layers freeing blocks vs keeping them",
        description=__doc__,
        run=run_kv_capacity_command,
    )
    group = parser.add_argument_group("workload")
    group.add_argument("--context-len", type=int, default=8192, help="tokens per request")
    group.add_argument("--output-len", type=int, default=64, help="greedy tokens per request")
    group.add_argument(
        "--num-requests", type=int, default=0, help="requests (0: the hybrid prediction + 1)"
    )
    add_report_args(parser)
    add_cli_args(parser)


def run_kv_capacity(args: argparse.Namespace) -> dict[str, Any]:
    check_at_least(args, [("context_len", "tokens", 2), ("output_len", "tokens", 1)])
    check_at_least(args, [("num_requests", "", 0)])
    if args.output_len >= args.context_len:
        raise ValueError(
            f"output_len: {args.output_len} tokens leave no prompt in a context of "
            f"{args.context_len}"
        )
    check_one_process(args, "the bench reads the engine core's scheduler in this process")
    config: EngineConfig = from_cli_args(args)
    if config.cache.disable_hybrid_kv_cache_manager:
        raise ValueError(
            "disable_hybrid_kv_cache_manager: the bench runs both ways itself; leave it off"
        )
    runs = {}
    num_requests = args.num_requests
    for mode in MODES:
        cache = dataclasses.replace(
            config.cache, disable_hybrid_kv_cache_manager=mode == "every block"
        )
        runs[mode] = _run_one(dataclasses.replace(config, cache=cache), args, num_requests)
        num_requests = num_requests or runs[mode]["predicted"] + 1
    hybrid, full = runs["hybrid"], runs["every block"]
    diffs = [abs(a - b) for a, b in zip(hybrid["logprobs"], full["logprobs"], strict=False)]
    return {
        "context_len": args.context_len,
        "output_len": args.output_len,
        "num_requests": num_requests,
        "runs": runs,
        "tokens_held_ratio": hybrid["peak_tokens"] / max(full["peak_tokens"], 1),
        "first_request_same_tokens": hybrid["tokens"] == full["tokens"],
        "first_request_max_logprob_diff": max(diffs, default=0.0),
        "machine": machine_info(),
    }


def _run_one(config: EngineConfig, args, num_requests: int) -> dict[str, Any]:
    from ringllm.pipeline import LLMEngine, SamplingParams

    engine = LLMEngine(config)
    try:
        core = engine.engine_core
        if core is None:
            raise ValueError("bench kv-capacity needs the engine in this process")
        if args.context_len > core.max_model_len:
            raise ValueError(
                f"context_len: {args.context_len} tokens exceed the model's max_model_len "
                f"{core.max_model_len}; pass --max-model-len"
            )
        scheduler = core.scheduler
        kv = scheduler.kv
        sched = config.scheduler
        chunk = sched.max_num_batched_tokens if sched.enable_chunked_prefill else args.context_len
        # a sequence decoding holds `steady` blocks; one prefilling a chunk holds more
        # (its sliding groups: the window and the chunk), one request at a time
        steady = kv.groups.peak_blocks(args.context_len, kv.block_size, 1)
        extra = kv.groups.peak_blocks(args.context_len, kv.block_size, chunk) - steady
        usable = kv.num_blocks - (1 if kv.groups.slides else 0)
        predicted = (usable - extra) // steady
        if predicted < 1:
            raise ValueError(
                f"kv_cache_memory_bytes: the cache ({kv.num_blocks} blocks) holds no request "
                f"of {args.context_len} tokens; give it more"
            )
        count = num_requests or predicted + 1
        prompt_len = args.context_len - args.output_len
        vocab = engine.vocab_size
        first = SamplingParams(
            temperature=0.0, max_tokens=args.output_len, ignore_eos=True, logprobs=1
        )
        rest = dataclasses.replace(first, logprobs=None)
        for i in range(count):
            ids = [(7919 * (i * prompt_len + j)) % (vocab - 10) + 5 for j in range(prompt_len)]
            engine.add_request(f"r{i}", {"prompt_token_ids": ids}, first if i == 0 else rest)
        started = time.perf_counter()
        peak_running = peak_tokens = steps = 0
        result = None
        while result is None:
            for out in engine.step():
                if out.request_id == "r0" and out.finished:
                    result = out.outputs[0]
            steps += 1
            running = scheduler.running
            held = sum(r.num_computed_tokens for r in running)
            if held > peak_tokens:
                peak_tokens, peak_running = held, len(running)
        for i in range(1, count):
            engine.abort_request(f"r{i}")
        return {
            "kv_groups": kv.groups.describe(),
            "num_blocks": kv.num_blocks,
            "block_size": kv.block_size,
            "kv_cache_dtype": core.executor.describe()["kv_cache_dtype"],
            "predicted": predicted,
            "requests": count,
            "peak_running": peak_running,
            "peak_tokens": peak_tokens,
            "preemptions": scheduler.num_preemptions,
            "steps": steps,
            "seconds": time.perf_counter() - started,
            "tokens": list(result.token_ids),
            "logprobs": [
                lp[t].logprob for t, lp in zip(result.token_ids, result.logprobs, strict=True)
            ],
        }
    finally:
        engine.shutdown()


def kv_capacity_table(result: dict[str, Any]) -> str:
    rows = [
        ("Context x requests", f"{result['context_len']} x {result['num_requests']}"),
    ]
    for mode in MODES:
        run = result["runs"][mode]
        rows += [
            (f"{mode}: layout", run["kv_groups"]),
            (
                f"{mode}: blocks",
                f"{run['num_blocks']} of {run['block_size']} tokens, {run['kv_cache_dtype']}",
            ),
            (f"{mode}: predicted sequences", str(run["predicted"])),
            (
                f"{mode}: held at once",
                f"{run['peak_running']} requests, {run['peak_tokens']} tokens",
            ),
            (
                f"{mode}: preemptions, steps, s",
                f"{run['preemptions']}, {run['steps']}, {run['seconds']:.1f}",
            ),
        ]
    rows += [
        ("Tokens held, hybrid / every block", f"{result['tokens_held_ratio']:.2f}x"),
        ("First request: same greedy tokens", str(result["first_request_same_tokens"])),
        ("First request: max |logprob diff|", f"{result['first_request_max_logprob_diff']:.2e}"),
    ]
    return format_table("KV Cache Capacity Benchmark", rows)


def run_kv_capacity_command(args: argparse.Namespace) -> int:
    check_result_json_path(args.result_json)
    result = run_kv_capacity(args)
    write_report(result, kv_capacity_table(result), args.result_json)
    return 0
