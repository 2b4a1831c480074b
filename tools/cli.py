"""The `ringllm` console script: one entry point, one subcommand per tool.

Each subcommand lives in its own module and registers itself through a `add_parser`
function; this module only wires them together, so a later tool is one import here.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from ringllm.cuda import nvrtc_check
    from ringllm.server import cli as serve
    from ringllm.tools import cpu_info, demo_model, generate, make_gguf, make_model
    from ringllm.tools.bench import commands as bench

    parser = argparse.ArgumentParser(prog="ringllm", description="ringllm LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (
        serve,
        bench,
        generate,
        make_model,
        make_gguf,
        demo_model,
        nvrtc_check,
        cpu_info,
    ):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # a value the user gave (a flag, a config): said, no traceback
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
