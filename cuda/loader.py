"""Kernel loading: one compiled module per `.cu` file, on CuPy (GPU) or the CPU emulator.

`KernelLoader(backend)` reads `cuda/<family>.cu`, pastes `common.cuh` in place of its
`#include "common.cuh"` (so NVRTC, nvcc and g++ compile exactly the same text, with no
include paths to configure), compiles it once per loader -- `cupy.RawModule` on
"cupy", `EmulatedModule` on "emulator" -- and hands out kernels by name.

Both kinds of kernel are wrapped in `Kernel`, which takes torch tensors and numpy
scalars and launches with the `cupy.RawKernel` call shape

    kernel(grid, block, args, shared_mem=0)

On CuPy a tensor becomes its device pointer (`data_ptr()`, no copy) and the launch goes
to torch's current CUDA stream, so kernels order correctly with torch's own work.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ringllm.cuda.emulator import EmulatedModule

SOURCE_DIR = Path(__file__).parent
KERNEL_FAMILIES = (
    "norm",
    "activation",
    "rotary",
    "cache_ops",
    "paged_attention",
    "prefill_attention",
    "quant_matmul",
    "moe",
    "lora",
)
BACKENDS = ("cupy", "emulator")
_INCLUDE_COMMON = re.compile(r'^\s*#include\s+"common\.cuh"\s*$', re.MULTILINE)
_ALLOWED_SCALARS = (np.float32, np.float64, np.int32, np.int64, np.uint32, np.uint64)


def paste_common(text: str) -> str:
    """A kernel source with common.cuh pasted in place of its `#include "common.cuh"`."""
    common = (SOURCE_DIR / "common.cuh").read_text()
    return _INCLUDE_COMMON.sub(lambda _: common, text)


def read_source(family: str) -> str:
    """The full text of a kernel family, with common.cuh pasted in."""
    if family not in KERNEL_FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {KERNEL_FAMILIES}")
    return paste_common((SOURCE_DIR / f"{family}.cu").read_text())


def cuda_include_options() -> list[str]:
    """-I options for cuda_fp16.h / cuda_bf16.h: a CUDA toolkit, or the runtime wheel's headers."""
    roots = [os.environ.get("CUDA_PATH", ""), os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    try:
        import nvidia.cuda_runtime

        roots += [str(p) for p in nvidia.cuda_runtime.__path__]
    except ImportError:
        pass
    found = [Path(r, "include") for r in roots if r and Path(r, "include", "cuda_fp16.h").exists()]
    return [f"-I{path}" for path in dict.fromkeys(found)]


class Kernel:
    """A compiled kernel that takes torch tensors (as pointers) and numpy scalars."""

    def __init__(self, name: str, raw: object, backend: str):
        self.name = name
        self._raw = raw
        self._backend = backend

    def __call__(
        self, grid: Sequence[int], block: Sequence[int], args: Sequence[object], shared_mem: int = 0
    ) -> None:
        if self._backend == "emulator":
            self._raw(grid, block, args, shared_mem=shared_mem)  # checks args against the signature
            return
        import cupy

        device_args = tuple(self._to_cupy(i, a) for i, a in enumerate(args))
        # RawKernel launches on CuPy's current stream: make that torch's current stream.
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            self._raw(tuple(grid), tuple(block), device_args, shared_mem=shared_mem)

    def _to_cupy(self, index: int, arg: object) -> object:
        if isinstance(arg, torch.Tensor):
            if arg.device.type != "cuda":
                raise TypeError(
                    f"kernel {self.name} argument {index}: expected a CUDA tensor, got {arg.device}"
                )
            return np.uint64(arg.data_ptr())
        if isinstance(arg, _ALLOWED_SCALARS):
            return arg
        raise TypeError(
            f"kernel {self.name} argument {index}: got {type(arg).__name__}; pass a tensor or a "
            "numpy scalar of the parameter's exact type (CuPy misreads Python numbers)"
        )


class KernelLoader:
    """Compiles each kernel family once and returns its kernels by name."""

    def __init__(self, backend: str, thread_order: str = "forward"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.thread_order = thread_order
        self._modules: dict[str, object] = {}
        self._kernels: dict[str, Kernel] = {}

    def kernel(self, family: str, name: str) -> Kernel:
        key = f"{family}/{name}"
        if key not in self._kernels:
            raw = self._module(family).get_function(name)
            self._kernels[key] = Kernel(name, raw, self.backend)
        return self._kernels[key]

    def _module(self, family: str) -> object:
        if family not in self._modules:
            source = read_source(family)
            if self.backend == "emulator":
                self._modules[family] = EmulatedModule(source, self.thread_order)
            else:
                import cupy

                options = ("--std=c++17", *cuda_include_options())
                self._modules[family] = cupy.RawModule(code=source, options=options)
        return self._modules[family]
