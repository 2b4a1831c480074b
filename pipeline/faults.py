"""Faults on purpose, for the tests of what a failure costs (nothing is armed otherwise).

`RINGLLM_TEST_FAULTS="point=seed,..."` makes the named point raise `InjectedFault` for a
request whose `SamplingParams.seed` is that value: a request a test marks, in a real
engine process, without a mock. The points:

    add       EngineCore.add_request      (the core taking a request in)
    forward   Worker.execute              (before the model runs the step)
    sample    Worker._sample              (before the sampler runs the step)

Read once, when this module is imported (the engine process reads its own environment);
unset, `ARMED` is False and each point costs one attribute test.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

ENV = "RINGLLM_TEST_FAULTS"
POINTS = ("add", "forward", "sample")


class InjectedFault(RuntimeError):
    """Raised by an armed fault point."""


def _parse(text: str) -> dict[str, int]:
    seeds = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        point, _, seed = item.partition("=")
        if point not in POINTS or not seed.lstrip("-").isdigit():
            raise ValueError(f"{ENV}: {item!r} is not point=seed with point in {POINTS}")
        seeds[point] = int(seed)
    return seeds


_SEEDS = _parse(os.environ.get(ENV, ""))
ARMED = bool(_SEEDS)


def check(point: str, seeds: Iterable[int | None]) -> None:
    """InjectedFault when `point` is armed and one of `seeds` is its seed."""
    seed = _SEEDS.get(point)
    if seed is not None and seed in seeds:
        raise InjectedFault(f"fault injected at {point!r} for the request with seed {seed}")
