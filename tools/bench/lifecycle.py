"""`ringllm bench lifecycle`: what a restart and a sleep cost, measured on a real engine.

Restart: `--num-streams` greedy streams of `--output-len` tokens run through `AsyncLLM` (the
engine core in its own process, as `ringllm serve` runs it); once every stream has
`--kill-after` tokens out, the core is `kill -9`ed. Reported per round (`--num-restarts`),
with and without the warm standby core (pipeline/engine/standby.py):

    restart_s      the death noticed -> the new core ready (supervisor's clock)
    gap_s          the longest pause any stream saw: kill -9 -> its next token
    startup        the new core's own phases: process_s (interpreter + imports; 0 for a
                   standby), model_s (weights loaded), kv_cache_s (KV cache allocated)
    same_text      every stream's tokens equal an undisturbed run's

Sleep: the engine core process's RSS (from /proc) awake, asleep and woken, for each level,
the time sleep and wake_up take, and whether greedy outputs after waking are unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import time
from typing import Any

from ringllm.pipeline.config import add_cli_args, from_cli_args
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.flags import check_at_least
from ringllm.tools.bench.report import (
    check_result_json_path,
    format_table,
    machine_info,
    write_report,
)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "lifecycle",
        help="engine restart time (kill -9, with and without a standby) and sleep mode's memory",
        description=__doc__,
        run=run_lifecycle_command,
    )
    group = parser.add_argument_group("workload")
    group.add_argument("--num-streams", type=int, default=8, help="concurrent greedy streams")
    group.add_argument("--output-len", type=int, default=64, help="tokens per stream")
    group.add_argument("--kill-after", type=int, default=8, help="tokens every stream has first")
    group.add_argument("--num-restarts", type=int, default=3, help="kill -9 rounds per mode")
    group.add_argument(
        "--skip", choices=("restart", "sleep"), action="append", default=[], help="leave a part out"
    )
    parser.add_argument("--result-json", default=None, help="also write the results as JSON")
    add_cli_args(parser)


def _check(args: argparse.Namespace) -> None:
    check_at_least(args, (("num_streams", "", 1), ("output_len", "", 2), ("num_restarts", "", 1)))
    if not 1 <= args.kill_after < args.output_len:
        raise ValueError(
            f"kill_after: must be in [1, output_len), got {args.kill_after} (output_len {args.output_len})"
        )


# ---- restart -----------------------------------------------------------------------


async def _restart_rounds(config, args, standby: bool) -> list[dict[str, Any]]:
    from ringllm.pipeline import SamplingParams
    from ringllm.pipeline.frontend.async_llm import AsyncLLM

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompts = [f"Tell me about the city number {i}." for i in range(args.num_streams)]
    llm = AsyncLLM.from_config(config, max_restarts=args.num_restarts + 1, standby=standby)
    rounds = []
    try:
        reference = await _streams(llm, prompts, params, None)
        for _ in range(args.num_restarts):
            await _standby_ready(llm)
            killed = llm.client.engine_pid
            gaps, texts = await _streams(llm, prompts, params, args.kill_after, gaps=True)
            rounds.append(
                {
                    "killed_pid": killed,
                    "gap_s": round(max(gaps), 3),
                    "restart_s": round(llm.last_restart_s or 0.0, 3),
                    "startup": dict(llm.client.startup_s),
                    "same_text": texts == reference,
                }
            )
    finally:
        llm.shutdown()
    return rounds


async def _standby_ready(llm, timeout_s: float = 60.0) -> None:
    """Waits until the spare has done its imports (it idles on its stdin: little CPU)."""
    standby = llm.supervisor.standby
    if standby is None:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _cpu_busy(standby.process.pid):
        await asyncio.sleep(0.2)


def _cpu_busy(pid: int) -> bool:
    def ticks() -> int:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    try:
        before = ticks()
        time.sleep(0.2)
        return ticks() - before > 2
    except OSError:
        return False


async def _streams(llm, prompts, params, kill_after: int | None, gaps: bool = False):
    """Every prompt streamed; with `kill_after`, the core is killed once each stream has
    that many tokens. Returns the token lists (and, with `gaps`, every inter-token gap)."""
    seen_gaps: list[float] = []
    counts = [0] * len(prompts)
    killed = asyncio.Event()

    async def one(i: int, prompt: str) -> list[int]:
        tokens: list[int] = []
        last = None
        async for out in llm.generate(prompt, params):
            now = time.monotonic()
            if last is not None:
                seen_gaps.append(now - last)
            last = now
            tokens = list(out.outputs[0].token_ids)
            counts[i] = len(tokens)
            if kill_after and not killed.is_set() and min(counts) >= kill_after:
                killed.set()
                os.kill(llm.client.engine_pid, signal.SIGKILL)
        return tokens

    texts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return (seen_gaps, texts) if gaps else texts


# ---- sleep -------------------------------------------------------------------------


def _sleep_levels(config) -> list[dict[str, Any]]:
    from ringllm.pipeline import LLM, SamplingParams
    from ringllm.pipeline.worker.sleep import rss_bytes

    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, enable_sleep_mode=True)
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    results = []
    with LLM.from_config(config, multiprocess=True) as llm:
        pid = llm.llm_engine.core_client.engine_pid
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for level in (1, 2):
            awake = rss_bytes(pid)
            started = time.perf_counter()
            llm.sleep(level)
            sleep_s = time.perf_counter() - started
            asleep = rss_bytes(pid)
            started = time.perf_counter()
            llm.wake_up()
            wake_s = time.perf_counter() - started
            woken = rss_bytes(pid)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            results.append(
                {
                    "level": level,
                    "rss_awake_mib": awake >> 20,
                    "rss_asleep_mib": asleep >> 20,
                    "rss_woken_mib": woken >> 20,
                    "sleep_s": round(sleep_s, 3),
                    "wake_up_s": round(wake_s, 3),
                    "same_outputs": got == reference,
                }
            )
    return results


# ---- report ------------------------------------------------------------------------


def run_lifecycle(args: argparse.Namespace) -> dict[str, Any]:
    _check(args)
    check_result_json_path(args.result_json)
    config = from_cli_args(args)
    result: dict[str, Any] = {"machine_before": machine_info()}
    if "restart" not in args.skip:
        result["restart"] = {
            mode: asyncio.run(_restart_rounds(config, args, standby=(mode == "standby")))
            for mode in ("standby", "no_standby")
        }
    if "sleep" not in args.skip:
        result["sleep"] = _sleep_levels(config)
    result["machine_after"] = machine_info()
    return result


def lifecycle_table(result: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = []
    for mode, rounds in result.get("restart", {}).items():
        rows.append((f"Restart ({mode.replace('_', ' ')})", None))
        for i, r in enumerate(rounds):
            s = r["startup"]
            rows.append((f"round {i}: gap / ready (s)", f"{r['gap_s']:.2f} / {r['restart_s']:.2f}"))
            rows.append(
                (f"round {i}: process / model / KV (s)",
                 f"{s.get('process_s', 0):.2f}/{s.get('model_s', 0):.2f}/{s.get('kv_cache_s', 0):.2f}")
            )  # fmt: skip
            rows.append((f"round {i}: same text as undisturbed", r["same_text"]))
    for level in result.get("sleep", []):
        rows.append((f"Sleep level {level['level']}", None))
        rows.append(
            ("RSS awake / asleep / woken (MiB)",
             f"{level['rss_awake_mib']}/{level['rss_asleep_mib']}/{level['rss_woken_mib']}")
        )  # fmt: skip
        rows.append(("sleep / wake_up (s)", f"{level['sleep_s']:.2f} / {level['wake_up_s']:.2f}"))
        rows.append(("same greedy outputs after waking", level["same_outputs"]))
    return format_table("Engine Lifecycle Benchmark", rows)


def run_lifecycle_command(args: argparse.Namespace) -> int:
    result = run_lifecycle(args)
    write_report(result, lifecycle_table(result), args.result_json)
    return 0
