"""PNG plots of one `ringllm bench serve` run (`--plot DIR`; matplotlib, the `bench` extra).

    latency_cdf.png        empirical CDF of each latency metric (ms), one panel each
    output_throughput.png  output tokens/s over the run, in NUM_TIME_BINS equal bins
    concurrency.png        requests in flight over the run (a step function)

The series are computed here with numpy (and tested without matplotlib); the drawing
uses `matplotlib.figure.Figure` directly, never pyplot, so no global backend or figure
state is touched. Failed requests are left out of the latency CDFs but stay in the
concurrency plot: they held a slot while they ran.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

NUM_TIME_BINS = 50
FIGURE_SIZE_IN = (8.0, 4.5)
DPI = 110


class TimedRequest(Protocol):
    """What a plot reads of a request (`serve_backends.RequestResult` has it all)."""

    start_s: float
    end_s: float
    output_len: int
    chunk_times_s: list[float]
    chunk_tokens: list[int]

    @property
    def success(self) -> bool: ...


def import_figure():
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise ValueError(
            "plot: --plot needs matplotlib, which is not installed; "
            "`pip install matplotlib` (or `pip install ringllm[bench]`)"
        ) from None
    return Figure


def check_plot_dir(path: str | os.PathLike) -> None:
    """Fails before the run when plots could not be written afterwards."""
    import_figure()
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"plot: {folder} exists and is not a folder")


def ecdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and the fraction of samples at or below each."""
    xs = np.sort(np.asarray(values, dtype=np.float64))
    return xs, np.arange(1, xs.size + 1) / max(xs.size, 1)


def output_tokens_per_s(
    results: Sequence[TimedRequest], duration_s: float, num_bins: int = NUM_TIME_BINS
) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times s, output tokens/s in each bin) over [0, duration_s].

    NOTE: over HTTP a chunk counts one token, but the server's usage count is the truth;
    each request's chunks are scaled so they add up to its `output_len`, and the bins
    then add up to the run's total output tokens.
    """
    times, weights = [], []
    for r in results:
        if not r.success or not r.chunk_times_s:
            continue
        scale = r.output_len / max(sum(r.chunk_tokens), 1)
        times.extend(r.chunk_times_s)
        weights.extend(scale * n for n in r.chunk_tokens)
    edges = np.linspace(0.0, max(duration_s, 1e-9), num_bins + 1)
    counts, _ = np.histogram(np.clip(times, 0.0, edges[-1]), bins=edges, weights=weights)
    return edges[:-1], counts / np.diff(edges)


def concurrency_steps(results: Sequence[TimedRequest]) -> tuple[np.ndarray, np.ndarray]:
    """(event times s, requests in flight from each time on); an end before a start at
    the same instant, so a slot handed over is never counted twice."""
    events = sorted([(r.start_s, 1) for r in results] + [(r.end_s, -1) for r in results])
    times = np.array([0.0] + [t for t, _ in events])
    in_flight = np.cumsum([0] + [step for _, step in events])
    return times, in_flight


def write_plots(
    results: Sequence[TimedRequest],
    latencies_ms: dict[str, list[float]],
    duration_s: float,
    out_dir: Path,
) -> list[Path]:
    """Writes the three PNGs into `out_dir` (made if missing); returns their paths."""
    figure_class = import_figure()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        _plot_latency_cdfs(figure_class, latencies_ms, out_dir / "latency_cdf.png"),
        _plot_throughput(figure_class, results, duration_s, out_dir / "output_throughput.png"),
        _plot_concurrency(figure_class, results, out_dir / "concurrency.png"),
    ]
    return paths


def _plot_latency_cdfs(figure_class, latencies_ms: dict[str, list[float]], path: Path) -> Path:
    fig = figure_class(figsize=(FIGURE_SIZE_IN[0], FIGURE_SIZE_IN[1] * 1.5))
    axes = fig.subplots(2, 2).ravel()
    for ax, (name, values) in zip(axes, latencies_ms.items(), strict=False):
        xs, ps = ecdf(values)
        ax.step(xs, ps, where="post")
        ax.set_title(f"{name.upper()} ({xs.size} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction <= x")
        ax.grid(alpha=0.3)
    for ax in axes[len(latencies_ms) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def _plot_throughput(figure_class, results, duration_s: float, path: Path) -> Path:
    starts_s, tokens_per_s = output_tokens_per_s(results, duration_s)
    fig = figure_class(figsize=FIGURE_SIZE_IN)
    ax = fig.subplots()
    width_s = starts_s[1] - starts_s[0] if starts_s.size > 1 else duration_s
    ax.bar(starts_s, tokens_per_s, width=width_s, align="edge")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output token throughput over time")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def _plot_concurrency(figure_class, results, path: Path) -> Path:
    times_s, in_flight = concurrency_steps(results)
    fig = figure_class(figsize=FIGURE_SIZE_IN)
    ax = fig.subplots()
    ax.step(times_s, in_flight, where="post")
    ax.yaxis.get_major_locator().set_params(integer=True)  # whole requests
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests in flight")
    ax.set_title(f"Concurrency over time (peak {int(in_flight.max())})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path
