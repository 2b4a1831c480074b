"""`ringllm generate`: generate text from a model on the command line (the offline API).

ringllm generate "What is the capital of France?"           # demo model, chat template
ringllm generate --no-chat --max-tokens 32 "Once upon a time"
"""

from __future__ import annotations

import argparse
import sys

from ringllm.pipeline.config import add_cli_args, from_cli_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text offline (default model: the demo model)"
    )
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="send prompts as raw text")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument(
        "--sampling-seed", type=int, default=None, help="seed of the sampling (per request)"
    )
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ringllm.pipeline import LLM, SamplingParams

    llm = LLM.from_config(from_cli_args(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        n=args.n,
        seed=args.sampling_seed,
        stop=args.stop,
    )
    if args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False
        )
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outputs, strict=True):
        for completion in out.outputs:
            sys.stdout.write(f"### {prompt}\n{completion.text}\n[{completion.finish_reason}]\n")
    return 0
