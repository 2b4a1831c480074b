"""Compile checks for the kernel sources on a machine without a GPU.

Compiles each `.cu` family -- the exact text `loader.read_source` gives CuPy -- to a
cubin for a real architecture (sm_80, sm_90), so a kernel that g++ accepts in the
emulator but the CUDA front end or ptxas rejects fails here, not on the first GPU run.

Two compilers, tried in this order:
  * NVRTC through ctypes: the library CuPy itself compiles with (libnvrtc.so.12, found
    in the `nvidia-cuda-nvrtc-cu12` wheel or the system's library path);
  * nvcc, where it is on PATH (`nvcc -cubin`).

Command line: `python -m ringllm.cuda.nvrtc_check [--arch sm_80 sm_90] [--compiler nvcc]`
(`add_parser` registers the same as `ringllm cuda-check`).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import shutil
import subprocess
import tempfile
from pathlib import Path

from ringllm.cuda.loader import KERNEL_FAMILIES, cuda_include_options, read_source

DEFAULT_ARCHS = ("sm_80", "sm_90")


class CompileError(RuntimeError):
    """A kernel source did not compile for a GPU architecture."""


def _nvrtc_candidates() -> list[str]:
    found = []
    try:
        import nvidia.cuda_nvrtc

        for root in nvidia.cuda_nvrtc.__path__:
            found += [str(p) for p in sorted(Path(root, "lib").glob("libnvrtc.so*"))]
    except ImportError:
        pass
    system = ctypes.util.find_library("nvrtc")
    return found + ([system] if system else []) + ["libnvrtc.so.12", "libnvrtc.so"]


def load_nvrtc() -> ctypes.CDLL | None:
    """The NVRTC library, or None where none is installed."""
    for candidate in _nvrtc_candidates():
        try:
            return ctypes.CDLL(candidate)
        except OSError:
            continue
    return None


def compile_with_nvrtc(nvrtc: ctypes.CDLL, source: str, name: str, arch: str) -> int:
    """Compiles to a cubin for `arch`; returns the cubin's size in bytes."""
    program = ctypes.c_void_p()
    _nvrtc_call(
        nvrtc,
        "nvrtcCreateProgram",
        ctypes.byref(program),
        source.encode(),
        name.encode(),
        0,
        None,
        None,
    )
    options = [f"--gpu-architecture={arch}", "--std=c++17", *cuda_include_options()]
    encoded = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    try:
        status = nvrtc.nvrtcCompileProgram(program, len(options), encoded)
        if status != 0:
            log_size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(log_size))
            log = ctypes.create_string_buffer(log_size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise CompileError(f"NVRTC rejected {name} for {arch}:\n{log.value.decode()[-6000:]}")
        cubin_bytes = ctypes.c_size_t()
        _nvrtc_call(nvrtc, "nvrtcGetCUBINSize", program, ctypes.byref(cubin_bytes))
        return cubin_bytes.value
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def _nvrtc_call(nvrtc: ctypes.CDLL, function: str, *args: object) -> None:
    status = getattr(nvrtc, function)(*args)
    if status != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise CompileError(f"{function} failed: {nvrtc.nvrtcGetErrorString(status).decode()}")


def compile_with_nvcc(source: str, name: str, arch: str) -> int:
    """Compiles to a cubin for `arch` with nvcc; returns the cubin's size in bytes."""
    with tempfile.TemporaryDirectory(prefix="ringllm-nvcc-") as tmp:
        cu, cubin = Path(tmp, name), Path(tmp, "out.cubin")
        cu.write_text(source)
        command = ["nvcc", "-std=c++17", f"-arch={arch}", "-cubin", str(cu), "-o", str(cubin)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise CompileError(f"nvcc rejected {name} for {arch}:\n{result.stderr[-6000:]}")
        return cubin.stat().st_size


def available_compiler() -> str | None:
    """ "nvrtc", "nvcc", or None where neither is installed."""
    if load_nvrtc() is not None:
        return "nvrtc"
    return "nvcc" if shutil.which("nvcc") else None


def compile_family(family: str, arch: str, compiler: str | None = None) -> int:
    """Compiles one kernel family for one architecture; returns the cubin size in bytes."""
    compiler = compiler or available_compiler()
    source, name = read_source(family), f"{family}.cu"
    if compiler == "nvrtc":
        nvrtc = load_nvrtc()
        if nvrtc is None:
            raise CompileError("NVRTC is not installed (pip install nvidia-cuda-nvrtc-cu12)")
        return compile_with_nvrtc(nvrtc, source, name, arch)
    if compiler == "nvcc":
        return compile_with_nvcc(source, name, arch)
    raise CompileError("neither NVRTC (nvidia-cuda-nvrtc-cu12) nor nvcc is available")


def check_all(archs: list[str], compiler: str | None = None) -> int:
    """Compiles every family for every arch, printing one line each; returns the failure count."""
    failures = 0
    for family in KERNEL_FAMILIES:
        for arch in archs:
            try:
                size = compile_family(family, arch, compiler)
                print(f"ok    {family}.cu {arch}: cubin {size} bytes")
            except CompileError as error:
                failures += 1
                print(f"FAIL  {family}.cu {arch}: {error}")
    return failures


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS), help="e.g. sm_80 sm_90")
    parser.add_argument(
        "--compiler", choices=("nvrtc", "nvcc"), default=None, help="default: NVRTC if installed"
    )
    parser.set_defaults(func=lambda args: 1 if check_all(args.arch, args.compiler) else 0)
    return parser


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers `ringllm cuda-check` on the console script's subparsers."""
    _configure(
        subparsers.add_parser("cuda-check", help="compile every .cu kernel for sm_80 / sm_90")
    )


def main(argv: list[str] | None = None) -> int:
    parser = _configure(
        argparse.ArgumentParser(description="Compile every ringllm .cu for real GPU archs.")
    )
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
