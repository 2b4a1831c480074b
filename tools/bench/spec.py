"""`ringllm bench spec`: speculative decoding side by side with plain decoding, in one run.

Two engines with the same flags, one with `--speculative-config` and one without, run the
same batches of `--batch-size` requests from the dataset (`--dataset code-edit` is the
input-grounded one; `random` the throughput one); iterations alternate between them
(plain, speculative, plain, ...) after untimed warm-ups, so a noisy machine slows both
alike, and the prefix cache is emptied before each one. Reported: output tokens per
second of each (median over iterations) and their ratio, the drafts' acceptance (rate,
mean accepted run + 1, per position), and at temperature 0 how many outputs are
token-identical to plain decoding's.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from typing import Any

import numpy as np

from ringllm.pipeline.config import add_cli_args, from_cli_args
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.datasets import add_dataset_args, sample_requests
from ringllm.tools.bench.flags import check_at_least
from ringllm.tools.bench.report import (
    add_report_args,
    check_result_json_path,
    format_table,
    machine_info,
    write_report,
)
from ringllm.tools.bench.throughput import make_llm, workload_config


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "spec",
        help="speculative decoding against plain decoding, side by side",
        description=__doc__,
        run=run_spec_command,
    )
    group = parser.add_argument_group("workload")
    group.add_argument("--batch-size", type=int, default=1, help="requests per iteration")
    group.add_argument("--num-iters", type=int, default=5, help="timed iterations of each")
    group.add_argument("--num-iters-warmup", type=int, default=1, help="untimed ones first")
    group.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default greedy)"
    )
    group.add_argument(
        "--ignore-eos", action="store_true", help="every request generates its whole output"
    )
    add_dataset_args(parser)
    add_report_args(parser)
    add_cli_args(parser)
    parser.set_defaults(dataset="code-edit", num_prompts=None)


def run_spec(args: argparse.Namespace) -> dict[str, Any]:
    check_at_least(args, (("batch_size", "", 1), ("num_iters", "", 1), ("num_iters_warmup", "", 0)))
    check_result_json_path(args.result_json)
    config = from_cli_args(args)
    if not config.speculative.enabled:
        raise ValueError("speculative_config: bench spec needs --speculative-config JSON")
    plain_config = dataclasses.replace(
        config, speculative=dataclasses.replace(config.speculative, speculative_config=None)
    )
    load_before = machine_info()
    with make_llm(plain_config) as plain, make_llm(config) as spec:
        result = _side_by_side(args, plain, spec)
    result["config"] = workload_config(args, config)
    result["config"]["workload"].update(
        {k: getattr(args, k) for k in ("batch_size", "num_iters", "temperature")}
    )
    result["machine_before"] = load_before
    result["machine_after"] = machine_info()
    return result


def _side_by_side(args: argparse.Namespace, plain, spec) -> dict[str, Any]:
    from ringllm.pipeline import SamplingParams

    args.num_prompts = args.num_prompts or args.batch_size
    seed = args.seed or 0  # the engine's --seed: of the dataset and the seeded requests
    requests = sample_requests(args, plain.get_tokenizer(), seed)[: args.batch_size]
    prompts = [
        r.prompt if isinstance(r.prompt, str) else {"prompt_token_ids": r.prompt} for r in requests
    ]
    params = [
        SamplingParams(
            max_tokens=r.expected_output_len,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            seed=None if args.temperature == 0 else seed + i,
        )
        for i, r in enumerate(requests)
    ]

    def one_iteration(llm) -> tuple[float, list[list[int]]]:
        llm.reset_prefix_cache()
        start_s = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start_s
        return elapsed, [list(o.outputs[0].token_ids) for o in outputs]

    for _ in range(args.num_iters_warmup):
        one_iteration(plain)
        one_iteration(spec)
    counts_before = copy.deepcopy(spec.llm_engine.front_end.spec_decoding)
    times = {"plain": [], "spec": []}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.num_iters):
        for name, llm in (("plain", plain), ("spec", spec)):
            elapsed, out = one_iteration(llm)
            times[name].append((elapsed, sum(len(t) for t in out)))
            tokens[name] = out
    counts = spec.llm_engine.front_end.spec_decoding
    drafts = counts.num_drafts - counts_before.num_drafts
    draft_tokens = counts.num_draft_tokens - counts_before.num_draft_tokens
    accepted = counts.num_accepted_tokens - counts_before.num_accepted_tokens
    per_pos = [
        c - (counts_before.accepted_per_pos[i] if i < len(counts_before.accepted_per_pos) else 0)
        for i, c in enumerate(counts.accepted_per_pos)
    ]
    tok_s = {name: float(np.median([n / t for t, n in runs])) for name, runs in times.items()}
    return {
        "plain_output_tok_s": tok_s["plain"],
        "spec_output_tok_s": tok_s["spec"],
        "speedup": tok_s["spec"] / tok_s["plain"],
        "plain_latency_s": [t for t, _ in times["plain"]],
        "spec_latency_s": [t for t, _ in times["spec"]],
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "acceptance_per_position": [c / drafts for c in per_pos] if drafts else [],
        "identical_outputs": sum(
            a == b for a, b in zip(tokens["plain"], tokens["spec"], strict=True)
        ),
        "num_requests": len(prompts),
        "output_tokens_per_iteration": {k: v[-1][1] for k, v in times.items()},
    }


def spec_table(result: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("Requests per iteration", result["num_requests"]),
        ("Plain output tok/s (median)", result["plain_output_tok_s"]),
        ("Speculative output tok/s (median)", result["spec_output_tok_s"]),
        ("Speedup", result["speedup"]),
        ("Draft acceptance rate", result["acceptance_rate"]),
        ("Mean acceptance length", result["mean_acceptance_length"]),
        (
            "Acceptance per position",
            " ".join(f"{x:.2f}" for x in result["acceptance_per_position"]) or "-",
        ),
        (
            "Outputs identical to plain",
            f"{result['identical_outputs']} / {result['num_requests']}",
        ),
    ]
    return format_table("Speculative Decoding Benchmark Result", rows)


def run_spec_command(args: argparse.Namespace) -> int:
    result = run_spec(args)
    write_report(result, spec_table(result), args.result_json)
    return 0
