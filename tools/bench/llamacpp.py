"""`ringllm bench llamacpp`: one user, ringllm against llama.cpp on the same files, in one run.

    ringllm bench llamacpp --llama-bench ~/peers/llama.cpp/bin/llama-bench \\
        --model smollm2-135m-q4_1.gguf --model llama-1b-q4_k_m.gguf --threads 2 --rounds 3

For each `--model` (a GGUF file; an HF folder runs the ringllm side only), R rounds
alternate the two engines (the first to run swaps every round, so a drift of the shared
machine's load falls on both):

    llama.cpp  `llama-bench -m FILE -t T -p P -n N -r 1 -o json`: its pp (prefill of a
               P-token prompt) and tg (N tokens generated) tok/s
    ringllm    one LLM built once per file (--num-threads T): prefill tok/s = P / the
               wall time of a max_tokens=1 request (its time to first token); decode
               tok/s = N / (time of an N+1-token request - time of the 1-token one),
               EOS ignored, the prefix cache emptied before each request

Each engine's figure is reported as its range over the rounds (min-max, not the best),
with the ratio ringllm / llama.cpp of each round. Decode also as a fraction of the
machine's read bandwidth (measured in the same run by `bench membw`, or --bandwidth-gbps):

    fraction = bytes_per_token * decode tok/s / read bandwidth
    bytes_per_token = the file's tensor bytes, less the token embedding when the model
                      has a separate output matrix (decode reads one embedding row)

The same bytes are used for both engines: the fraction of the bandwidth the file itself
would need (an engine that widens the weights reads more than it is credited with).
A file an engine cannot run is an error in its column, and the others still run.
Each measurement also records `others_cpu_share`, the part of the cores other processes
took while it ran (from /proc/stat less this process's and llama-bench's own CPU time);
a round above --noisy-cpu-share (10%) is kept aside in `noisy_rounds` and rerun, at most
--noisy-retries (2) times, so a neighbour's burst on the shared machine does not become a
figure (llama.cpp's spinning threads lose up to 10x to one). The bandwidth is measured
before and after the files, the higher kept; it is torch's streaming read, which a
well-tuned GEMV can beat by a little: a fraction a bit over 100% means just that.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ringllm.pipeline.config import add_cli_args, config_to_dict, from_cli_args
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.flags import check_at_least, check_one_process, parse_names
from ringllm.tools.bench.llamacpp_peer import run_llama_bench
from ringllm.tools.bench.membw import (
    add_membw_args,
    check_membw_args,
    measure_bandwidth,
    measure_with_neighbours,
)
from ringllm.tools.bench.report import (
    add_report_args,
    check_result_json_path,
    format_table,
    machine_info,
    write_report,
)

ENGINES = ("llamacpp", "ringllm")
MAX_ERROR_CHARS = 200


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "llamacpp",
        help="one user: prefill and decode tok/s against llama.cpp's llama-bench, per file",
        description=__doc__,
        run=run_llamacpp_command,
    )
    group = parser.add_argument_group("side by side")
    group.add_argument(
        "--model", action="append", required=True, metavar="FILE",
        help="a GGUF file (or an HF folder: ringllm only); repeat for several",
    )  # fmt: skip
    group.add_argument("--llama-bench", default=None, metavar="PATH", help="llama-bench binary")
    group.add_argument(
        "--engines", default=",".join(ENGINES), help="which sides to run (default both)"
    )
    group.add_argument("--rounds", type=int, default=3, help="rounds per file (default 3)")
    group.add_argument("--threads", type=int, default=2, help="threads of both engines")
    group.add_argument("--prompt-len", type=int, default=32, help="P: prompt tokens")
    group.add_argument("--output-len", type=int, default=128, help="N: decoded tokens")
    group.add_argument(
        "--bandwidth-gbps", type=float, default=None,
        help="the read bandwidth to divide by (default: measured at the start)",
    )  # fmt: skip
    group.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    group.add_argument(
        "--noisy-cpu-share", type=float, default=0.10,
        help="a round in which other processes took more of the cores than this is rerun",
    )  # fmt: skip
    group.add_argument(
        "--noisy-retries", type=int, default=2, help="reruns of a noisy round at most"
    )
    add_membw_args(parser)
    add_report_args(parser)
    add_cli_args(parser, skip=("model", "num_threads", "seed"))


def check_args(args: argparse.Namespace) -> list[str]:
    """Every flag error before a model loads; returns the engines to run."""
    engines = parse_names("engines", args.engines, ENGINES)
    check_at_least(
        args,
        (
            ("rounds", "rounds", 1),
            ("threads", "threads", 1),
            ("prompt_len", "tokens", 1),
            ("output_len", "tokens", 1),
            ("noisy_retries", "reruns", 0),
        ),
    )
    check_membw_args(args)
    check_one_process(args, "one user's figures are one engine process's")
    if args.bandwidth_gbps is not None and not args.bandwidth_gbps > 0:
        raise ValueError(f"bandwidth_gbps: must be > 0 GB/s, got {args.bandwidth_gbps}")
    if "llamacpp" in engines:
        if args.llama_bench is None:
            raise ValueError(
                "llama_bench: pass --llama-bench PATH (../shared/peers/llamacpp.sh builds "
                "it), or --engines ringllm"
            )
        if not Path(args.llama_bench).is_file():
            raise ValueError(f"llama_bench: {args.llama_bench} is not a file")
    for model in args.model:
        if not Path(model).exists():
            raise ValueError(f"model: {model} does not exist")
    check_result_json_path(args.result_json)
    return engines


# ---- the weights a decoded token reads --------------------------------------------------


def weight_bytes(model: str) -> dict[str, int]:
    """{"weight_bytes": every tensor's bytes, "bytes_per_token": those decode reads}."""
    path = Path(model)
    if path.is_dir():
        sizes = _safetensors_sizes(path)
        embedding, output = "model.embed_tokens.weight", "lm_head.weight"
    else:
        from gguf import GGUFReader

        sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
        embedding, output = "token_embd.weight", "output.weight"
    total = sum(sizes.values())
    per_token = total - sizes.get(embedding, 0) if output in sizes else total
    return {"weight_bytes": total, "bytes_per_token": per_token}


def _safetensors_sizes(folder: Path) -> dict[str, int]:
    """Tensor bytes from each .safetensors header (8 bytes of length, then JSON)."""
    sizes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                sizes[name] = end - start
    return sizes


# ---- ringllm --------------------------------------------------------------------------


class RingllmSide:
    """One engine for one file, built once; `run_round` times a prefill and a decode."""

    def __init__(self, args: argparse.Namespace, model: str) -> None:
        from ringllm.pipeline import LLM
        from ringllm.tools.bench.datasets.text import random_requests

        given = argparse.Namespace(**vars(args))
        given.model, given.num_threads = model, args.threads
        self.config = from_cli_args(given)
        self.llm = LLM.from_config(self.config)
        (request,) = random_requests(
            self.llm.get_tokenizer(), 1, args.prompt_len, args.output_len, 0.0, args.seed
        )
        self.prompt = {"prompt_token_ids": request.prompt}
        self.prompt_len, self.output_len = args.prompt_len, args.output_len
        for max_tokens in (1, 4):  # warm-up, off the clock: thread pools, allocator, caches
            self._timed(max_tokens)

    def _timed(self, max_tokens: int) -> float:
        from ringllm.pipeline import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.llm.reset_prefix_cache()  # every request prefills its whole prompt
        start_s = time.perf_counter()
        (out,) = self.llm.generate([self.prompt], params, use_tqdm=False)
        elapsed_s = time.perf_counter() - start_s
        made = len(out.outputs[0].token_ids)
        if made != max_tokens:
            raise RuntimeError(f"ringllm made {made} tokens where {max_tokens} were asked")
        return elapsed_s

    def run_round(self) -> dict[str, float]:
        first_token_s = self._timed(1)
        whole_s = self._timed(self.output_len + 1)
        decode_s = whole_s - first_token_s
        return {
            "prefill_tok_s": self.prompt_len / first_token_s,
            "decode_tok_s": self.output_len / decode_s if decode_s > 0 else float("nan"),
            "first_token_s": first_token_s,
            "whole_request_s": whole_s,
        }

    def close(self) -> None:
        self.llm.shutdown()
        del self.llm
        gc.collect()


# ---- the run --------------------------------------------------------------------------


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:MAX_ERROR_CHARS]


def run_one_model(args: argparse.Namespace, model: str, engines: list[str]) -> dict[str, Any]:
    """Every round of both engines on one file; an engine that fails leaves its error."""
    entry: dict[str, Any] = {"model": model, **weight_bytes(model)}
    sides: dict[str, Any] = {name: {"rounds": []} for name in engines}
    ringllm = None
    if "ringllm" in engines:
        try:
            ringllm = RingllmSide(args, model)
            sides["ringllm"]["config"] = config_to_dict(ringllm.config)
        except Exception as exc:  # a file it cannot load: shown in its column
            sides["ringllm"]["error"] = short_error(exc)
    try:
        for round_index in range(args.rounds):
            order = engines if round_index % 2 == 0 else engines[::-1]
            for name in order:
                if "error" not in sides[name]:
                    run_side_round(args, model, sides[name], name, ringllm)
                    print(f"{Path(model).name}: {name} round {round_index + 1}", file=sys.stderr)
    finally:
        if ringllm is not None:
            ringllm.close()
    entry.update(sides)
    entry["ratios"] = round_ratios(sides)
    return entry


def run_side_round(
    args: argparse.Namespace, model: str, side: dict[str, Any], name: str, ringllm
) -> None:
    """One round of one engine into `side`; a round that other processes took more than
    --noisy-cpu-share of the cores from is kept in `noisy_rounds` and run again (at most
    --noisy-retries times: then the quietest try counts)."""

    def llama_cpp() -> dict[str, Any]:
        return run_llama_bench(
            args.llama_bench, model, args.threads, args.prompt_len, args.output_len
        )

    for _ in range(args.noisy_retries + 1):
        try:
            measured = measure_with_neighbours(
                llama_cpp if name == "llamacpp" else ringllm.run_round
            )
        except Exception as exc:
            side["error"] = short_error(exc)
            return
        if name == "llamacpp":
            side["build"], side["gguf"] = measured.pop("build"), measured.pop("model")
        if measured["others_cpu_share"] <= args.noisy_cpu_share:
            side["rounds"].append(measured)
            return
        side.setdefault("noisy_rounds", []).append(measured)
    # every try was noisy: the quietest one counts (it stays listed among the noisy too)
    side["rounds"].append(min(side["noisy_rounds"][-(args.noisy_retries + 1) :], key=_share))


def _share(measured: dict[str, Any]) -> float:
    return measured["others_cpu_share"]


def round_ratios(sides: dict[str, Any]) -> dict[str, list[float]]:
    """ringllm / llama.cpp of each round both engines finished."""
    if "llamacpp" not in sides or "ringllm" not in sides:
        return {}
    pairs = list(zip(sides["ringllm"]["rounds"], sides["llamacpp"]["rounds"], strict=False))
    return {
        phase: [ours[f"{phase}_tok_s"] / theirs[f"{phase}_tok_s"] for ours, theirs in pairs]
        for phase in ("prefill", "decode")
    }


def add_bandwidth_fractions(entry: dict[str, Any], read_gbps: float) -> None:
    """Each decode round's bytes per token x tok/s over the read bandwidth."""
    for name in ENGINES:
        for measured in entry.get(name, {}).get("rounds", []):
            gbps = entry["bytes_per_token"] * measured["decode_tok_s"] / 1e9
            measured["decode_gbps"] = gbps
            measured["decode_bandwidth_fraction"] = gbps / read_gbps


def run_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    engines = check_args(args)
    load_before = machine_info()
    if args.bandwidth_gbps is not None:
        bandwidths = [{"read_gbps": args.bandwidth_gbps, "method": "given (--bandwidth-gbps)"}]
    else:
        bandwidths = [measure_bandwidth(args.threads, args.buffer_bytes, args.repeats)]
    models = [run_one_model(args, model, engines) for model in args.model]
    if args.bandwidth_gbps is None:  # again at the end: a neighbour may have spoilt one
        bandwidths.append(measure_bandwidth(args.threads, args.buffer_bytes, args.repeats))
    bandwidth = max(bandwidths, key=lambda b: b["read_gbps"])
    for entry in models:
        add_bandwidth_fractions(entry, bandwidth["read_gbps"])
    workload = (
        "rounds", "threads", "prompt_len", "output_len", "seed", "llama_bench",
        "noisy_cpu_share", "noisy_retries",
    )  # fmt: skip
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "engines": engines,
        "workload": {k: getattr(args, k) for k in workload},
        "bandwidth": bandwidth,
        "bandwidth_measurements_gbps": [b["read_gbps"] for b in bandwidths],
        "models": models,
        "machine_before": load_before,
        "machine_after": machine_info(),
    }


# ---- the table ------------------------------------------------------------------------

ENGINE_TITLES = {"llamacpp": "llama.cpp", "ringllm": "ringllm"}


def value_range(values: list[float], digits: int = 1) -> str:
    """'111.2-121.0' (min-max), one value alone, '-' for none."""
    if not values:
        return "-"
    low, high = min(values), max(values)
    if len(values) == 1 or f"{low:.{digits}f}" == f"{high:.{digits}f}":
        return f"{low:.{digits}f}"
    return f"{low:.{digits}f}-{high:.{digits}f}"


def model_rows(entry: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = [(f" {Path(entry['model']).name} ", None)]
    noisy = sum(len(entry.get(name, {}).get("noisy_rounds", [])) for name in ENGINES)
    if noisy:
        rows.append(("Rounds rerun: other processes were busy", noisy))
    rows.append(("Weight bytes read per token (MB)", entry["bytes_per_token"] / 1e6))
    for phase in ("prefill", "decode"):
        for name in ENGINES:
            if name not in entry:
                continue
            side = entry[name]
            label = f"{ENGINE_TITLES[name]} {phase} (tok/s, min-max)"
            if "error" in side and not side["rounds"]:
                rows.append((label, "error"))
                continue
            rows.append((label, value_range([r[f"{phase}_tok_s"] for r in side["rounds"]])))
        ratios = entry["ratios"].get(phase)
        if ratios:
            text = "/".join(f"{r:.2f}" for r in ratios)
            rows.append((f"{phase.capitalize()} ringllm / llama.cpp, per round", text))
    for name in ENGINES:
        rounds = entry.get(name, {}).get("rounds", [])
        shares = [100 * r["others_cpu_share"] for r in rounds if "others_cpu_share" in r]
        if shares:
            rows.append(
                (f"{ENGINE_TITLES[name]} rounds: other processes' CPU %", value_range(shares, 0))
            )
    for name in ENGINES:
        fractions = [
            100 * r["decode_bandwidth_fraction"] for r in entry.get(name, {}).get("rounds", [])
        ]
        if fractions:
            rows.append(
                (f"{ENGINE_TITLES[name]} decode, % of read bandwidth", value_range(fractions))
            )
    return rows


def llamacpp_table(result: dict[str, Any]) -> str:
    workload = result["workload"]
    rows: list[tuple[str, Any]] = [
        ("Rounds", workload["rounds"]),
        ("Threads", workload["threads"]),
        ("Prompt / decoded tokens", f"{workload['prompt_len']} / {workload['output_len']}"),
        ("Read bandwidth, best (GB/s)", result["bandwidth"]["read_gbps"]),
        (
            "Read bandwidth before / after (GB/s)",
            "/".join(f"{gbps:.1f}" for gbps in result.get("bandwidth_measurements_gbps", [])),
        ),
    ]
    errors = []
    for entry in result["models"]:
        rows += model_rows(entry)
        for name in ENGINES:
            if "error" in entry.get(name, {}):
                errors.append(f"{Path(entry['model']).name}, {name}: {entry[name]['error']}")
    table = format_table("llama.cpp Side-by-side (one user)", rows)
    if errors:
        table += "\nErrors:\n" + "\n".join(f"  {line}" for line in errors)
    return table


def run_llamacpp_command(args: argparse.Namespace) -> int:
    result = run_llamacpp(args)
    write_report(result, llamacpp_table(result), args.result_json)
    return 0
