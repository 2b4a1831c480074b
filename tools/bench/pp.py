"""`ringllm bench pp`: pipeline parallelism (#20) against one process, side by side.

Each configuration of `--configs` is one in-process engine, all built first (each warmed
up with one short request); then `--num-iters-warmup` untimed and `--num-iters` timed
rounds, each running every configuration once, in an order rotated by one each round so
a noisy machine slows them alike. `--configs` is comma-separated, of

    pp1            one process, every thread (the baseline)
    ppP            P stages, the layers split evenly (vLLM's split: pipeline/models/stages.py)
    ppP:N1,...,NP  P stages of N1, ..., NP layers (a count continues the partition before
                   it: "pp1,pp2,pp2:17,13" is three configurations)

default "pp1,pp2". The first is the baseline the ratios are taken against. A round runs,
per configuration:

    throughput  `--num-prompts` random prompts of `--input-len` tokens, `--output-len`
                tokens each (EOS ignored, greedy) in one `LLM.generate` call: output tok/s
    ttft        `--ttft-requests` random prompts of `--input-len` tokens, each alone,
                `max_tokens=1`: the call's wall time (as `bench latency` times a batch),
                and the engine's own TTFT (from admission)

The prefix cache is emptied before every request or batch (off the clock). Figures are
medians over the timed rounds (TTFT: over every timed request).

Stages (configurations of P > 1): each stage's counters (pipeline/executor/stage_stats.py)
summed over the timed throughput runs: steps, ms per step, of which waiting for the
previous stage's hidden states (recv) and for the next stage to take this one's sends
(send), idle waiting for the engine core's next record (ring), KiB sent per step, and the
bubble: the share of the runs' wall time the stage was not computing,

    bubble = 1 - (step_s - recv_wait_s - send_wait_s) / wall_s

(tools/bench/pp_stages.py says why it is not taken from the waits). The engine flags
apply to every configuration but the pipeline's own (`--pipeline-parallel-size`,
`--pipeline-layer-partition`: set by `--configs`); tensor and data parallelism stay 1.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringllm.pipeline.config import EngineConfig, add_cli_args, from_cli_args
from ringllm.tools.bench import pp_stages as stages
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.datasets.text import random_requests
from ringllm.tools.bench.flags import check_at_least, check_one_process
from ringllm.tools.bench.pp_table import pp_table
from ringllm.tools.bench.report import (
    check_result_json_path,
    machine_info,
    write_report,
)
from ringllm.tools.bench.throughput import WARMUP_PROMPT_TOKENS, workload_config
from ringllm.tools.bench.tiers import engines, variant

DEFAULT_CONFIGS = "pp1,pp2"
PIPELINE_FLAGS = ("pipeline_parallel_size", "pipeline_layer_partition")
_CONFIG = re.compile(r"pp(\d+)(?::(\d+(?:,\d+)*))?")


@dataclass(frozen=True)
class PPConfig:
    name: str  # as given: "pp2:17,13"
    pipeline_parallel_size: int
    layer_partition: str | None  # "17,13"; None: the even split


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "pp",
        help="pipeline parallelism vs one process: throughput, TTFT, each stage's bubble",
        description=__doc__,
        run=run_pp_command,
    )
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--configs", default=DEFAULT_CONFIGS,
        help=f"comma-separated, each pp1, ppP or ppP:N1,...,NP (default {DEFAULT_CONFIGS})",
    )  # fmt: skip
    group.add_argument("--num-prompts", type=int, default=16, help="requests per batch")
    group.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    group.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    group.add_argument(
        "--ttft-requests", type=int, default=3, help="single requests per round for TTFT"
    )
    group.add_argument("--num-iters", type=int, default=3, help="timed rounds")
    group.add_argument("--num-iters-warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument_group("report").add_argument(
        "--result-json", "--output-json", dest="result_json", default=None,
        help="also write the results as JSON to this file",
    )  # fmt: skip
    add_cli_args(parser, skip=PIPELINE_FLAGS)


def parse_configs(text: str) -> list[PPConfig]:
    """`"pp1,pp2,pp2:17,13"` -> pp1, pp2 and pp2 with 17 + 13 layers."""
    items: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part.isdigit() and items and ":" in items[-1]:
            items[-1] += "," + part  # one more layer count of the partition before
        else:
            items.append(part)
    configs = []
    for item in items:
        match = _CONFIG.fullmatch(item)
        if match is None or int(match[1]) < 1:
            raise ValueError(
                f"configs: {item!r} is not a configuration; each is pp1, ppP (P >= 1 stages) "
                "or ppP:N1,...,NP (layers per stage), e.g. 'pp1,pp2,pp2:17,13'"
            )
        configs.append(PPConfig(item, int(match[1]), match[2]))
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"configs: {text!r} lists a configuration twice")
    return configs


def check_args(args: argparse.Namespace) -> list[PPConfig]:
    """Every flag error before an engine is built; returns the configurations."""
    check_at_least(
        args,
        (
            ("num_prompts", "requests", 1), ("input_len", "tokens", 1), ("output_len", "tokens", 1),
            ("ttft_requests", "requests", 1), ("num_iters", "rounds", 1),
            ("num_iters_warmup", "rounds", 0),
        ),
    )  # fmt: skip
    check_one_process(
        args,
        "bench pp compares pipeline stages against one process and reads one in-process "
        "engine core",
    )
    check_result_json_path(args.result_json)
    return parse_configs(args.configs)


def stage_layers(config: EngineConfig, pp: PPConfig) -> list[tuple[int, int]]:
    """Each stage's [start, end) layers, from the model's config.json (no weight loaded):
    the check that the partition fits the model."""
    from ringllm.pipeline.worker.model_loader import model_stages

    try:
        infos = model_stages(config.model, pp.pipeline_parallel_size, pp.layer_partition)
    except ValueError as exc:
        raise ValueError(f"configs: {pp.name}: {exc}") from None
    return [(s.start_layer, s.end_layer) for s in infos]


def run_pp(args: argparse.Namespace) -> dict[str, Any]:
    """Builds every configuration's engine, runs the rounds, returns the result dict."""
    pp_configs = check_args(args)
    config = from_cli_args(args)
    layers = {pp.name: stage_layers(config, pp) for pp in pp_configs}
    load_before = machine_info()
    built = {
        pp.name: variant(
            config,
            pipeline_parallel_size=pp.pipeline_parallel_size,
            pipeline_layer_partition=pp.layer_partition,
        )
        for pp in pp_configs
    }
    names = list(built)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with engines(built) as llms:
        workload = Workload(next(iter(llms.values())), args, config.model.seed)
        for round_ in range(args.num_iters_warmup + args.num_iters):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                run = run_once(llms[name], workload, round_)
                if round_ >= args.num_iters_warmup:
                    runs[name].append(run)
    result: dict[str, Any] = {
        "baseline": names[0],
        "bubble_definition": "1 - (step_s - recv_wait_s - send_wait_s) / wall_s",
        "configs": {
            pp.name: config_summary(pp, layers[pp.name], runs[pp.name]) for pp in pp_configs
        },
    }
    add_ratios(result)
    result["config"] = workload_config(args, config)
    result["config"]["workload"] = {
        k: getattr(args, k)
        for k in (
            "configs", "num_prompts", "input_len", "output_len", "ttft_requests", "num_iters",
            "num_iters_warmup",
        )
    }  # fmt: skip
    result["machine_before"] = load_before
    result["machine_after"] = machine_info()
    return result


class Workload:
    """The prompts every configuration runs: one batch, and one prompt per TTFT request
    and round (fresh prompts each, the same for every configuration)."""

    def __init__(self, llm, args: argparse.Namespace, seed: int) -> None:
        from ringllm.pipeline import SamplingParams

        tokenizer = llm.get_tokenizer()
        batch = random_requests(
            tokenizer, args.num_prompts, args.input_len, args.output_len, 0.0, seed
        )
        self.batch = [{"prompt_token_ids": r.prompt} for r in batch]
        rounds = args.num_iters_warmup + args.num_iters
        singles = random_requests(
            tokenizer, rounds * args.ttft_requests, args.input_len, 1, 0.0, seed + 1
        )
        self.singles = [{"prompt_token_ids": r.prompt} for r in singles]
        self.ttft_requests = args.ttft_requests
        self.priming = {"prompt_token_ids": batch[0].prompt[:WARMUP_PROMPT_TOKENS]}
        self.batch_params = SamplingParams(
            max_tokens=args.output_len, ignore_eos=True, temperature=0.0
        )
        self.one_token = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)


def run_once(llm, workload: Workload, round_: int) -> dict[str, Any]:
    """One configuration's share of a round: the batch, then the single requests."""
    read = stages.stage_stats_of(llm)
    # NOTE: a step just before the snapshot, so the ranks' idle wait since the last run is
    # counted before it, not in the run's first step (pp_stages.py). The reset after
    # it runs in the engine core only: no rank step between the priming and the run.
    llm.generate([workload.priming], workload.one_token, use_tqdm=False)
    llm.reset_prefix_cache()
    before = stages.settled_snapshot(read) if read is not None else None
    start_s = time.perf_counter()
    outputs = llm.generate(workload.batch, workload.batch_params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start_s
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    run: dict[str, Any] = {
        "elapsed_s": elapsed_s,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / elapsed_s,
    }
    if read is not None:
        run["stage_counters"] = stages.difference(stages.settled_snapshot(read), before)
    first = round_ * workload.ttft_requests
    singles = workload.singles[first : first + workload.ttft_requests]
    ttft = [_time_first_token(llm, prompt, workload.one_token) for prompt in singles]
    run["ttft_s"] = [wall for wall, _ in ttft]
    run["engine_ttft_s"] = [engine for _, engine in ttft]
    return run


def _time_first_token(llm, prompt: dict[str, Any], params) -> tuple[float, float]:
    """(seconds of a one-token `generate` call, the engine's own TTFT in seconds)."""
    llm.reset_prefix_cache()
    start_s = time.perf_counter()
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    wall_s = time.perf_counter() - start_s
    engine_s = output.metrics.ttft_s if output.metrics is not None else None
    return wall_s, engine_s or 0.0


def config_summary(
    pp: PPConfig, layers: list[tuple[int, int]], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    ttft_s = [t for run in runs for t in run["ttft_s"]]
    engine_ttft_s = [t for run in runs for t in run["engine_ttft_s"]]
    summary: dict[str, Any] = {
        "pipeline_parallel_size": pp.pipeline_parallel_size,
        "layer_partition": [end - start for start, end in layers],
        "output_tok_s": float(np.median([run["output_tok_s"] for run in runs])),
        "median_elapsed_s": float(np.median([run["elapsed_s"] for run in runs])),
        "median_ttft_ms": 1e3 * float(np.median(ttft_s)),
        "median_engine_ttft_ms": 1e3 * float(np.median(engine_ttft_s)),
        "stages": [],
        "runs": runs,
    }
    if runs and "stage_counters" in runs[0]:
        totals = stages.add_up([run["stage_counters"] for run in runs])
        wall_s = sum(run["elapsed_s"] for run in runs)
        summary["stages"] = [
            {"stage": k, **stages.stage_summary(row, wall_s, len(runs), layers[k])}
            for k, row in enumerate(totals)
        ]
    return summary


def add_ratios(result: dict[str, Any]) -> None:
    """Each configuration's throughput and TTFT over the baseline's (the first one)."""
    base = result["configs"][result["baseline"]]
    for summary in result["configs"].values():
        summary["speedup_over_baseline"] = summary["output_tok_s"] / base["output_tok_s"]
        summary["ttft_over_baseline"] = summary["median_ttft_ms"] / base["median_ttft_ms"]


def run_pp_command(args: argparse.Namespace) -> int:
    result = run_pp(args)
    write_report(result, pp_table(result), args.result_json)
    return 0
