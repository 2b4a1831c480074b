"""The one writer of every `ringllm bench` tool: percentiles, the printed table and the
result JSON (the PNG plots of `bench serve --plot` are its neighbour, plots.py: they need
matplotlib, which only that flag loads).

A bench computes one result dict; `write_report` prints its table and, when asked
(`--result-json`, or `--json` for ipc and kernels), writes the dict as JSON, unchanged, so
the JSON keys are the bench's own.

A metric series (say per-request TTFT in ms) is summarized as `mean_<name>`,
`median_<name>`, `std_<name>` and one `p<P>_<name>` per requested percentile (vLLM's
key names: `p99_ttft_ms`, `p99.9_ttft_ms`). Percentiles use linear interpolation between
the closest ranks (numpy's default, as vLLM's benchmarks use). An empty series gives
zeros, so a result JSON always has every key.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_PERCENTILES = "90,99"
TABLE_WIDTH = 60


def add_report_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("report")
    group.add_argument(
        "--metric-percentiles",
        default=DEFAULT_PERCENTILES,
        help=f"comma-separated percentiles to report, each in (0, 100] (default {DEFAULT_PERCENTILES})",
    )
    group.add_argument(
        "--result-json", "--output-json", dest="result_json", default=None,
        help="also write the results as JSON to this file",
    )  # fmt: skip


def parse_percentiles(text: str) -> list[float]:
    """`"50,90,99.9"` -> [50.0, 90.0, 99.9]; each must lie in (0, 100]."""
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = float(part)
        except ValueError:
            raise ValueError(
                f"metric_percentiles: {part!r} is not a number (expected e.g. '50,90,99')"
            ) from None
        if not 0.0 < value <= 100.0:
            raise ValueError(f"metric_percentiles: {value:g} is outside (0, 100]")
        values.append(value)
    return values


def percentile_label(percentile: float) -> str:
    """99.0 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{percentile:g}"


def summarize(name: str, values: Iterable[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean / median / std / p<P> of `values` under keys `<stat>_<name>`."""
    data = np.asarray(list(values), dtype=np.float64)
    if data.size == 0:
        data = np.zeros(1)
    summary = {
        f"mean_{name}": float(data.mean()),
        f"median_{name}": float(np.median(data)),
        f"std_{name}": float(data.std()),
    }
    for p in percentiles:
        summary[f"{percentile_label(p)}_{name}"] = float(np.percentile(data, p))
    return summary


def format_table(title: str, rows: Sequence[tuple[str, Any]]) -> str:
    """A vLLM-style result block: a centred title, then `label: value` lines; a row
    whose value is None is a `-----label-----` section heading."""
    lines = [f"{' ' + title + ' ':=^{TABLE_WIDTH}}"]
    for label, value in rows:
        if value is None:  # a section heading
            lines.append(f"{label:-^{TABLE_WIDTH}}")
            continue
        if isinstance(value, float):
            text = f"{value:.2f}"
        else:
            text = str(value)
        lines.append(f"{label + ':':<{TABLE_WIDTH - 14}}{text:>14}")
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)


def summary_rows(
    title: str, name: str, unit: str, summary: dict[str, float]
) -> list[tuple[str, Any]]:
    """Table rows for one `summarize` result (std left out), under a `--title--` heading."""
    rows: list[tuple[str, Any]] = [(title, None)]
    for key, value in summary.items():
        stat = key[: -len(name) - 1]
        if stat == "std":
            continue
        label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper()[0] + stat[1:])
        rows.append((f"{label} {title} ({unit})", value))
    return rows


def machine_info() -> dict[str, Any]:
    """Where the numbers came from: the load matters on a shared machine."""
    from ringllm.pipeline.ops.cpu_features import cpu_features

    load_1m, load_5m, _ = os.getloadavg()
    cpu = cpu_features()
    return {
        "cpu_model": cpu.model_name,
        "cpu_isa": cpu.isa,  # the x86-64 level ringllm uses (RINGLLM_CPU_ISA applied)
        "cpu_hardware_isa": cpu.hardware_isa,
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(load_1m, 2),
        "load_avg_5m": round(load_5m, 2),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def check_result_json_path(path: str | os.PathLike | None) -> None:
    """Fails before a long run, not after it, when the result file cannot be written."""
    if path is None:
        return
    folder = Path(path).absolute().parent
    if not folder.is_dir():
        raise ValueError(f"result_json: folder {folder} does not exist; create it first")


def write_result_json(path: str | os.PathLike, result: dict[str, Any]) -> None:
    check_result_json_path(path)
    target = Path(path)
    target.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def write_report(result: dict[str, Any], table: str, result_json: str | os.PathLike | None) -> None:
    """Prints a bench's table, then writes its result as JSON to `result_json` when given."""
    print(table)
    if result_json:
        write_result_json(result_json, result)
