"""The transformers peer: the workload of `ringllm bench throughput`, run through
transformers' `generate`, reporting the same numbers under the same names.

    python -m ringllm.tools.peer_transformers --dtype bfloat16 \\
        --num-prompts 64 --dataset random --input-len 32 --output-len 64

    ringllm bench throughput --dtype bfloat16 --ignore-eos \\
        --num-prompts 64 --dataset random --input-len 32 --output-len 64

Both build their requests with `ringllm.tools.bench.datasets` from the same flags, the same
seed (`--seed`, default 0) and the same tokenizer (ringllm's, read from the model folder),
so they send identical token ids. Here the requests run in batches of `--batch-size`
(default: all at once, the 64-concurrent-requests case), left-padded, greedy, with
`min_new_tokens = max_new_tokens` = the batch's longest expected output, so EOS never
ends a row early (the `--ignore-eos` of the ringllm run). A row whose own expected output
is shorter is credited only its own length: padding work is a real cost of static
batching, and the throughput shows it. The clock covers the `generate` calls only, after
one short warm-up call, as in `bench throughput`.

The other peer is vLLM's CPU build: `/work/shared/peers/setup.sh` makes its venv and
`offline.py vllm MODEL --batch 64 --input-len 32 --output-len 64` runs this same shape of
workload (its own random ids, greedy, ignore_eos); compare its output tok/s with
`output_tokens_per_second` here and in `bench throughput`, measured in one session.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from ringllm.tools.bench.datasets import add_dataset_args, sample_requests
from ringllm.tools.bench.datasets.request import SampleRequest
from ringllm.tools.bench.report import (
    add_report_args,
    check_result_json_path,
    format_table,
    machine_info,
    parse_percentiles,
    write_result_json,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ringllm.tools.peer_transformers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="HF model folder; default: the demo model")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (ringllm's --seed)")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="requests per generate call (default: all)"
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    add_dataset_args(parser)
    add_report_args(parser)
    return parser


def load(model_arg: str | None, dtype: str):
    from transformers import AutoModelForCausalLM

    from ringllm.pipeline.frontend.tokenizer import Tokenizer
    from ringllm.pipeline.models.demo_model import demo_model_path

    path = model_arg or str(demo_model_path())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
    return path, model, Tokenizer.from_folder(path)


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each [B, longest prompt], padding on the left."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return input_ids, mask


def generate_batch(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> int:
    """Greedy-generates exactly `new_tokens` per row; returns the tokens generated."""
    input_ids, mask = left_padded(prompts, pad_id)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
    return int(out.shape[0] * (out.shape[1] - input_ids.shape[1]))


def token_ids_of(request: SampleRequest, tokenizer) -> list[int]:
    if isinstance(request.prompt, str):
        return tokenizer.encode(request.prompt)  # as the engine tokenizes a text prompt
    return list(request.prompt)


def run_peer(args: argparse.Namespace) -> dict[str, Any]:
    percentiles = parse_percentiles(args.metric_percentiles)  # checked for a uniform CLI
    del percentiles  # transformers gives no per-request timings to summarize
    check_result_json_path(args.result_json)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    load_before = machine_info()
    path, model, tokenizer = load(args.model, args.dtype)
    requests = sample_requests(args, tokenizer, args.seed)
    prompts = [token_ids_of(r, tokenizer) for r in requests]
    pad_id = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else 0
    batch_size = args.batch_size or len(requests)
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1 request, got {batch_size}")
    generate_batch(model, [prompts[0][:8]], 2, pad_id)  # warm-up, off the clock
    generated = 0
    start_s = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        chunk = requests[first : first + batch_size]
        new_tokens = max(r.expected_output_len for r in chunk)
        generated += generate_batch(model, prompts[first : first + batch_size], new_tokens, pad_id)
    elapsed_s = time.perf_counter() - start_s
    input_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(r.expected_output_len for r in requests)
    return {
        "peer": "transformers",
        "elapsed_time": elapsed_s,
        "num_requests": len(requests),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": input_tokens + output_tokens,
        "generated_tokens_with_padding": generated,
        "requests_per_second": len(requests) / elapsed_s,
        "tokens_per_second": (input_tokens + output_tokens) / elapsed_s,
        "output_tokens_per_second": output_tokens / elapsed_s,
        "config": {
            "model": path,
            "dtype": args.dtype,
            "seed": args.seed,
            "batch_size": batch_size,
            "torch_threads": torch.get_num_threads(),
            "workload": {
                k: getattr(args, k)
                for k in (
                    "dataset",
                    "num_prompts",
                    "dataset_path",
                    "input_len",
                    "output_len",
                    "range_ratio",
                    "prefix_len",
                    "suffix_len",
                    "num_prefixes",
                )
            },  # fmt: skip
        },
        "machine_before": load_before,
        "machine_after": machine_info(),
    }


def peer_table(result: dict[str, Any]) -> str:
    rows = [
        ("Successful requests", result["num_requests"]),
        ("Benchmark duration (s)", result["elapsed_time"]),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", result["requests_per_second"]),
        ("Output token throughput (tok/s)", result["output_tokens_per_second"]),
        ("Total token throughput (tok/s)", result["tokens_per_second"]),
    ]
    return format_table("transformers Throughput Result", rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run_peer(args)
    print(peer_table(result))
    if args.result_json:
        write_result_json(args.result_json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
