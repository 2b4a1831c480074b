"""`ringllm bench lora`: what LoRA adapters cost, the base model alone against requests with
adapters, in one engine, phases alternated over rounds.

    base        every request on the base model
    one         every request with adapter 1
    mixed       requests spread over the base model and every adapter (one step mixes
                them: --max-loras is the number of adapters)
    1-user      one request, base then adapter 1: the decode speed one streaming user sees

The adapters are PEFT folders made here with random weights at `--rank` on the model's
q/k/v/o/gate/up/down projections (or `--targets attn`: q/k/v/o), or the folders given
with `--adapter` (repeatable). The prefix cache is emptied before each phase; the prompts
are `--prompt-tokens` random token ids, the same in every phase; each request decodes
`--max-tokens` tokens (EOS ignored). Output tokens per second of each phase and its ratio
to the base phase of the same round are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.report import (
    check_result_json_path,
    format_table,
    machine_info,
    write_report,
)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = (*ATTENTION, "gate_proj", "up_proj", "down_proj")


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "lora",
        help="what LoRA adapters cost against the base model alone",
        description=__doc__,
        run=run_lora_command,
    )
    parser.add_argument("--model", default=None, help="default: the demo model")
    parser.add_argument("--adapters", type=int, default=4, help="random adapters to make")
    parser.add_argument("--adapter", action="append", default=None, help="a PEFT folder")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", choices=("all", "attn"), default="all")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None)


def write_random_adapter(folder: Path, arch, rank: int, targets: tuple[str, ...], seed: int):
    """A PEFT adapter folder for a model of `arch` (hf_config.ArchConfig): random A and B
    (B of the order that moves the outputs, as a trained adapter does)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    dims = {
        "q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv),
        "v_proj": ("self_attn", h, kv), "o_proj": ("self_attn", q, h),
        "gate_proj": ("mlp", h, inter), "up_proj": ("mlp", h, inter),
        "down_proj": ("mlp", inter, h),
    }  # fmt: skip
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for leaf in targets:
            sublayer, fan_in, fan_out = dims[leaf]
            key = f"base_model.model.model.layers.{layer}.{sublayer}.{leaf}"
            a = rng.standard_normal((rank, fan_in), np.float32) / np.sqrt(fan_in)
            b = rng.standard_normal((fan_out, rank), np.float32) * 0.02
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def run_lora(args: argparse.Namespace) -> dict[str, Any]:
    from ringllm.pipeline import LLM, LoRARequest, SamplingParams

    for name in ("adapters", "rank", "num_prompts", "prompt_tokens", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 1")
    check_result_json_path(args.result_json)
    scratch = tempfile.TemporaryDirectory()
    folders = [Path(p) for p in args.adapter or ()]
    count = len(folders) or args.adapters
    llm = LLM(
        args.model, enable_lora=True, max_loras=count, max_lora_rank=max(args.rank, 16),
        max_num_seqs=max(args.num_prompts, 1),
    )  # fmt: skip
    try:
        arch = llm.llm_engine.engine_core.executor.runner.arch
        if not folders:
            targets = ALL if args.targets == "all" else ATTENTION
            for i in range(count):
                folder = Path(scratch.name) / f"adapter{i + 1}"
                write_random_adapter(folder, arch, args.rank, targets, args.seed + i)
                folders.append(folder)
        loras = [LoRARequest(f.name, i + 1, str(f)) for i, f in enumerate(folders)]
        for lora in loras:
            llm.add_lora(lora)
        rng = np.random.default_rng(args.seed)
        vocab = arch.vocab_size
        prompts = [
            {"prompt_token_ids": rng.integers(100, vocab - 100, args.prompt_tokens).tolist()}
            for _ in range(args.num_prompts)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        phases = {
            "base": [None] * len(prompts),
            "one": [loras[0]] * len(prompts),
            "mixed": [([None, *loras])[i % (count + 1)] for i in range(len(prompts))],
        }

        def timed(batch, per_prompt) -> float:
            llm.reset_prefix_cache()
            started = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False, lora_request=per_prompt)
            seconds = time.perf_counter() - started
            return sum(len(o.outputs[0].token_ids) for o in outs) / seconds

        timed(prompts[:2], [None, loras[0]])  # warm: every path compiled and touched
        result: dict[str, Any] = {"machine_before": machine_info(), "rounds": []}
        order = list(phases)
        for round_index in range(args.rounds):
            row = {}
            for name in order if round_index % 2 == 0 else order[::-1]:
                row[name] = timed(prompts, phases[name])
            row["1-user base"] = timed(prompts[:1], [None])
            row["1-user adapter"] = timed(prompts[:1], [loras[0]])
            result["rounds"].append(row)
    finally:
        llm.shutdown()
        scratch.cleanup()
    result.update(
        adapters=count, rank=args.rank, targets=args.targets, num_prompts=args.num_prompts,
        prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
        machine_after=machine_info(),
    )  # fmt: skip
    return result


def lora_table(result: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("adapters (rank, targets)", f"{result['adapters']} ({result['rank']}, {result['targets']})"),
        ("requests x (prompt, output) tokens",
         f"{result['num_prompts']} x ({result['prompt_tokens']}, {result['max_tokens']})"),
    ]  # fmt: skip
    for i, r in enumerate(result["rounds"]):
        rows.append((f"Round {i} (output tokens/s)", None))
        for name in ("base", "one", "mixed"):
            ratio = r[name] / r["base"]
            rows.append((name, f"{r[name]:.1f}  ({ratio:.2f}x base)"))
        single = r["1-user adapter"] / r["1-user base"]
        rows.append(("1 user: base", f"{r['1-user base']:.1f}"))
        rows.append(("1 user: adapter", f"{r['1-user adapter']:.1f}  ({single:.2f}x base)"))
    return format_table("LoRA Benchmark", rows)


def run_lora_command(args: argparse.Namespace) -> int:
    result = run_lora(args)
    write_report(result, lora_table(result), args.result_json)
    sys.stdout.flush()
    return 0
