"""`ringllm bench qgemm-ab`: two builds of the quantized matrix kernels, side by side in one
process, on the same matrix and the same core.

    ringllm bench qgemm-ab --baseline /tmp/before/quant_kernels.cpython-311-x86_64-linux-gnu.so
    ringllm bench qgemm-ab --baseline OLD.so --candidate NEW.so --types q4_k,q6_k --rows 16,32

A shared machine's speed moves by a third within minutes (a neighbour takes one core, the
clock changes), far more than a kernel change does; two runs a minute apart compare two
machines. Here both builds' `quant_kernels` modules are loaded at once, and each turn calls
one then the other (the order swapped every turn) on the same packed matrix, the same
activations and the same threads, so both see the same machine. The figure is the speed of
the candidate over the baseline per turn: its median and interquartile range, beside each
build's median GOP/s. Pin the process to cores (`taskset -c 0`) for a one-thread figure.

The matrix is packed once, by the candidate; before timing, both builds multiply it and must
agree (within float32 rounding), so a build whose packed layout differs is refused, not
timed on bytes it reads another way. --candidate defaults to the installed module.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.qgemm import cold_copies, cpu_model, make_matrix, parse_shapes
from ringllm.tools.bench.report import format_table, write_report

DEFAULT_SHAPES = "8192x2048,2048x8192"
DEFAULT_ROWS = "16,32"
MODULE = "ringllm.pipeline.ops.quant_kernels"


def load_build(path: str | Path):
    """The quant_kernels extension at `path`, loaded beside the installed one (not put in
    sys.modules: each build keeps its own copy of the C code)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no quant_kernels build at {path}")
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    if spec is None:
        raise ValueError(f"{path} is not a Python extension module")
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as exc:
        raise ValueError(f"{path} is not a quant_kernels build: {exc}") from exc
    return module


@contextlib.contextmanager
def _using(module) -> Iterator[None]:
    """`quant`'s calls go to `module` inside the block."""
    from ringllm.pipeline.ops import quant

    saved, quant._q = quant._q, module
    try:
        yield
    finally:
        quant._q = saved


def compare(
    builds: dict[str, Any], qm, m: int, threads: int, turns: int, calls: int, cold: list = ()
) -> dict[str, Any]:
    """One matrix at `m` rows: both builds' agreement, then `turns` alternated turns of
    `calls` timed calls each; with `cold` (copies of `qm`), each timed call multiplies every
    copy in turn, so the weights come from memory, as a decode step's do."""
    from ringllm.pipeline.ops import quant

    n, k = qm.shape
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    outs = {}
    for name, module in builds.items():
        with _using(module):
            outs[name] = quant.qlinear(x, qm, threads=threads)
    scale = outs["candidate"].abs().max().item() or 1.0
    if not torch.allclose(outs["baseline"], outs["candidate"], rtol=1e-4, atol=1e-4 * scale):
        raise ValueError(
            "the two builds disagree on the same packed matrix (a changed layout or a wrong "
            f"kernel): {qm.qtype} {n}x{k}, m={m}, largest difference "
            f"{(outs['baseline'] - outs['candidate']).abs().max().item():.3g}"
        )
    out = torch.empty(m, n)
    copies = list(cold) or [qm]
    times: dict[str, list[float]] = {"baseline": [], "candidate": []}
    ratios = []
    for turn in range(turns):
        order = ("baseline", "candidate") if turn % 2 == 0 else ("candidate", "baseline")
        took = {}
        for name in order:
            with _using(builds[name]):
                quant.qlinear(x, qm, out=out, threads=threads)  # its own caches warm
                start = time.perf_counter()
                for _ in range(calls):
                    for copy in copies:
                        quant.qlinear(x, copy, out=out, threads=threads)
                took[name] = (time.perf_counter() - start) / (calls * len(copies))
            times[name].append(took[name])
        ratios.append(took["baseline"] / took["candidate"])
    q1, _, q3 = statistics.quantiles(ratios, n=4)  # turns >= 2
    ops = 2 * m * n * k
    return {
        "baseline_gops": ops / statistics.median(times["baseline"]) / 1e9,
        "candidate_gops": ops / statistics.median(times["candidate"]) / 1e9,
        "speedup_median": statistics.median(ratios),
        "speedup_q1": q1,
        "speedup_q3": q3,
    }


def run_qgemm_ab(args: argparse.Namespace) -> dict[str, Any]:
    from ringllm.pipeline.ops import quant

    shapes, rows = parse_shapes(args.shapes, args.types), [int(v) for v in args.rows.split(",")]
    if any(m < 1 for m in rows):
        raise ValueError(f"rows: every m must be >= 1, got {args.rows}")
    if args.cold_bytes < 0:
        raise ValueError(f"cold_bytes: want 0 or more, got {args.cold_bytes}")
    if args.turns < 2 or args.calls < 1:
        raise ValueError(f"turns must be >= 2 and calls >= 1, got {args.turns}, {args.calls}")
    builds = {
        "baseline": load_build(args.baseline),
        "candidate": load_build(args.candidate) if args.candidate else quant._q,
    }
    kernel_set = args.kernel_set or quant.default_kernel_set()
    for name, module in builds.items():
        runs = [s for s, ok in zip(module.KERNEL_SETS, module.SUPPORTED, strict=True) if ok]
        if kernel_set not in runs:
            raise ValueError(
                f"kernel set {kernel_set}: the {name} build runs {', '.join(runs)} on this CPU"
            )
    types = quant.QUANT_TYPES if args.types == "all" else args.types.split(",")
    result: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "threads": args.threads,
        "kernel_set": kernel_set,
        "baseline": str(args.baseline),
        "candidate": str(args.candidate or builds["candidate"].__file__),
        "cold_bytes": args.cold_bytes,
        "shapes": {},
    }
    for n, k in shapes:
        entry = result["shapes"].setdefault(f"{n}x{k}", {})
        for qtype in types:
            if qtype == "bf16" and kernel_set not in quant.BF16_SETS:
                continue  # bf16 tiles are the tile unit's only
            with _using(builds["candidate"]):
                qm = make_matrix(qtype, n, k, kernel_set, args.seed)
                cold = cold_copies(qm, args.cold_bytes) if args.cold_bytes else ()
            entry[qtype] = {
                f"m{m}": compare(builds, qm, m, args.threads, args.turns, args.calls, cold)
                for m in rows
            }
    return result


def qgemm_ab_table(result: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("CPU", result["cpu_model"]),
        ("Threads, kernel set", f"{result['threads']}, {result['kernel_set']}"),
        ("Baseline", result["baseline"]),
        ("Candidate", result["candidate"]),
        (
            "Weights",
            f"cold, {result['cold_bytes']} bytes of copies"
            if result.get("cold_bytes")
            else "one warm copy",
        ),
    ]
    for shape, entry in result["shapes"].items():
        rows.append((f" {shape} ", None))
        for qtype, by_rows in entry.items():
            for m, r in by_rows.items():
                rows.append(
                    (
                        f"{qtype} m={m[1:]}: GOP/s base / cand, speed (IQR)",
                        f"{r['baseline_gops']:.0f} / {r['candidate_gops']:.0f}, "
                        f"{r['speedup_median']:.3f}x ({r['speedup_q1']:.3f}-{r['speedup_q3']:.3f})",
                    )
                )
    return format_table("Quantized GEMM, two builds side by side", rows)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers `qgemm-ab` under `ringllm bench`."""
    parser = add_command(
        bench_subparsers,
        "qgemm-ab",
        help="two builds of the quantized kernels, called in turn in one process",
        description=__doc__,
        run=run_qgemm_ab_command,
    )
    parser.add_argument(
        "--baseline", required=True, metavar="SO", help="the other build's quant_kernels*.so"
    )
    parser.add_argument(
        "--candidate", default=None, metavar="SO", help="default: the installed quant_kernels"
    )
    parser.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help=f"NxK,... (default {DEFAULT_SHAPES})"
    )
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"m values (default {DEFAULT_ROWS})")
    parser.add_argument("--types", default="q4_k", help="q4_0,q4_k,... or all (default q4_k)")
    parser.add_argument(
        "--kernel-set", default=None, help="generic, avx2, ... (default: the CPU's best)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--turns", type=int, default=15, help="alternated turns per figure")
    parser.add_argument("--calls", type=int, default=4, help="timed calls per build per turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cold-bytes",
        type=int,
        default=0,
        metavar="N",
        help="rotate through copies of each matrix past N bytes (past the last-level cache: "
        "the weights then come from memory, as in a decode step; default 0, one warm copy)",
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results")
    return parser


def run_qgemm_ab_command(args: argparse.Namespace) -> int:
    if args.json and not Path(args.json).absolute().parent.is_dir():
        raise ValueError(f"json: folder {Path(args.json).absolute().parent} does not exist")
    result = run_qgemm_ab(args)
    write_report(result, qgemm_ab_table(result), args.json)
    return 0
