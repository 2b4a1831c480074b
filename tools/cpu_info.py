"""`ringllm cpu-info`: what this CPU reports and what ringllm chooses from it.

Prints (or, with --json, writes as JSON) the facts pipeline/ops/cpu_features.py reads (the
CPU's model, its x86-64 level, torch's oneDNN checks) and the choices made from them: the C
kernel sets and the default one, the quantized kernels' default set, the dtypes whose
weights are prepacked, and what `--dtype auto` runs a bfloat16 checkpoint in.
RINGLLM_CPU_ISA, RINGLLM_CPU_KERNELS and RINGLLM_WEIGHT_LAYOUT apply, as in the engine.
"""

from __future__ import annotations

import argparse
import json

import torch


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cpu-info",
        help="what this CPU runs and what ringllm picks on it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    parser.set_defaults(func=run)


def report() -> dict[str, object]:
    from ringllm.pipeline.models.linear import bf16_layout, layout_policy, weight_dtype
    from ringllm.pipeline.models.quant_weights import bf16_tiles_here
    from ringllm.pipeline.ops import quant
    from ringllm.pipeline.ops.cpu import default_kernel_set
    from ringllm.pipeline.ops.cpu_features import cpu_features

    info = cpu_features().describe()
    info["default_kernel_set"] = default_kernel_set() or "torch"
    info["weight_layout_policy"] = layout_policy()
    compute = cpu_features().auto_dtype(torch.bfloat16)
    matrices = weight_dtype(compute, torch.bfloat16, "cpu")
    info["bfloat16_checkpoint_matrices"] = str(matrices).removeprefix("torch.")
    info["quant_kernel_set"] = quant.default_kernel_set()
    # where this process multiplies bf16 weights itself, `auto` holds a bf16 checkpoint's
    # matrices in the tile layout and computes in float32 (worker/model_loader.py)
    info["bfloat16_checkpoint_auto"] = (
        f"float32 activations, bf16 products ({bf16_layout(quant.default_kernel_set())})"
        if bf16_tiles_here()
        else str(compute).removeprefix("torch.")
    )
    return info


def run(args: argparse.Namespace) -> int:
    info = report()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if isinstance(value, list):
            value = ", ".join(value) or "-"
        print(f"{key + ':':<26}{value}")
    return 0
