"""`ringllm bench qgemm-ab`: two quant_kernels builds loaded side by side, called in turn on one
packed matrix. Here both are copies of the installed build (no second build is compiled in
the suite): the table and JSON are complete, both builds agree, and nothing is timed against
a bound (a noisy 2-core machine)."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import pytest

from ringllm.pipeline.ops import quant
from ringllm.tools.bench import qgemm_ab


def run_cli(tmp_path: Path, *argv: str) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    qgemm_ab.add_parser(parser.add_subparsers())
    out = tmp_path / "ab.json"
    args = parser.parse_args(["qgemm-ab", *argv, "--json", str(out)])
    rc = args.func(args)
    return rc, json.loads(out.read_text())


@pytest.fixture
def other_build(tmp_path) -> Path:
    """A copy of the installed build at another path: dlopen gives it its own copy of the C
    code, as a build from another commit would have."""
    path = tmp_path / "before" / Path(quant._q.__file__).name
    path.parent.mkdir()
    shutil.copy(quant._q.__file__, path)
    return path


def test_two_builds_called_in_turn_write_a_complete_result(tmp_path, other_build, capsys):
    rc, result = run_cli(
        tmp_path, "--baseline", str(other_build), "--shapes", "48x512", "--rows", "1,9",
        "--types", "q4_k,q8_0", "--turns", "3", "--calls", "1",
    )  # fmt: skip
    assert rc == 0
    assert result["baseline"] == str(other_build)
    assert result["candidate"] == quant._q.__file__
    assert result["kernel_set"] == quant.default_kernel_set()
    figures = result["shapes"]["48x512"]
    assert set(figures) == {"q4_k", "q8_0"}
    for by_rows in figures.values():
        assert set(by_rows) == {"m1", "m9"}
        for r in by_rows.values():
            for key in ("baseline_gops", "candidate_gops", "speedup_median"):
                assert math.isfinite(r[key]) and r[key] > 0, (key, r)
            assert r["speedup_q1"] <= r["speedup_median"] <= r["speedup_q3"]
    table = capsys.readouterr().out
    assert "q4_k m=9: GOP/s base / cand" in table and str(other_build) in table
    # quant's own module is back in place once the bench is done
    assert quant._q.__file__ != str(other_build)


def test_cold_weights_rotate_through_copies(tmp_path, other_build, capsys):
    """--cold-bytes: each timed call multiplies enough copies of the matrix to pass the bytes
    asked (so the weights come from memory, as in a decode step); the figures stay per
    product, and the table says the weights were cold."""
    rc, result = run_cli(
        tmp_path, "--baseline", str(other_build), "--shapes", "48x512", "--rows", "16",
        "--types", "bf16" if quant.default_kernel_set() in quant.BF16_SETS else "i8", "--turns", "2",
        "--calls", "1", "--cold-bytes", str(1 << 20),
    )  # fmt: skip
    assert rc == 0 and result["cold_bytes"] == 1 << 20
    (by_rows,) = result["shapes"]["48x512"].values()
    assert math.isfinite(by_rows["m16"]["candidate_gops"]) and by_rows["m16"]["candidate_gops"] > 0
    assert f"cold, {1 << 20} bytes of copies" in capsys.readouterr().out
    with pytest.raises(ValueError, match="cold_bytes: want 0 or more"):
        run_cli(tmp_path, "--baseline", str(other_build), "--cold-bytes", "-1")


def test_a_missing_or_foreign_build_and_bad_counts_are_refused(tmp_path, other_build):
    with pytest.raises(ValueError, match="no quant_kernels build at"):
        run_cli(tmp_path, "--baseline", str(tmp_path / "nothing.so"))
    foreign = tmp_path / "foreign.so"
    foreign.write_bytes(b"not a shared object")
    with pytest.raises(ValueError, match="is not a quant_kernels build"):
        run_cli(tmp_path, "--baseline", str(foreign))
    with pytest.raises(ValueError, match="turns must be >= 2"):
        run_cli(tmp_path, "--baseline", str(other_build), "--turns", "1")
    with pytest.raises(ValueError, match="kernel set nope"):
        run_cli(tmp_path, "--baseline", str(other_build), "--kernel-set", "nope")


def test_shapes_take_a_models_own_widths_where_no_k_quant_is_asked_for():
    """k a multiple of 256 with the K-quants among the types (their blocks), else of 32: the
    demo model's 576-wide matrices for bf16 / i8 / q8_0."""
    from ringllm.tools.bench.qgemm import parse_shapes

    assert parse_shapes("960x576,576x1536", "bf16,i8") == [(960, 576), (576, 1536)]
    with pytest.raises(ValueError, match="multiple of 256"):
        parse_shapes("960x576", "all")
    with pytest.raises(ValueError, match="multiple of 256"):
        parse_shapes("960x576", "q8_0,q4_k")
    with pytest.raises(ValueError, match="multiple of 32"):
        parse_shapes("960x570", "q8_0")
