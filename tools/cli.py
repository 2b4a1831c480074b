"""The `ringllm` console script: one entry point, one subcommand per tool.

Each subcommand lives in its own module and registers itself through a `add_parser`
function; this module only wires them together, so a later tool is one line in COMMANDS.
Only the module of the subcommand that runs is imported (all of them for the full help or
a mistyped command): several bring torch and the engine, which `ringllm serve`'s front end,
a process that never runs a model, would otherwise hold (about 200 MiB resident).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> the module whose add_parser registers it, in the order the help lists them
COMMANDS = {
    "serve": "ringllm.server.cli",
    "bench": "ringllm.tools.bench.commands",
    "generate": "ringllm.tools.generate",
    "make-model": "ringllm.tools.make_model",
    "make-gguf": "ringllm.tools.make_gguf",
    "fetch-demo-model": "ringllm.tools.demo_model",
    "cuda-check": "ringllm.cuda.nvrtc_check",
    "cpu-info": "ringllm.tools.cpu_info",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of `command` alone, or (None, or a name that is no subcommand) of all."""
    modules = [COMMANDS[command]] if command in COMMANDS else list(COMMANDS.values())
    parser = argparse.ArgumentParser(prog="ringllm", description="ringllm LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in modules:
        importlib.import_module(name).add_parser(sub)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand argv names: its first word, when no option comes before it."""
    return argv[0] if argv and argv[0] in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # a value the user gave (a flag, a config): said, no traceback
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
