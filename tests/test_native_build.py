"""The C extensions build on every CPU family a user may pip install on.

setup.py compiles the SIMD kernel files for every target: on x86-64 their instruction sets
come from `#pragma GCC target`, elsewhere they compile to nothing and the portable set
remains. These tests compile every C source of the package as setup.py does, for aarch64
with Debian's cross compiler (gcc-aarch64-linux-gnu; .ci/run installs it) and for a
baseline x86-64 (no -march), and fail on any error or warning.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("ipc/*.c"), *ROOT.glob("pipeline/ops/csrc/*.c")])
FLAGS = ["-O2", "-std=gnu11", "-Wall", "-Werror", "-fopenmp", "-fPIC", "-c"]


def _compile(compiler: str, source: Path, out: Path, extra=()) -> None:
    include = sysconfig.get_paths()["include"]
    cmd = [compiler, *FLAGS, *extra, f"-I{include}", f"-I{source.parent}", str(source)]
    done = subprocess.run(
        [*cmd, "-o", str(out / (source.stem + ".o"))], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and not done.stderr.strip(), f"{source.name}: {done.stderr}"


def test_every_native_source_is_listed():
    setup = (ROOT / "setup.py").read_text()
    for source in SOURCES:
        assert source.name in setup, f"{source.name} is not built by setup.py"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_sources_cross_compile_for_aarch64(source, tmp_path):
    compiler = shutil.which("aarch64-linux-gnu-gcc")
    if compiler is None:
        pytest.skip("needs aarch64-linux-gnu-gcc (Debian package gcc-aarch64-linux-gnu)")
    _compile(compiler, source, tmp_path)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_sources_compile_for_baseline_x86_64(source, tmp_path):
    compiler = shutil.which("x86_64-linux-gnu-gcc") or shutil.which("gcc")
    if compiler is None or not sysconfig.get_platform().endswith("x86_64"):
        pytest.skip("needs an x86-64 gcc")
    _compile(compiler, source, tmp_path, extra=["-march=x86-64", "-mtune=generic"])
