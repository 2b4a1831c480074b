"""`ringllm bench tiers`: the KV tiers (#19) side by side, offline and in process.

Three parts (`--parts`, all by default), each comparing configurations built alike but
for the tiers, their runs alternating so a noisy machine slows them alike:

    preemption   time lost per preemption at each `--contexts` length, swap against
                 recompute (tools/bench/tiers_preemption.py explains the method)
    throughput   output tok/s of a batch that must preempt (small device cache, long
                 outputs): swap, recompute with the host tier, recompute without
    multi-turn   prefix hit rate and median / P99 TTFT of interleaved chats whose KV is
                 several times the device cache: no tier, host tier, host + disk
                 (tools/bench/tiers_chat.py; the requests are `bench serve`'s
                 `--dataset multi-turn`, so the same workload can be sent to a server)

The tier flags keep the engine's names: `--swap-space` is the host tier of every
configuration that has one (default here 1 GiB), `--kv-offload-max-gib` the disk tier
(default here 1 GiB; its file is allocated whole), `--kv-offload-dir` the folder the disk
tier's temporary folder is made in (deleted after; default the system's temporary
folder). The device cache of each part is sized by the part (`--throughput-gpu-blocks`,
`--multi-turn-gpu-blocks`; the preemption scenario's own), and so is the preemption mode.
Every other engine flag applies to every configuration. Figures are medians over
`--num-iters` runs of each configuration (after one untimed warm-up request per engine).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ringllm.pipeline.config import EngineConfig, add_cli_args, config_to_dict, from_cli_args
from ringllm.tools.bench import tiers_preemption as preemption
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.datasets.multi_turn import (
    multi_turn_prefix_blocks,
    multi_turn_prompt_len,
    multi_turn_requests,
)
from ringllm.tools.bench.datasets.request import prompt_token_pool
from ringllm.tools.bench.flags import check_at_least, check_one_process, parse_names
from ringllm.tools.bench.report import (
    add_report_args,
    check_result_json_path,
    machine_info,
    parse_percentiles,
    write_report,
)
from ringllm.tools.bench.throughput import workload_config
from ringllm.tools.bench.tier_probes import CopyTimer, TierTotals
from ringllm.tools.bench.tiers_chat import CHAT_CONFIGS, chat_summary, run_chat_once
from ringllm.tools.bench.tiers_table import tiers_table

PARTS = ("preemption", "throughput", "multi-turn")
TIER_FLAGS = (
    "num_gpu_blocks_override", "preemption_mode", "swap_space", "kv_offload_dir",
    "kv_offload_max_gib",
)  # fmt: skip


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "tiers",
        help="KV tiers: swap vs recompute preemption, multi-turn prefix offload",
        description=__doc__,
        run=run_tiers_command,
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}"
    )
    parser.add_argument("--num-iters", type=int, default=3, help="timed runs of each config")
    tiers = parser.add_argument_group("tiers")
    tiers.add_argument(
        "--swap-space", dest="host_tier_gib", type=float, default=1.0,
        help="GiB of the host tier in every configuration with one (default 1)",
    )  # fmt: skip
    tiers.add_argument(
        "--kv-offload-max-gib", dest="disk_tier_gib", type=float, default=1.0,
        help="GiB of the disk tier (allocated whole; default 1)",
    )  # fmt: skip
    tiers.add_argument(
        "--kv-offload-dir", dest="disk_tier_parent", default=None,
        help="folder to make the disk tier's temporary folder in (default: the system's)",
    )  # fmt: skip
    group = parser.add_argument_group("preemption and throughput")
    group.add_argument(
        "--contexts", default="500,2000,4000", help="context lengths (tokens) to preempt at"
    )
    group.add_argument(
        "--decode-steps", type=int, default=8,
        help="decode steps each request runs alone after the preemption (the reference)",
    )  # fmt: skip
    group.add_argument("--throughput-requests", type=int, default=8, help="requests per batch")
    group.add_argument("--throughput-input-len", type=int, default=1000, help="prompt tokens")
    group.add_argument("--throughput-output-len", type=int, default=500, help="output tokens")
    group.add_argument(
        "--throughput-gpu-blocks", type=int, default=None,
        help="device KV blocks (default: 40%% of what the batch needs at full length)",
    )  # fmt: skip
    chat = parser.add_argument_group("multi-turn")
    chat.add_argument("--multi-turn-conversations", type=int, default=16, help="conversations")
    chat.add_argument("--multi-turn-turns", type=int, default=4, help="turns per conversation")
    chat.add_argument(
        "--multi-turn-prefix-len", type=int, default=1024,
        help="tokens each conversation opens with",
    )  # fmt: skip
    chat.add_argument("--multi-turn-user-len", type=int, default=64, help="tokens per user turn")
    chat.add_argument("--multi-turn-output-len", type=int, default=16, help="tokens asked per turn")
    chat.add_argument(
        "--max-concurrency", type=int, default=1, help="turns in flight at most (default 1)"
    )
    chat.add_argument(
        "--multi-turn-gpu-blocks", type=int, default=None,
        help="device KV blocks (default: (max concurrency + 1) x the longest turn's; a "
        "sliding-window model's blocks are one layer group's: give it about G times that)",
    )  # fmt: skip
    chat.add_argument(
        "--disk-swap-space", type=float, default=0.1,
        help="GiB of the host tier in front of the disk tier, in host+disk (default 0.1)",
    )  # fmt: skip
    add_report_args(parser)
    add_cli_args(parser, skip=TIER_FLAGS)


def parse_parts(text: str) -> list[str]:
    return parse_names("parts", text, PARTS)


def parse_contexts(text: str) -> list[int]:
    try:
        contexts = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"contexts: {text!r} is not a comma-separated list of tokens") from None
    if not contexts or min(contexts) < 1:
        raise ValueError(f"contexts: each must be >= 1 token, got {text!r}")
    return contexts


def check_args(args: argparse.Namespace) -> None:
    """Every flag error before an engine is built."""
    counts = (
        ("num_iters", "runs"), ("decode_steps", "steps"), ("throughput_requests", "requests"),
        ("throughput_input_len", "tokens"), ("throughput_output_len", "tokens"),
        ("multi_turn_conversations", "conversations"), ("multi_turn_turns", "turns"),
        ("multi_turn_prefix_len", "tokens"), ("multi_turn_user_len", "tokens"),
        ("multi_turn_output_len", "tokens"), ("max_concurrency", "requests"),
    )  # fmt: skip
    check_at_least(args, ((field, unit, 1) for field, unit in counts))
    for field in ("throughput_gpu_blocks", "multi_turn_gpu_blocks"):
        value = getattr(args, field)
        if value is not None and value < 1:
            raise ValueError(f"{field}: must be >= 1 block, got {value}")
    for dest, field in (
        ("host_tier_gib", "swap_space"), ("disk_swap_space", "disk_swap_space"),
        ("disk_tier_gib", "kv_offload_max_gib"),
    ):  # fmt: skip
        if not getattr(args, dest) > 0:
            raise ValueError(f"{field}: must be above 0 GiB, got {getattr(args, dest)}")
    if args.max_concurrency > args.multi_turn_conversations:
        raise ValueError(
            f"max_concurrency: {args.max_concurrency} turns in flight, but only "
            f"{args.multi_turn_conversations} conversations; a turn waits for the one before"
        )
    if args.disk_tier_parent is not None and not Path(args.disk_tier_parent).is_dir():
        raise ValueError(f"kv_offload_dir: {args.disk_tier_parent} is not a folder")
    check_one_process(args, "bench tiers reads one in-process engine core and its worker")
    parse_parts(args.parts)
    parse_contexts(args.contexts)
    parse_percentiles(args.metric_percentiles)
    check_result_json_path(args.result_json)


def variant(config: EngineConfig, **fields: Any) -> EngineConfig:
    """`config` with these engine fields changed (validated as the flags are)."""
    return EngineConfig.from_kwargs(**{**config_to_dict(config), **fields})


@contextlib.contextmanager
def engines(configs: dict[str, EngineConfig]):
    """One in-process `LLM` per configuration, each warmed up, all shut down after."""
    from ringllm.pipeline import LLM, SamplingParams

    built: dict[str, Any] = {}
    try:
        for name, config in configs.items():
            llm = LLM.from_config(config)
            built[name] = llm
            warm_up = _pool(llm)[:8].tolist()
            llm.generate([warm_up], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
            llm.reset_prefix_cache()
        yield built
    finally:
        for llm in built.values():
            llm.shutdown()


def run_tiers(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the parts asked for; returns the result dict (no printing)."""
    check_args(args)
    config = from_cli_args(args)
    parts = parse_parts(args.parts)
    result: dict[str, Any] = {"parts": parts, "machine_before": machine_info()}
    if "preemption" in parts:
        result["preemption"] = _preemption_part(args, config)
    if "throughput" in parts:
        result["throughput"] = _throughput_part(args, config)
    if "multi-turn" in parts:
        result["multi_turn"] = _chat_part(args, config)
    engine_fields = config_to_dict(config)
    result["config"] = {
        "workload": {k: v for k, v in vars(args).items() if k != "func" and k not in engine_fields},
        "engine": workload_config(args, config)["engine"],  # each part changes its own fields
    }
    result["machine_after"] = machine_info()
    return result


def _pool(llm) -> np.ndarray:
    return prompt_token_pool(llm.get_tokenizer())


def _preemption_part(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    block_size = config.cache.block_size
    by_context: dict[str, Any] = {}
    for context_len in parse_contexts(args.contexts):
        output_len = preemption.preemption_output_len(context_len, block_size, args.decode_steps)
        fields = preemption.preemption_engine_fields(context_len, output_len, block_size)
        configs = {
            "swap": variant(
                config, preemption_mode="swap", swap_space=args.host_tier_gib, **fields
            ),
            "recompute": variant(config, preemption_mode="recompute", swap_space=0, **fields),
        }
        runs: dict[str, list] = {mode: [] for mode in configs}
        with engines(configs) as llms:
            timers = {mode: CopyTimer(llm) for mode, llm in llms.items()}
            prompts = preemption.preemption_prompts(
                _pool(llms["swap"]), context_len, config.model.seed
            )
            for run in range(args.num_iters):
                for mode in _alternating(list(configs), run):
                    runs[mode].append(
                        preemption.run_preemption(
                            llms[mode], timers[mode], prompts, output_len, run
                        )
                    )
            kv_bytes_per_block = timers["swap"].kv_bytes_per_block
        entry = {mode: {**preemption.medians(r), "runs": r} for mode, r in runs.items()}
        entry["output_len"] = output_len
        entry["num_gpu_blocks"] = fields["num_gpu_blocks_override"]
        entry["kv_bytes_per_token"] = kv_bytes_per_block // block_size
        entry["recompute_over_swap"] = _ratio(
            entry["recompute"]["time_lost_s"], entry["swap"]["time_lost_s"]
        )
        by_context[str(context_len)] = entry
    return {"contexts": by_context}


def _throughput_part(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    block_size = config.cache.block_size
    per_request = -(-(args.throughput_input_len + args.throughput_output_len) // block_size)
    needed = args.throughput_requests * per_request
    num_blocks = args.throughput_gpu_blocks or max(per_request + 1, 2 * needed // 5)
    fields = {"num_gpu_blocks_override": num_blocks}
    configs = {
        "swap": variant(config, preemption_mode="swap", swap_space=args.host_tier_gib, **fields),
        "recompute": variant(
            config, preemption_mode="recompute", swap_space=args.host_tier_gib, **fields
        ),
        "recompute-no-tier": variant(config, preemption_mode="recompute", swap_space=0, **fields),
    }
    runs: dict[str, list] = {mode: [] for mode in configs}
    with engines(configs) as llms:
        timers = {mode: CopyTimer(llm) for mode, llm in llms.items()}
        rng = np.random.default_rng(config.model.seed)
        pool = _pool(llms["swap"])
        prompts = [
            rng.choice(pool, size=args.throughput_input_len).tolist()
            for _ in range(args.throughput_requests)
        ]
        for run in range(args.num_iters):
            for mode in _alternating(list(configs), run):
                runs[mode].append(
                    preemption.run_throughput_once(
                        llms[mode], timers[mode], prompts, args.throughput_output_len
                    )
                )
    result: dict[str, Any] = {
        "num_gpu_blocks": num_blocks,
        "blocks_needed": needed,
        "num_requests": args.throughput_requests,
        "modes": {mode: {**preemption.medians(r), "runs": r} for mode, r in runs.items()},
    }
    modes = result["modes"]
    result["swap_over_recompute"] = _ratio(
        modes["swap"]["output_tok_s"], modes["recompute-no-tier"]["output_tok_s"]
    )
    return result


def _chat_part(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    if not config.cache.enable_prefix_caching:
        raise ValueError(
            "enable_prefix_caching: the multi-turn part measures the prefix cache's tiers; "
            "leave it on"
        )
    block_size = config.cache.block_size
    shape = (
        args.multi_turn_prefix_len, args.multi_turn_user_len, args.multi_turn_output_len,
    )  # fmt: skip
    longest = multi_turn_prompt_len(*shape, args.multi_turn_turns - 1) + args.multi_turn_output_len
    num_blocks = args.multi_turn_gpu_blocks or (args.max_concurrency + 1) * -(
        -longest // block_size
    )
    prefix_blocks = multi_turn_prefix_blocks(
        args.multi_turn_conversations, args.multi_turn_turns, *shape, block_size
    )
    percentiles = parse_percentiles(args.metric_percentiles)
    disk_dir = Path(tempfile.mkdtemp(prefix="ringllm-bench-tiers-", dir=args.disk_tier_parent))
    fields = {"num_gpu_blocks_override": num_blocks, "max_model_len": longest + block_size}
    configs = {
        "none": variant(config, swap_space=0, **fields),
        "host": variant(config, swap_space=args.host_tier_gib, **fields),
        "host+disk": variant(
            config,
            swap_space=args.disk_swap_space,
            kv_offload_dir=str(disk_dir),
            kv_offload_max_gib=args.disk_tier_gib,
            **fields,
        ),  # fmt: skip
    }
    runs: dict[str, list] = {name: [] for name in CHAT_CONFIGS}
    try:
        with engines(configs) as llms:
            probes = {name: (CopyTimer(llm), TierTotals.attach(llm)) for name, llm in llms.items()}
            requests = multi_turn_requests(
                llms["none"].get_tokenizer(),
                args.multi_turn_conversations * args.multi_turn_turns,
                args.multi_turn_conversations, args.multi_turn_turns, *shape,
                config.model.seed,
            )  # fmt: skip
            prompts = [r.prompt for r in requests]
            core = llms["none"].llm_engine.engine_core
            kv_groups = core.scheduler.kv.num_groups if hasattr(core, "scheduler") else 1
            for run in range(args.num_iters):
                for name in _alternating(list(CHAT_CONFIGS), run):
                    runs[name].append(
                        run_chat_once(
                            llms[name],
                            *probes[name],
                            prompts,
                            args.multi_turn_conversations,
                            args.multi_turn_output_len,
                            args.max_concurrency,
                            percentiles,
                            block_size,
                            kv_groups,
                        )  # fmt: skip
                    )
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    summary = {name: chat_summary(r) for name, r in runs.items()}
    none_ttft = summary["none"]["median_ttft_ms"]
    for name in CHAT_CONFIGS:
        summary[name]["ttft_speedup"] = _ratio(none_ttft, summary[name]["median_ttft_ms"])
    return {
        "num_gpu_blocks": num_blocks,
        "prefix_blocks": prefix_blocks,
        # a cached prefix holds a block of every group (the sliding ones' until evicted)
        "prefix_blocks_over_device": prefix_blocks * kv_groups / num_blocks,
        "num_requests": len(prompts),
        "prompt_lens": [multi_turn_prompt_len(*shape, t) for t in range(args.multi_turn_turns)],
        "percentiles": percentiles,
        "configs": summary,
    }


def _alternating(names: list[str], run: int) -> list[str]:
    """Run `run`'s order: rotated by one each run, so no configuration always goes first."""
    shift = run % len(names)
    return names[shift:] + names[:shift]


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def run_tiers_command(args: argparse.Namespace) -> int:
    result = run_tiers(args)
    write_report(result, tiers_table(result), args.result_json)
    return 0
