"""`ringllm bench step`: one engine step of a full decode batch, and where its time goes.

`--batch-size` requests of `--context-len` random prompt tokens are prefilled (that step is
timed too), then `--iterations` decode steps of the whole engine (`LLMEngine.step`:
schedule, build the batch, the model, logits, sampling, outputs) are timed one by one. Then
as many again with every ops call, every matrix product, the logits and the sampler timed
separately, which gives the profile:

    linear (layers)     the q|k|v, o, gate|up and down products of every layer
    lm_head             the logits product of the rows sampled from
    attention           paged decode attention, every layer
    rms_norm, rotary, reshape_and_cache, silu_and_mul     the other ops, every layer
    decoder layers, one C call    a decode step's layers when they run fused
                        (models/decode_plan.py): all of the above but lm_head, in C
    experts (routing and products)   a mixture of experts' sparse MLPs (models/moe.py):
                        the router, the grouping and every expert's products
    model, other        the rest of the forward pass (embedding, views, residual adds)
    sampler             greedy / random sampling of the step's rows
    runner host         the worker's host work: the step's inputs from the scheduler's diff,
                        sampled rows back into results (pipeline/worker/profiling.py)
    engine, outside the worker   scheduling, output updates, detokenizing

Timing every call costs a little (perf_counter twice per call, ~300 calls a step), so the
profile's total is a few percent above the plain steps'; the plain figure is the step time.
The engine runs in this process (no rings), so the profile sees the model runner.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

from ringllm.pipeline.config import EngineConfig, add_cli_args, from_cli_args
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.report import (
    add_report_args,
    check_result_json_path,
    format_table,
    machine_info,
    write_report,
)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "step",
        help="one decode step of a full batch, and its profile",
        description=__doc__,
        run=run_step_command,
    )
    group = parser.add_argument_group("workload")
    group.add_argument("--batch-size", type=int, default=64, help="requests decoding together")
    group.add_argument("--context-len", type=int, default=64, help="prompt tokens per request")
    group.add_argument("--iterations", type=int, default=10, help="decode steps timed (each way)")
    add_report_args(parser)
    add_cli_args(parser)


class _Timings:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def timed(self, name: str, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return call


def run_step(args: argparse.Namespace) -> dict[str, Any]:
    from ringllm.pipeline import LLMEngine, SamplingParams
    from ringllm.pipeline.child_process import freeze_heap
    from ringllm.pipeline.ops.cpu_features import cpu_features
    from ringllm.pipeline.worker.profiling import instrument

    config: EngineConfig = from_cli_args(args)
    if args.batch_size < 1 or args.context_len < 1 or args.iterations < 1:
        raise ValueError("batch_size, context_len and iterations must be at least 1")
    if config.scheduler.async_scheduling:
        raise ValueError(
            "bench step times one step at a time; --async-scheduling runs two at once (time "
            "it with bench latency or bench throughput)"
        )
    engine = LLMEngine(config)
    try:
        if engine.engine_core is None:
            raise ValueError("bench step needs the engine in this process (no multiprocess)")
        freeze_heap()  # as the engine core process does before its loop
        vocab = engine.vocab_size
        # NOTE: a request decodes while the later ones still prefill (chunked prefill, FCFS),
        # so it needs a token for each of those steps too, or the early ones finish before
        # the timed steps and the batch is smaller than asked (at 16 x 4096 it was half).
        scheduler = engine.engine_core.scheduler
        budget = max(1, config.scheduler.max_num_batched_tokens - args.batch_size)
        prefill_steps_bound = -(-args.batch_size * args.context_len // budget) + args.batch_size
        max_tokens = 2 * args.iterations + 4 + prefill_steps_bound
        if args.context_len + max_tokens > engine.engine_core.max_model_len:
            raise ValueError(
                f"context_len: {args.context_len} tokens + {max_tokens} decoded exceed the "
                f"model's {engine.engine_core.max_model_len}; ask a shorter context"
            )
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(args.batch_size):
            ids = [
                (7919 * (i * args.context_len + j)) % (vocab - 10) + 5
                for j in range(args.context_len)
            ]
            engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
        t0 = time.perf_counter()
        prefill_steps = 0
        while prefill_steps == 0 or scheduler.load()[1] or _prefilling(scheduler):
            engine.step()
            prefill_steps += 1
        prefill_s = time.perf_counter() - t0
        engine.step()  # every request decoding from here
        decoding = scheduler.load()[0]
        plain = []
        for _ in range(args.iterations):
            t = time.perf_counter()
            engine.step()
            plain.append(time.perf_counter() - t)
        timings = _Timings()
        profiled = []
        with instrument(engine.engine_core.executor, timings.timed) as inside_layers:
            for _ in range(args.iterations):
                t = time.perf_counter()
                engine.step()
                profiled.append(time.perf_counter() - t)
        if not decoding == scheduler.load()[0] == args.batch_size:
            raise RuntimeError(
                f"bench step: {decoding} then {scheduler.load()[0]} requests decoded in the "
                f"timed steps, not {args.batch_size} (rejected or finished early)"
            )
        worker = engine.engine_core.executor.describe()
        per_step = {k: v / args.iterations for k, v in timings.seconds.items()}
        execute = per_step.pop("worker execute")
        forward = per_step.pop("model forward")
        inside_forward = sum(v for k, v in per_step.items() if k not in ("lm_head", "sampler"))
        per_step["model, other"] = forward - inside_forward  # embedding, views, residual adds
        per_step["runner host"] = execute - forward - per_step["lm_head"] - per_step["sampler"]
        per_step["engine, outside the worker"] = statistics.mean(profiled) - execute
        return {
            "batch_size": args.batch_size,
            "context_len": args.context_len,
            "prefill_steps": prefill_steps,
            "prefill_s": prefill_s,
            "decode_step_median_s": statistics.median(plain),
            "decode_step_best_s": min(plain),
            "profiled_step_mean_s": statistics.mean(profiled),
            "profile_s_per_step": per_step,
            # the one C call's own parts (within "decoder layers, one C call")
            "inside_layers_s_per_step": {k: v / args.iterations for k, v in inside_layers.items()},
            "calls_per_step": {k: v // args.iterations for k, v in timings.calls.items()},
            "dtype": worker["dtype"],
            "kv_cache_dtype": worker["kv_cache_dtype"],
            "ops": worker["ops"],
            "weight_layout": worker["weight_layout"],
            "cpu": cpu_features().describe(),
            "machine": machine_info(),
        }
    finally:
        engine.shutdown()


def _prefilling(scheduler) -> bool:
    """Whether a running request still has prompt tokens to compute."""
    return any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)


def step_table(result: dict[str, Any]) -> str:
    rows = [
        ("Batch x context", f"{result['batch_size']} x {result['context_len']}"),
        ("dtype, ops", f"{result['dtype']}, {result['ops']}"),
        ("KV cache dtype", result.get("kv_cache_dtype", "-")),
        ("Weight layout (models/linear.py)", result["weight_layout"]),
        ("CPU (level used)", f"{result['cpu']['model_name']} ({result['cpu']['isa']})"),
        ("Prefill (s, steps)", f"{result['prefill_s']:.3f}, {result['prefill_steps']}"),
        ("Decode step median (ms)", f"{result['decode_step_median_s'] * 1e3:.2f}"),
        ("Decode step best (ms)", f"{result['decode_step_best_s'] * 1e3:.2f}"),
        ("Profiled step mean (ms)", f"{result['profiled_step_mean_s'] * 1e3:.2f}"),
    ]
    profile = sorted(result["profile_s_per_step"].items(), key=lambda kv: -kv[1])
    calls = result["calls_per_step"]
    inside = sorted(result.get("inside_layers_s_per_step", {}).items(), key=lambda kv: -kv[1])
    for name, seconds in profile:
        rows.append((f"  {name} ({calls.get(name, '-')} calls)", f"{seconds * 1e3:.2f} ms"))
        if name == "decoder layers, one C call":  # where its time went, from the C side
            rows += [(f"    {part}", f"{s * 1e3:.2f} ms") for part, s in inside]
    return format_table("Engine Step Benchmark", rows)


def run_step_command(args: argparse.Namespace) -> int:
    check_result_json_path(args.result_json)
    result = run_step(args)
    write_report(result, step_table(result), args.result_json)
    return 0
