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
    sampler             greedy / random sampling of the step's rows
    rest                the engine's own work: scheduling, the flat batch, outputs

Timing every call costs a little (perf_counter twice per call, ~300 calls a step), so the
profile's total is a few percent above the plain steps'; the plain figure is the step time.
The engine runs in this process (no rings), so the profile sees the model runner.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any

from ringllm.pipeline.config import EngineConfig, add_cli_args, from_cli_args
from ringllm.tools.bench_report import (
    add_report_args,
    check_result_json_path,
    format_table,
    machine_info,
    write_result_json,
)

OPS_TIMED = ("paged_attention_decode", "paged_attention_prefill", "rms_norm", "rotary_embedding")
OPS_TIMED += ("reshape_and_cache", "silu_and_mul")


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = bench_subparsers.add_parser(
        "step",
        help="one decode step of a full batch, and its profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = parser.add_argument_group("workload")
    group.add_argument("--batch-size", type=int, default=64, help="requests decoding together")
    group.add_argument("--context-len", type=int, default=64, help="prompt tokens per request")
    group.add_argument("--iterations", type=int, default=10, help="decode steps timed (each way)")
    add_report_args(parser)
    add_cli_args(parser)
    parser.set_defaults(func=run_step_command)


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


@contextmanager
def _profiled(engine, timings: _Timings):
    """Times the runner's ops, its matrix products, the logits and the sampler."""
    from ringllm.pipeline.models import llama

    worker = engine.engine_core.executor
    runner, model = worker.runner, worker.runner.model
    saved_linear, saved_logits = llama.linear, model.compute_logits
    saved_sample, saved_ops = worker.sampler.sample, model.ops
    ops = _TimedOps(saved_ops, timings)
    llama.linear = timings.timed("linear (layers)", saved_linear)
    lm_head = timings.timed("lm_head", saved_logits)

    def compute_logits(hidden):
        llama.linear = saved_linear  # the logits product counts as lm_head, not as a layer's
        try:
            return lm_head(hidden)
        finally:
            llama.linear = timings.timed("linear (layers)", saved_linear)

    model.compute_logits = compute_logits
    model.ops = runner.ops = ops
    worker.sampler.sample = timings.timed("sampler", saved_sample)
    try:
        yield
    finally:
        llama.linear = saved_linear
        model.compute_logits = saved_logits
        model.ops = runner.ops = saved_ops
        worker.sampler.sample = saved_sample


class _TimedOps:
    def __init__(self, ops, timings: _Timings) -> None:
        self._ops, self._timings = ops, timings
        self.name = ops.name

    def __getattr__(self, name):
        attr = getattr(self._ops, name)
        if name in OPS_TIMED:
            label = "attention" if name.startswith("paged_attention") else name
            return self._timings.timed(label, attr)
        return attr


def run_step(args: argparse.Namespace) -> dict[str, Any]:
    from ringllm.pipeline import LLMEngine, SamplingParams
    from ringllm.pipeline.models.linear import layout
    from ringllm.pipeline.ops.cpu_features import cpu_features

    config: EngineConfig = from_cli_args(args)
    if args.batch_size < 1 or args.context_len < 1 or args.iterations < 1:
        raise ValueError("batch_size, context_len and iterations must be at least 1")
    engine = LLMEngine(config)
    try:
        if engine.engine_core is None:
            raise ValueError("bench step needs the engine in this process (no multiprocess)")
        vocab = engine.vocab_size
        params = SamplingParams(
            temperature=0.0, max_tokens=2 * args.iterations + 4, ignore_eos=True
        )
        for i in range(args.batch_size):
            ids = [
                (7919 * (i * args.context_len + j)) % (vocab - 10) + 5
                for j in range(args.context_len)
            ]
            engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
        t0 = time.perf_counter()
        prefill_steps = 0
        while engine.engine_core.scheduler.waiting or prefill_steps == 0:
            engine.step()
            prefill_steps += 1
        prefill_s = time.perf_counter() - t0
        engine.step()  # every request decoding from here
        plain = []
        for _ in range(args.iterations):
            t = time.perf_counter()
            engine.step()
            plain.append(time.perf_counter() - t)
        timings = _Timings()
        profiled = []
        with _profiled(engine, timings):
            for _ in range(args.iterations):
                t = time.perf_counter()
                engine.step()
                profiled.append(time.perf_counter() - t)
        runner = engine.engine_core.executor.runner
        per_step = {k: v / args.iterations for k, v in timings.seconds.items()}
        per_step["rest"] = statistics.mean(profiled) - sum(per_step.values())
        return {
            "batch_size": args.batch_size,
            "context_len": args.context_len,
            "prefill_steps": prefill_steps,
            "prefill_s": prefill_s,
            "decode_step_median_s": statistics.median(plain),
            "decode_step_best_s": min(plain),
            "profiled_step_mean_s": statistics.mean(profiled),
            "profile_s_per_step": per_step,
            "calls_per_step": {k: v // args.iterations for k, v in timings.calls.items()},
            "dtype": str(runner.dtype).removeprefix("torch."),
            "ops": repr(runner.ops),
            "weight_layout": layout(runner.model.layers[0].qkv),
            "cpu": cpu_features().describe(),
            "machine": machine_info(),
        }
    finally:
        engine.shutdown()


def step_table(result: dict[str, Any]) -> str:
    rows = [
        ("Batch x context", f"{result['batch_size']} x {result['context_len']}"),
        ("dtype, ops", f"{result['dtype']}, {result['ops']}"),
        ("Weight layout (models/linear.py)", result["weight_layout"]),
        ("CPU (level used)", f"{result['cpu']['model_name']} ({result['cpu']['isa']})"),
        ("Prefill (s, steps)", f"{result['prefill_s']:.3f}, {result['prefill_steps']}"),
        ("Decode step median (ms)", f"{result['decode_step_median_s'] * 1e3:.2f}"),
        ("Decode step best (ms)", f"{result['decode_step_best_s'] * 1e3:.2f}"),
        ("Profiled step mean (ms)", f"{result['profiled_step_mean_s'] * 1e3:.2f}"),
    ]
    profile = sorted(result["profile_s_per_step"].items(), key=lambda kv: -kv[1])
    calls = result["calls_per_step"]
    rows += [
        (f"  {name} ({calls.get(name, '-')} calls)", f"{seconds * 1e3:.2f} ms")
        for name, seconds in profile
    ]
    return format_table("Engine Step Benchmark", rows)


def run_step_command(args: argparse.Namespace) -> int:
    check_result_json_path(args.result_json)
    result = run_step(args)
    print(step_table(result))
    if args.result_json:
        write_result_json(args.result_json, result)
    return 0
