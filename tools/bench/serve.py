"""`ringllm bench serve`: a load generator against a running engine, over HTTP or IPC.

    ringllm bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --input-len 64 --output-len 32 --max-concurrency 16 --ignore-eos
    ringllm bench serve --ipc ringllm_1234_ab12cd34ef56_engine ...   # `ringllm serve` prints it

Backends: any OpenAI-compatible server (`--base-url`; ringllm's, vLLM's) streamed over
SSE on `/v1/completions` or `/v1/chat/completions` (or ringllm's `/v1/responses` and
`/v1/messages`, to compare the APIs on one engine), or ringllm's shared-memory IPC client
(`--ipc NAME[,NAME...]`: several engines are data-parallel ranks, served round-robin).
Images (`--dataset random-mm`) go to the chat endpoint or over IPC; the same dataset
with `--random-mm-num-images 0` and `--random-input-len` raised by the image positions
is the text-only run of the same prompt length:

    ringllm bench serve --base-url URL --endpoint /v1/chat/completions \\
        --dataset random-mm --random-mm-image-size 224x224 --random-input-len 64 ...

    arrivals:  request i is released at offset_i = the sum of i gaps, each drawn from
               Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean gap 1/rate always;
               burstiness 1 = Poisson, < 1 burstier, > 1 more even; rate inf = all at t=0
    admission: a released request then waits for one of --max-concurrency slots

Per request it records when each streamed chunk arrived; the metrics use vLLM's
definitions and result-field names: TTFT = first chunk - start, ITL = the gaps between
chunks, TPOT = (E2EL - TTFT) / (output tokens - 1), E2EL = end of stream - start.
Output tokens are the server's `usage` count when it sends one
(`stream_options.include_usage`), else the number of chunks; over IPC, the token ids
themselves. A request that fails is counted in `failed` with its error message, never
dropped. Times are `time.perf_counter()` seconds since the benchmark started.

This module owns the load (arrivals, concurrency), the metrics and the report; how a
request travels is `serve_backends`, the PNGs are `plots`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.datasets import add_dataset_args, sample_requests
from ringllm.tools.bench.datasets.images import image_buckets, sends_images
from ringllm.tools.bench.datasets.request import SampleRequest
from ringllm.tools.bench.plots import check_plot_dir, concurrency_steps, write_plots
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
from ringllm.tools.bench.serve_backends import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    DEFAULT_REQUEST_TIMEOUT_S,
    ENDPOINTS,
    Clock,
    HttpBackend,
    IpcBackend,
    RequestResult,
)

METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
DEFAULT_PERCENTILE_METRICS = ",".join(METRIC_TITLES)
MAX_ERRORS_SHOWN = 5


# ---- load ----------------------------------------------------------------------------


def arrival_offsets_s(
    num_requests: int, request_rate: float, burstiness: float, seed: int
) -> np.ndarray:
    """When each request is released, in seconds since the start (see the module doc)."""
    if not request_rate > 0:
        raise ValueError(f"request_rate: must be > 0 requests/s (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness: must be a finite gamma shape > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    gaps_s = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), size=num_requests)
    gaps_s[0] = 0.0  # the first request goes at once, as in vLLM
    return np.cumsum(gaps_s)


async def run_load(
    backend,
    requests: Sequence[SampleRequest],
    offsets_s: np.ndarray,
    max_concurrency: int | None,
    progress=None,
) -> tuple[list[RequestResult], float]:
    """Sends every request at its offset, at most `max_concurrency` in flight; returns the
    results (in request order) and the duration in seconds."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    clock = Clock()

    async def one(request: SampleRequest, offset_s: float) -> RequestResult:
        await asyncio.sleep(max(0.0, offset_s - clock.now_s()))
        async with slots or contextlib.nullcontext():
            result = await backend.send(request, clock)
        if progress is not None:
            progress.update(1)
        return result

    tasks = [one(r, float(t)) for r, t in zip(requests, offsets_s, strict=True)]
    results = await asyncio.gather(*tasks)
    return list(results), clock.now_s()


# ---- results -------------------------------------------------------------------------


def parse_metric_names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in METRIC_TITLES]
    if unknown or not names:
        raise ValueError(
            f"percentile_metrics: {text!r} must list some of {', '.join(METRIC_TITLES)}"
        )
    return names


def metric_values_ms(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Each metric's samples in ms, over the successful requests (ITL: every gap)."""
    done = [r for r in results if r.success]
    return {
        "ttft": [1e3 * r.ttft_s for r in done if r.chunk_times_s],
        "tpot": [1e3 * r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [1e3 * gap for r in done for gap in r.itls_s],
        "e2el": [1e3 * r.latency_s for r in done],
    }


def serve_result(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float],
    metric_names: Sequence[str],
) -> dict[str, Any]:
    """vLLM's result fields: totals, throughputs, the metric summaries, per-request lists."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_input_images": sum(r.num_images for r in done),
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "peak_concurrency": int(concurrency_steps(results)[1].max()),
    }
    values_ms = metric_values_ms(results)
    for name in metric_names:
        result.update(summarize(f"{name}_ms", values_ms[name], percentiles))
    result["input_lens"] = [r.prompt_len for r in results]
    result["output_lens"] = [r.output_len for r in results]
    result["expected_output_lens"] = [r.expected_output_len for r in results]
    result["ttfts"] = [r.ttft_s for r in results]
    result["itls"] = [r.itls_s for r in results]
    result["start_times"] = [r.start_s for r in results]
    result["e2els"] = [r.latency_s for r in results]
    result["errors"] = [r.error for r in results]
    return result


def serve_table(result: dict[str, Any], metric_names: Sequence[str]) -> str:
    rows: list[tuple[str, Any]] = [
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Maximum request concurrency", result["max_concurrency"] or "none"),
        ("Peak requests in flight", result["peak_concurrency"]),
        ("Benchmark duration (s)", result["duration"]),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
    ]
    if result.get("total_input_images"):
        rows.append(("Total input images", result["total_input_images"]))
    rows += [
        ("Request throughput (req/s)", result["request_throughput"]),
        ("Output token throughput (tok/s)", result["output_throughput"]),
        ("Total token throughput (tok/s)", result["total_token_throughput"]),
    ]
    for name in metric_names:
        key = f"{name}_ms"
        summary = {k: v for k, v in result.items() if k.endswith("_" + key)}
        section = summary_rows(name.upper(), key, "ms", summary)  # "Mean TTFT (ms)" rows
        rows += [(METRIC_TITLES[name], None)] + section[1:]  # under vLLM's long heading
    table = format_table("Serving Benchmark Result", rows)
    errors = Counter(e for e in result["errors"] if e)
    if errors:
        lines = [f"Failed requests by error ({len(errors)} distinct):"]
        for message, count in errors.most_common(MAX_ERRORS_SHOWN):
            lines.append(f"  {count} x {message}")
        rest = errors.most_common()[MAX_ERRORS_SHOWN:]
        if rest:
            count = sum(n for _, n in rest)
            lines.append(f"  {count} x ({len(rest)} other messages: the result JSON's errors)")
        table += "\n" + "\n".join(lines)
    return table


# ---- command -------------------------------------------------------------------------


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "serve",
        help="online serving: a load generator over HTTP (OpenAI API) or ringllm's IPC",
        description=__doc__,
        run=run_serve_command,
    )
    target = parser.add_argument_group("target (one of --base-url, --ipc)")
    where = target.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", default=None, help="an OpenAI-compatible server's URL")
    where.add_argument(
        "--ipc", default=None, metavar="INSTANCE[,INSTANCE...]",
        help="ringllm engine instance name(s), as `ringllm serve` prints them",
    )  # fmt: skip
    target.add_argument(
        "--endpoint", default=COMPLETIONS_ENDPOINT, choices=ENDPOINTS,
        help="HTTP: the API to load (the Responses and Messages APIs: text prompts)",
    )  # fmt: skip
    target.add_argument(
        "--model", default=None, help="HTTP: model name (default: the first served)"
    )
    target.add_argument("--tokenizer", default=None, help="HTTP: HF folder (default: --model)")
    target.add_argument("--api-key", default=None, help="HTTP: sent as a Bearer token")
    target.add_argument(
        "--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
        help=f"HTTP: seconds one request may take (default {DEFAULT_REQUEST_TIMEOUT_S:g})",
    )  # fmt: skip
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=math.inf,
        help="mean requests/s of the arrivals (default inf: all at once)",
    )  # fmt: skip
    load.add_argument(
        "--burstiness", type=float, default=1.0,
        help="gamma shape of the gaps between arrivals (1: Poisson; < 1 burstier)",
    )  # fmt: skip
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight at most"
    )
    load.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrivals")
    load.add_argument(
        "--ignore-eos", action="store_true",
        help="generate past EOS, so every request makes exactly its output length",
    )  # fmt: skip
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    add_dataset_args(parser)
    add_report_args(parser)
    report = parser.add_argument_group("serve report")
    report.add_argument(
        "--percentile-metrics", default=DEFAULT_PERCENTILE_METRICS,
        help=f"metrics to summarize (default {DEFAULT_PERCENTILE_METRICS})",
    )  # fmt: skip
    report.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def check_args(args: argparse.Namespace) -> None:
    """Every flag error before anything connects or runs."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1 request, got {args.max_concurrency}")
    if not args.temperature >= 0:
        raise ValueError(f"temperature: must be >= 0, got {args.temperature}")
    if not args.request_timeout > 0:
        raise ValueError(f"request_timeout: must be > 0 s, got {args.request_timeout}")
    arrival_offsets_s(1, args.request_rate, args.burstiness, args.seed)  # validates both
    check_result_json_path(args.result_json)
    if args.plot is not None:
        check_plot_dir(args.plot)
    if args.dataset == "random-mm":
        image_buckets(args)  # validates the size flags
        if sends_images(args) and args.base_url is not None and args.endpoint != CHAT_ENDPOINT:
            raise ValueError(
                f"endpoint: {args.endpoint} takes no images; send --dataset random-mm with "
                f"--endpoint {CHAT_ENDPOINT} (or --random-mm-num-images 0 for text only)"
            )


def make_backend(args: argparse.Namespace) -> HttpBackend | IpcBackend:
    """The backend the flags name; it connects when entered (`async with`)."""
    if args.base_url is not None:
        return HttpBackend(args)
    return IpcBackend(args)


def run_serve(args: argparse.Namespace) -> tuple[dict[str, Any], list[RequestResult]]:
    """Runs the benchmark; returns the result dict (no printing) and the raw results."""
    percentiles = parse_percentiles(args.metric_percentiles)
    metric_names = parse_metric_names(args.percentile_metrics)
    check_args(args)
    load_before = machine_info()
    results, duration_s, model_id = asyncio.run(_run_load_command(args))
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "backend": "http" if args.base_url is not None else "ipc",
        "target": args.base_url + args.endpoint if args.base_url is not None else args.ipc,
        "model_id": model_id,
        "num_prompts": len(results),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }
    result.update(serve_result(results, duration_s, percentiles, metric_names))
    result["config"] = {k: v for k, v in vars(args).items() if k != "func" and k != "api_key"}
    result["config"]["request_rate"] = result["request_rate"]
    result["machine_before"] = load_before
    result["machine_after"] = machine_info()
    return result, results


async def _run_load_command(
    args: argparse.Namespace,
) -> tuple[list[RequestResult], float, str]:
    from tqdm import tqdm

    backend = make_backend(args)
    async with backend:
        if sends_images(args) and isinstance(backend, IpcBackend) and not backend.num_image_tokens:
            raise ValueError(
                f"dataset: {backend.model} takes no images; --dataset random-mm needs a "
                "model that does (or --random-mm-num-images 0)"
            )
        requests = sample_requests(args, backend.tokenizer, args.seed, backend.num_image_tokens)
        offsets_s = arrival_offsets_s(len(requests), args.request_rate, args.burstiness, args.seed)
        with tqdm(total=len(requests), disable=args.disable_tqdm, unit="req") as progress:
            results, duration_s = await run_load(
                backend, requests, offsets_s, args.max_concurrency, progress
            )
        model_id = backend.model
    return results, duration_s, model_id


def run_serve_command(args: argparse.Namespace) -> int:
    result, results = run_serve(args)
    metric_names = parse_metric_names(args.percentile_metrics)
    write_report(result, serve_table(result, metric_names), args.result_json)
    if args.plot is not None:
        values_ms = metric_values_ms(results)
        latencies_ms = {name: values_ms[name] for name in metric_names}
        for path in write_plots(results, latencies_ms, result["duration"], Path(args.plot)):
            print(f"plot: {path}")
    return 0
