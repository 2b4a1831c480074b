"""`ringllm bench mm`: what an image costs, side by side with text of the same length.

Two kinds of prompt on one in-process engine (a model that takes images), drawn from
the random-mm dataset (tools/bench/datasets/):

    image  one image token per image, then random text of --input-len tokens, with
           --num-images random RGB PNG images of --image-size (decoded to PIL before
           the clock, as `LLM.generate`'s callers hand them over)
    text   random text of --input-len + num_images x the model's image positions
           tokens: the image prompt's length once the engine has expanded it

TTFT: one request alone, `max_tokens=1`, after `--num-iters-warmup` untimed rounds;
`--num-iters` timed rounds, the kinds alternating (image, text | text, image | ...) so a
noisy machine slows both alike; the prefix cache is emptied before each request. Per
request, three clocks:

    ttft          the `LLM.generate` call: tokenizing, the images' decoding and
                  preprocessing in the front end, the vision encoder, prefill, the token
    engine ttft   from admission (after preprocessing) to the first token (the request's
                  own metrics)
    encode        the worker's `EncoderCache.encode_s` during it: vision tower + projector

Throughput: `--batch-size` requests of each kind (every image and text its own) in one
`LLM.generate` call, `--output-len` tokens each (EOS ignored), alternating likewise.

Reported: medians over the rounds, image / text ratios, the encoder's share of the
image TTFT (wall and engine) and of the image batch. The encoder is timed only when the
worker runs in this process (tensor parallel 1, no engine process): else its figures
are null.
"""

from __future__ import annotations

import argparse
import io
import time
from typing import Any

import numpy as np

from ringllm.pipeline.config import add_cli_args, from_cli_args
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.datasets.images import ImageBucket, parse_image_size
from ringllm.tools.bench.flags import check_at_least
from ringllm.tools.bench.report import (
    check_result_json_path,
    format_table,
    machine_info,
    write_report,
)
from ringllm.tools.bench.throughput import workload_config

KINDS = ("image", "text")


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "mm",
        help="images vs text of the same prompt length: TTFT, encoder share, throughput",
        description=__doc__,
        run=run_mm_command,
    )
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--input-len", "--random-input-len", dest="input_len", type=int, default=32,
        help="text tokens of an image prompt (the text prompt adds the image positions)",
    )  # fmt: skip
    group.add_argument(
        "--num-images", "--random-mm-num-images", dest="num_images", type=int, default=1,
        help="images per image prompt (default 1)",
    )  # fmt: skip
    group.add_argument(
        "--image-size", "--random-mm-image-size", dest="image_size", default=None,
        metavar="WxH", help="pixels of each image (default: the model's own input size)",
    )  # fmt: skip
    group.add_argument(
        "--output-len", type=int, default=32, help="output tokens per request (throughput)"
    )
    group.add_argument("--batch-size", type=int, default=8, help="requests per throughput batch")
    group.add_argument("--num-iters", type=int, default=3, help="timed rounds of each kind")
    group.add_argument("--num-iters-warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument_group("report").add_argument(
        "--result-json", "--output-json", dest="result_json", default=None,
        help="also write the results as JSON to this file",
    )  # fmt: skip
    add_cli_args(parser)


def _check_counts(args: argparse.Namespace) -> None:
    check_at_least(
        args,
        (
            ("input_len", "tokens", 1),
            ("num_images", "images", 1),
            ("output_len", "tokens", 1),
            ("batch_size", "requests", 1),
            ("num_iters", "rounds", 1),
            ("num_iters_warmup", "rounds", 0),
        ),
    )
    if args.image_size is not None:
        parse_image_size(args.image_size)


def run_mm(args: argparse.Namespace) -> dict[str, Any]:
    """Builds the engine, runs both measurements, and returns the result dict."""
    from ringllm.pipeline import LLM

    _check_counts(args)
    check_result_json_path(args.result_json)
    config = from_cli_args(args)
    load_before = machine_info()
    with LLM.from_config(config) as llm:
        prompts = MmPrompts(llm, args, config.model.seed)
        result = {
            "num_image_tokens": prompts.num_image_tokens,
            "num_images": args.num_images,
            "image_size": list(prompts.image_size),
        }
        result.update(_ttft(llm, prompts, args))
        result.update(_throughput(llm, prompts, args))
    result["config"] = workload_config(args, config)
    result["config"]["engine"]["multimodal"] = dict(config.multimodal.__dict__)
    result["config"]["workload"].update(
        {
            k: getattr(args, k)
            for k in ("input_len", "num_images", "image_size", "output_len", "batch_size")
        }
        | {"num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup}
    )
    result["machine_before"] = load_before
    result["machine_after"] = machine_info()
    return result


class MmPrompts:
    """The two kinds of prompt for one engine, drawn from the random-mm dataset."""

    def __init__(self, llm, args: argparse.Namespace, seed: int) -> None:
        info = llm.llm_engine.core_client.info
        if not info.takes_images:
            raise ValueError(
                f"model: {info.model_path} takes no images; bench mm needs a vision-language "
                "model (e.g. ringllm make-model DIR --arch llava)"
            )
        self.tokenizer = llm.get_tokenizer()
        (self.image_text,) = self.tokenizer.convert_ids_to_tokens([info.image_token_id])
        self.num_image_tokens = info.num_image_tokens
        size = args.image_size
        self.image_size = parse_image_size(size) if size else (info.image_size, info.image_size)
        self.args, self.seed = args, seed

    def make(self, kind: str, count: int, draw: int) -> list[Any]:
        """`count` prompts of `kind` (`draw` picks the seed: 0 for TTFT, 1 for batches)."""
        from ringllm.tools.bench.datasets.images import random_mm_requests

        args = self.args
        images = args.num_images if kind == "image" else 0
        text_len = args.input_len + (0 if images else args.num_images * self.num_image_tokens)
        requests = random_mm_requests(
            self.tokenizer, count, text_len, args.output_len, 0.0, images,
            (ImageBucket(*self.image_size, 1.0),), self.seed + draw, self.num_image_tokens,
        )  # fmt: skip
        if not images:
            return [r.prompt for r in requests]
        return [
            {
                "prompt": self.image_text * images + r.prompt,
                "multi_modal_data": {"image": [_decoded(png) for png in r.images]},
            }
            for r in requests
        ]


def _decoded(png: bytes):
    from PIL import Image

    image = Image.open(io.BytesIO(png))
    image.load()
    return image


def _encoder_cache(llm):
    """The in-process worker's EncoderCache, or None (engine process, tensor parallel)."""
    core = llm.llm_engine.engine_core
    return getattr(getattr(core, "executor", None), "encoder_cache", None)


def _timed_generate(llm, prompts: list[Any], params) -> tuple[float, float | None, list]:
    """(seconds of the call, seconds the encoder took in it or None, the outputs)."""
    cache = _encoder_cache(llm)
    llm.reset_prefix_cache()
    encoded_before = cache.encode_s if cache is not None else 0.0
    start_s = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start_s
    encode_s = cache.encode_s - encoded_before if cache is not None else None
    return elapsed_s, encode_s, outputs


def _rounds(num_warmup: int, num_timed: int):
    """(timed?, the kinds in this round's order): alternating image-first, text-first."""
    for i in range(num_warmup + num_timed):
        yield i >= num_warmup, KINDS if i % 2 == 0 else KINDS[::-1]


def _ttft(llm, prompts: MmPrompts, args: argparse.Namespace) -> dict[str, Any]:
    from ringllm.pipeline import SamplingParams

    one = {kind: prompts.make(kind, 1, draw=0) for kind in KINDS}
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    runs: dict[str, dict[str, list[float]]] = {
        kind: {"ttft_s": [], "engine_ttft_s": [], "encode_s": []} for kind in KINDS
    }
    prompt_lens = {}
    for timed, order in _rounds(args.num_iters_warmup, args.num_iters):
        for kind in order:
            elapsed_s, encode_s, (output,) = _timed_generate(llm, one[kind], params)
            prompt_lens[kind] = len(output.prompt_token_ids)
            if timed:
                runs[kind]["ttft_s"].append(elapsed_s)
                runs[kind]["engine_ttft_s"].append(output.metrics.ttft_s or 0.0)
                if encode_s is not None:
                    runs[kind]["encode_s"].append(encode_s)
    med = {kind: {k: _median_ms(v) for k, v in runs[kind].items()} for kind in KINDS}
    image, text = med["image"], med["text"]
    encode_ms = image["encode_s"]
    return {
        "prompt_len": prompt_lens,
        "median_ttft_image_ms": image["ttft_s"],
        "median_ttft_text_ms": text["ttft_s"],
        "ttft_ratio": image["ttft_s"] / text["ttft_s"],
        "median_engine_ttft_image_ms": image["engine_ttft_s"],
        "median_engine_ttft_text_ms": text["engine_ttft_s"],
        "engine_ttft_ratio": image["engine_ttft_s"] / text["engine_ttft_s"],
        "median_encode_ms": encode_ms,
        "encoder_share_of_ttft": _share(runs["image"]["encode_s"], runs["image"]["ttft_s"]),
        "encoder_share_of_engine_ttft": _share(
            runs["image"]["encode_s"], runs["image"]["engine_ttft_s"]
        ),
        "ttft_runs": runs,
    }


def _throughput(llm, prompts: MmPrompts, args: argparse.Namespace) -> dict[str, Any]:
    from ringllm.pipeline import SamplingParams

    batch = {kind: prompts.make(kind, args.batch_size, draw=1) for kind in KINDS}
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    runs: dict[str, dict[str, list[float]]] = {
        kind: {"elapsed_s": [], "output_tokens": [], "encode_s": []} for kind in KINDS
    }
    for timed, order in _rounds(args.num_iters_warmup, args.num_iters):
        for kind in order:
            elapsed_s, encode_s, outputs = _timed_generate(llm, batch[kind], params)
            if timed:
                runs[kind]["elapsed_s"].append(elapsed_s)
                runs[kind]["output_tokens"].append(
                    sum(len(c.token_ids) for o in outputs for c in o.outputs)
                )
                if encode_s is not None:
                    runs[kind]["encode_s"].append(encode_s)
    result: dict[str, Any] = {}
    for kind in KINDS:
        run = runs[kind]
        elapsed = np.asarray(run["elapsed_s"])
        result[f"{kind}_output_tok_s"] = float(
            np.median(np.asarray(run["output_tokens"]) / elapsed)
        )
        result[f"{kind}_requests_s"] = float(np.median(args.batch_size / elapsed))
    result["throughput_ratio"] = result["image_output_tok_s"] / result["text_output_tok_s"]
    result["encoder_share_of_batch"] = _share(runs["image"]["encode_s"], runs["image"]["elapsed_s"])
    result["throughput_runs"] = runs
    return result


def _median_ms(values_s: list[float]) -> float | None:
    return 1e3 * float(np.median(values_s)) if values_s else None


def _share(parts_s: list[float], wholes_s: list[float]) -> float | None:
    """Median of part / whole over the rounds (None when the part was not measured)."""
    if not parts_s:
        return None
    return float(np.median(np.asarray(parts_s) / np.asarray(wholes_s)))


def mm_table(result: dict[str, Any]) -> str:
    def share(key: str) -> Any:
        value = result[key]
        return "n/a" if value is None else 100 * value

    lens = result["prompt_len"]
    rows: list[tuple[str, Any]] = [
        ("Images per prompt x positions", f"{result['num_images']} x {result['num_image_tokens']}"),
        ("Image size (px)", "x".join(str(n) for n in result["image_size"])),
        ("Prompt tokens (image / text)", f"{lens['image']} / {lens['text']}"),
        ("Time to first token (one request)", None),
        ("Median TTFT, image (ms)", result["median_ttft_image_ms"]),
        ("Median TTFT, text (ms)", result["median_ttft_text_ms"]),
        ("TTFT image / text", result["ttft_ratio"]),
        ("Median engine TTFT, image (ms)", result["median_engine_ttft_image_ms"]),
        ("Median engine TTFT, text (ms)", result["median_engine_ttft_text_ms"]),
        ("Median encoder time (ms)", result["median_encode_ms"] or "n/a"),
        ("Encoder share of TTFT (%)", share("encoder_share_of_ttft")),
        ("Encoder share of engine TTFT (%)", share("encoder_share_of_engine_ttft")),
        ("Throughput (one batch)", None),
        ("Output tok/s, image", result["image_output_tok_s"]),
        ("Output tok/s, text", result["text_output_tok_s"]),
        ("Throughput image / text", result["throughput_ratio"]),
        ("Requests/s, image", result["image_requests_s"]),
        ("Requests/s, text", result["text_requests_s"]),
        ("Encoder share of the image batch (%)", share("encoder_share_of_batch")),
    ]
    table = format_table("Multimodal Benchmark Result", rows)
    if lens["image"] != lens["text"]:
        table += (
            f"\nNOTE: the prompts differ in length ({lens['image']} vs {lens['text']} tokens): "
            "the random text did not re-encode to its length"
        )
    return table


def run_mm_command(args: argparse.Namespace) -> int:
    result = run_mm(args)
    write_report(result, mm_table(result), args.result_json)
    return 0
