"""Every kernel source compiles to a cubin for sm_80 and sm_90 with the CUDA compilers
that are installed (NVRTC, which CuPy uses, and nvcc), and a broken source is reported."""

from __future__ import annotations

import argparse
import shutil

import pytest

from ringllm.cuda.loader import KERNEL_FAMILIES
from ringllm.cuda.nvrtc_check import (
    DEFAULT_ARCHS,
    CompileError,
    add_parser,
    compile_family,
    compile_with_nvcc,
    compile_with_nvrtc,
    load_nvrtc,
    main,
)

HAVE_NVRTC = load_nvrtc() is not None
HAVE_NVCC = shutil.which("nvcc") is not None
COMPILERS = [
    pytest.param(
        "nvrtc",
        marks=pytest.mark.skipif(not HAVE_NVRTC, reason="needs NVRTC (nvidia-cuda-nvrtc-cu12)"),
    ),
    pytest.param("nvcc", marks=pytest.mark.skipif(not HAVE_NVCC, reason="needs nvcc on PATH")),
]
BROKEN = 'extern "C" __global__ void broken(float* x) { x[threadIdx.x] = not_declared; }'


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("arch", DEFAULT_ARCHS)
@pytest.mark.parametrize("family", KERNEL_FAMILIES)
def test_kernel_source_compiles_for_arch(family, arch, compiler):
    assert compile_family(family, arch, compiler) > 0


@pytest.mark.skipif(not HAVE_NVRTC, reason="needs NVRTC (nvidia-cuda-nvrtc-cu12)")
def test_nvrtc_reports_a_broken_source():
    with pytest.raises(CompileError, match="(?s)NVRTC rejected broken.cu for sm_80:.*not_declared"):
        compile_with_nvrtc(load_nvrtc(), BROKEN, "broken.cu", "sm_80")


@pytest.mark.skipif(not HAVE_NVCC, reason="needs nvcc on PATH")
def test_nvcc_reports_a_broken_source():
    with pytest.raises(CompileError, match="(?s)nvcc rejected broken.cu for sm_90:.*not_declared"):
        compile_with_nvcc(BROKEN, "broken.cu", "sm_90")


@pytest.mark.skipif(not (HAVE_NVRTC or HAVE_NVCC), reason="needs NVRTC or nvcc")
def test_command_line_checks_every_family(capsys):
    assert main(["--arch", "sm_90"]) == 0
    assert capsys.readouterr().out.count("ok ") == len(KERNEL_FAMILIES)


def test_registers_as_a_console_subcommand():
    parser = argparse.ArgumentParser(prog="ringllm")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cuda-check", "--arch", "sm_80", "--compiler", "nvcc"])
    assert args.arch == ["sm_80"] and args.compiler == "nvcc" and callable(args.func)
