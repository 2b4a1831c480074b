"""The checks every bench runs on its own flags before it builds an engine: counts with a
floor, a comma-separated list of names, and the benches that read one in-process engine
core. Each error names the flag's field (and its unit), as `ValueError` everywhere.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence


def check_at_least(args: argparse.Namespace, limits: Iterable[tuple[str, str, int]]) -> None:
    """Each (field, unit, low): `args.field >= low`; unit "" for a bare count."""
    for field, unit, low in limits:
        value = getattr(args, field)
        if value < low:
            unit_text = f" {unit}" if unit else ""
            raise ValueError(f"{field}: must be >= {low}{unit_text}, got {value}")


def parse_names(field: str, text: str, allowed: Sequence[str]) -> list[str]:
    """`"a, b"` -> ["a", "b"]: at least one name, each one of `allowed`."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names or any(name not in allowed for name in names):
        raise ValueError(f"{field}: {text!r} must list some of {', '.join(allowed)}")
    return names


def check_one_process(args: argparse.Namespace, why: str) -> None:
    """The benches that read one in-process engine core refuse TP and DP above 1."""
    for field in ("tensor_parallel_size", "data_parallel_size"):
        if (getattr(args, field, None) or 1) > 1:
            raise ValueError(f"{field}: {why}; run it with 1")
