"""`ringllm bench llamacpp-serve`: many users, `ringllm serve` against `llama-server -np N`.

    ringllm bench llamacpp-serve --llama-server ~/peers/llama.cpp/bin/llama-server \\
        --model smollm2-135m-q4_1.gguf --model llama-1b-q4_k_m.gguf --rounds 2

For each `--model` (a GGUF file) and round, each server is started on its own on the file,
loaded with the `bench serve` workload, and stopped; the first to run swaps every round,
so a drift of the shared machine's load falls on both:

    llama.cpp  `llama-server -m FILE -t T -np C -c C * 1024` (one slot per concurrent
               request, each of the vLLM peer's 1,024-token context)
    ringllm    `ringllm serve FILE --num-threads T` and the --ringllm-args given

The workload is `bench serve`'s: --num-prompts random prompts of --input-len tokens (the
file's own tokenizer, through ringllm's view of the GGUF), --output-len tokens each with
EOS ignored, at most --max-concurrency in flight, one untimed request first. Each
server's output tok/s and median TTFT / TPOT are reported as their range over the rounds,
with ringllm's output rate over llama-server's of the same round.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.flags import check_at_least
from ringllm.tools.bench.llamacpp import value_range
from ringllm.tools.bench.llamacpp_peer import (
    check_server_files,
    free_port,
    llama_server,
    wait_healthy,
)
from ringllm.tools.bench.report import (
    add_report_args,
    check_result_json_path,
    format_table,
    machine_info,
    write_report,
)

SERVERS = ("llamacpp", "ringllm")
STARTUP_TIMEOUT_S = 600.0
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "llamacpp-serve",
        help="many users: ringllm serve against llama-server -np N on the same GGUF files",
        description=__doc__,
        run=run_command,
    )
    parser.add_argument("--llama-server", required=True, metavar="PATH", help="its binary")
    parser.add_argument(
        "--model", action="append", required=True, metavar="FILE", help="a GGUF (repeatable)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds per file (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="threads of both servers")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=16, help="also llama-server's -np")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument(
        "--ringllm-args", default="", metavar="'ARGS'", help="more `ringllm serve` flags"
    )
    add_report_args(parser)


def check_args(args: argparse.Namespace) -> None:
    check_at_least(
        args,
        [
            ("rounds", "", 1), ("threads", "thread", 1), ("num_prompts", "", 1),
            ("input_len", "token", 1), ("output_len", "token", 1), ("max_concurrency", "", 1),
        ],
    )  # fmt: skip
    check_server_files(args.llama_server, args.model)
    check_result_json_path(args.result_json)


@contextlib.contextmanager
def ringllm_server(args: argparse.Namespace, model: str, log_path: Path) -> Iterator[str]:
    """`ringllm serve MODEL` on a free port for the `with` block; yields its base URL."""
    port = free_port()
    command = [
        sys.executable, "-m", "ringllm.tools.cli", "serve", model, "--host", "127.0.0.1",
        "--port", str(port), "--num-threads", str(args.threads), *args.ringllm_args.split(),
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log_path, STARTUP_TIMEOUT_S)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_args(args: argparse.Namespace, base_url: str, tokenizer: Path) -> argparse.Namespace:
    """`bench serve`'s flags for one run against `base_url`."""
    from ringllm.tools.bench import serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    argv = [
        "serve", "--base-url", base_url, "--tokenizer", str(tokenizer), "--dataset", "random",
        "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency),
        "--seed", str(args.seed), "--ignore-eos", "--disable-tqdm",
    ]  # fmt: skip
    return parser.parse_args(argv)


def run_once(args: argparse.Namespace, server: str, model: str, workdir: Path) -> dict[str, Any]:
    from ringllm.pipeline.models.gguf_model import gguf_view
    from ringllm.tools.bench.serve import run_serve

    log_path = workdir / f"{server}-{Path(model).stem}.log"
    if server == "llamacpp":
        started = llama_server(
            args.llama_server, model, threads=args.threads, parallel=args.max_concurrency,
            log_path=log_path,
        )  # fmt: skip
    else:
        started = ringllm_server(args, model, log_path)
    with started as base_url:
        warm = serve_args(args, base_url, gguf_view(Path(model)))
        warm.num_prompts, warm.output_len = 1, 2
        run_serve(warm)
        result, _ = run_serve(serve_args(args, base_url, gguf_view(Path(model))))
    if result["completed"] != args.num_prompts:
        raise RuntimeError(f"{server}: {result['failed']} requests failed (log: {log_path})")
    return {name: result[name] for name in METRICS}


def run(args: argparse.Namespace) -> dict[str, Any]:
    check_args(args)
    workdir = Path(tempfile.mkdtemp(prefix="ringllm-llamacpp-serve-"))
    result: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine_before": machine_info(),
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "logs": str(workdir),
        "models": [],
    }
    for model in args.model:
        rounds = []
        for r in range(args.rounds):
            order = SERVERS if r % 2 == 0 else SERVERS[::-1]
            measured = {server: run_once(args, server, model, workdir) for server in order}
            measured["ratio"] = (
                measured["ringllm"]["output_throughput"] / measured["llamacpp"]["output_throughput"]
            )
            print(f"{Path(model).name} round {r + 1}: {measured}", file=sys.stderr, flush=True)
            rounds.append(measured)
        result["models"].append({"model": os.path.basename(model), "rounds": rounds})
    result["machine_after"] = machine_info()
    return result


def table(result: dict[str, Any]) -> str:
    config = result["config"]
    rows: list[tuple[str, Any]] = [
        ("Rounds", config["rounds"]),
        ("Prompts, concurrency", f"{config['num_prompts']}, {config['max_concurrency']}"),
        ("Input / output tokens", f"{config['input_len']} / {config['output_len']}"),
    ]
    labels = {"output_throughput": "output tok/s", "median_ttft_ms": "median TTFT (ms)",
              "median_tpot_ms": "median TPOT (ms)"}  # fmt: skip
    for entry in result["models"]:
        rows.append((entry["model"], None))
        for server in SERVERS:
            for metric in METRICS:
                values = [r[server][metric] for r in entry["rounds"]]
                rows.append((f"{server} {labels[metric]}", value_range(values)))
        rows.append(("ringllm / llama-server output", value_range(
            [r["ratio"] for r in entry["rounds"]], 2)))  # fmt: skip
    return format_table("llama-server Side-by-side (many users)", rows)


def run_command(args: argparse.Namespace) -> int:
    result = run(args)
    write_report(result, table(result), args.result_json)
    return 0
