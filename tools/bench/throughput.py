"""`ringllm bench throughput`: offline throughput, every request submitted at once.

The requests come from `ringllm.tools.bench.datasets` and all go into one `LLM.generate` call,
so the scheduler sees the whole load from the start (vLLM's `bench throughput`). The
clock covers only that call: the engine is built, and by default warmed up with one short
request (whose prefix-cache entries are then dropped), before it starts.

Results use vLLM's names: `requests_per_second`, `tokens_per_second` (prompt + output),
`output_tokens_per_second`, plus per-request TTFT / TPOT / end-to-end latency summaries
from the engine's own request metrics. Token counts are what the engine actually
produced, not what was asked for.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ringllm.pipeline.config import EngineConfig, add_cli_args, from_cli_args
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.datasets import add_dataset_args, sample_requests
from ringllm.tools.bench.datasets.request import SampleRequest
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

WARMUP_PROMPT_TOKENS = 8
WARMUP_OUTPUT_TOKENS = 4


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "throughput",
        help="offline throughput: all requests through LLM.generate at once",
        description=__doc__,
        run=run_throughput_command,
    )
    add_sampling_args(parser)
    add_dataset_args(parser)
    add_report_args(parser)
    add_cli_args(parser)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """How each request is sampled; shared with `bench latency`."""
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--ignore-eos", action="store_true",
        help="keep generating past EOS, so every request makes exactly its output length",
    )  # fmt: skip
    group.add_argument(
        "--temperature", type=float, default=0.0,
        help="sampling temperature; default 0 (greedy, as the peer scripts run)",
    )  # fmt: skip
    group.add_argument("--top-p", type=float, default=1.0, help="top-p (default 1: off)")
    group.add_argument("--top-k", type=int, default=0, help="top-k (default 0: off)")
    group.add_argument(
        "--warmup", action=argparse.BooleanOptionalAction, default=True,
        help="run one short request before the clock starts (default: on)",
    )  # fmt: skip
    group.add_argument(
        "--structured-outputs", choices=("none", "json-schema", "json-schema-bounded"),
        default="none",
        help="json-schema: every request's output must match a JSON schema (a long array of "
        "objects: it runs to its output length like an unconstrained request); "
        "json-schema-bounded: an array of strings of at most 12 characters (length limits "
        "are the costliest masks)",
    )  # fmt: skip


def make_llm(config: EngineConfig):
    from ringllm.pipeline import LLM

    engine_args: dict[str, Any] = {}
    for section in (
        config.model, config.cache, config.scheduler, config.parallel, config.device,
        config.speculative, config.multimodal,
    ):  # fmt: skip
        engine_args.update(section.__dict__)
    return LLM(**engine_args)


# The json-schema workload's schema: no output of a usual length can finish it, so every
# request generates its whole output length under the grammar (a fair side-by-side).
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer"},
                    "role": {"enum": ["admin", "user", "guest"]},
                },
                "required": ["name", "age", "role"],
                "additionalProperties": False,
            },
            "minItems": 100000,
        }
    },
    "required": ["people"],
}
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 100000}
    },
    "required": ["items"],
}


def sampling_params_for(request: SampleRequest, args: argparse.Namespace):
    from ringllm.pipeline import SamplingParams, StructuredOutputsParams

    structured = None
    kind = getattr(args, "structured_outputs", "none")
    if kind != "none":
        schema = BENCH_SCHEMA if kind == "json-schema" else BOUNDED_SCHEMA
        structured = StructuredOutputsParams(json=schema)
    return SamplingParams(
        max_tokens=request.expected_output_len,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        top_p=getattr(args, "top_p", 1.0),
        top_k=getattr(args, "top_k", 0),
        structured_outputs=structured,
    )


def warm_up(llm, requests: list[SampleRequest], args: argparse.Namespace) -> None:
    """One short request, so lazy initialization (allocator, thread pools) is off the clock."""
    from ringllm.pipeline import SamplingParams

    token_ids = _first_token_ids(llm, requests)[:WARMUP_PROMPT_TOKENS]
    params = SamplingParams(
        max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True, temperature=args.temperature
    )
    llm.generate([token_ids], params, use_tqdm=False)
    llm.reset_prefix_cache()


def _first_token_ids(llm, requests: list[SampleRequest]) -> list[int]:
    prompt = requests[0].prompt
    if isinstance(prompt, str):
        return llm.get_tokenizer().encode(prompt)
    return list(prompt)


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Builds the engine, runs the workload, and returns the result dict (no printing)."""
    percentiles = parse_percentiles(args.metric_percentiles)
    check_result_json_path(args.result_json)
    config = from_cli_args(args)
    seed = config.model.seed
    load_before = machine_info()
    llm = make_llm(config)
    requests = sample_requests(args, llm.get_tokenizer(), seed)
    if args.warmup:
        warm_up(llm, requests, args)
    prompts = [_as_engine_prompt(r.prompt) for r in requests]
    params = [sampling_params_for(r, args) for r in requests]
    structured = _grammar_manager(llm)
    if structured is not None and args.structured_outputs != "none":
        llm.generate(prompts[:1], params[0], use_tqdm=False)  # compile off the clock
        llm.reset_prefix_cache()
        structured.reset_counters()
    start_s = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start_s
    result = throughput_result(requests, outputs, elapsed_s, percentiles, args, config, load_before)
    if structured is not None and structured.num_fills:
        result["grammar_mask_ms_per_step"] = 1e3 * structured.fill_s_total / structured.num_fills
        result["grammar_mask_rows_per_step"] = structured.rows_total / structured.num_fills
        result["grammar_mask_share"] = structured.fill_s_total / elapsed_s
    return result


def _grammar_manager(llm):
    core = getattr(llm.llm_engine, "engine_core", None)  # in process only
    return getattr(getattr(core, "scheduler", None), "structured", None)


def _as_engine_prompt(prompt: str | list[int]) -> Any:
    return prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}


def throughput_result(
    requests: list[SampleRequest],
    outputs: list,
    elapsed_s: float,
    percentiles: list[float],
    args: argparse.Namespace,
    config: EngineConfig,
    load_before: dict[str, Any],
) -> dict[str, Any]:
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    metrics = [o.metrics for o in outputs if o.metrics is not None]
    result: dict[str, Any] = {
        "elapsed_time": elapsed_s,
        "num_requests": len(outputs),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": input_tokens + output_tokens,
        "expected_output_tokens": sum(r.expected_output_len for r in requests),
        "num_cached_tokens": sum(o.num_cached_tokens for o in outputs),
        "requests_per_second": len(outputs) / elapsed_s,
        "tokens_per_second": (input_tokens + output_tokens) / elapsed_s,
        "output_tokens_per_second": output_tokens / elapsed_s,
    }
    result.update(summarize("ttft_ms", (1e3 * m.ttft_s for m in metrics if m.ttft_s), percentiles))
    result.update(summarize("tpot_ms", (1e3 * m.tpot_s for m in metrics if m.tpot_s), percentiles))
    result.update(
        summarize(
            "e2el_ms", (1e3 * m.e2e_latency_s for m in metrics if m.e2e_latency_s), percentiles
        )
    )
    result["config"] = workload_config(args, config)
    result["machine_before"] = load_before
    result["machine_after"] = machine_info()
    return result


def workload_config(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    """The workload and engine settings, so a result JSON says what produced it."""
    dataset_keys = (
        "dataset", "num_prompts", "dataset_path", "input_len", "output_len", "range_ratio",
        "prefix_len", "suffix_len", "num_prefixes", "ignore_eos", "temperature", "top_p",
        "top_k", "warmup",
        "structured_outputs",
    )  # fmt: skip
    workload = {k: getattr(args, k) for k in dataset_keys if hasattr(args, k)}
    engine = {
        name: dict(section.__dict__)
        for name, section in (
            ("model", config.model), ("cache", config.cache), ("scheduler", config.scheduler),
            ("parallel", config.parallel), ("device", config.device),
            ("speculative", config.speculative),
        )
    }  # fmt: skip
    return {"workload": workload, "engine": engine}


def throughput_table(result: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("Successful requests", result["num_requests"]),
        ("Benchmark duration (s)", result["elapsed_time"]),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Prefix-cache hit tokens", result["num_cached_tokens"]),
        ("Request throughput (req/s)", result["requests_per_second"]),
        ("Output token throughput (tok/s)", result["output_tokens_per_second"]),
        ("Total token throughput (tok/s)", result["tokens_per_second"]),
    ]
    if "grammar_mask_ms_per_step" in result:
        rows += [
            ("Grammar mask per step (ms)", result["grammar_mask_ms_per_step"]),
            ("Constrained rows per step", result["grammar_mask_rows_per_step"]),
            ("Grammar mask share of the run (%)", 100 * result["grammar_mask_share"]),
        ]
    for name, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2EL")):
        keys = {k: v for k, v in result.items() if k.endswith("_" + name)}
        rows += summary_rows(title, name, "ms", keys)
    return format_table("Throughput Benchmark Result", rows)


def run_throughput_command(args: argparse.Namespace) -> int:
    result = run_throughput(args)
    write_report(result, throughput_table(result), args.result_json)
    return 0
