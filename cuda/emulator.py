"""CPU emulator for the project's CUDA kernels: the same `.cu` text, compiled with g++.

It owns turning a kernel source into a shared library (g++ with `emulator.h` force-included,
cached on disk by a hash of everything that goes into the build) and launching its
`extern "C" __global__` kernels with the call shape of `cupy.RawKernel`:

    kernel(grid, block, args, shared_mem=0)

so the loader and the launch wrappers in `ops.py` serve CuPy and the emulator alike. Each
block's threads run as fibers on one OS thread, switching at `__syncthreads` and at warp
operations (see emulator.h for the execution model). `thread_order="reverse"` runs the
threads (and blocks) in reverse order: a kernel with a missing barrier then gives a
different answer in one of the two orders, which the tests compare.

Arguments are checked against the kernel's C++ signature (which the compiled library
reports): a pointer parameter takes a CPU torch tensor of the pointee's dtype, a scalar
parameter takes a numpy scalar of exactly that type (np.float32, np.int32, np.int64...).
A Python int or float is rejected, because CuPy would pass it as an 8-byte int64 / double
that a `float` or `int` parameter silently misreads.

`extern __shared__ T name[];` is rewritten to a pointer into the launch's dynamic shared
memory (filled with 0xFF bytes -- NaN as floats -- before each block, so a read of
memory nobody wrote shows); plain `__shared__` becomes a static, which is exactly
"shared by the running block" because blocks run one after another.

Limits (the emulator is for correctness, not speed): no grid-wide synchronisation or
cooperative groups, no inline PTX, no tensor-core / async-copy intrinsics, no warp votes
(__ballot_sync, __any_sync), no textures; dynamic shared memory is capped at CUDA's
default 48 KiB and blocks at 1024 threads. Threads of a block never truly run at once,
so a race shows only through the two thread orders, not through every interleaving.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

HEADER_PATH = Path(__file__).with_name("emulator.h")
HEADER_FILES = (
    "emulator.h",
    "emulator_fiber.h",
    "emulator_numeric.h",
)  # everything the build key must cover
CXX_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17", "-fno-strict-aliasing")
THREAD_ORDERS = ("forward", "reverse")
_ERROR_BUFFER_BYTES = 4096

_KERNEL_NAME = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(')
# `extern __shared__ T name[];` -> a pointer into the launch's dynamic shared memory.
_DYNAMIC_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([\w:]+(?:\s*\*)?)\s+"
    r"(?:__align__\(\s*\d+\s*\)\s+)?(\w+)\s*\[\s*\]\s*;"
)

_SCALAR_TYPE_NAMES = {
    np.float32: "float32",
    np.float64: "float64",
    np.int32: "int32",
    np.int64: "int64",
    np.uint32: "uint32",
    np.uint64: "uint64",
}
_SCALAR_CTYPES = {
    "float32": ctypes.c_float,
    "float64": ctypes.c_double,
    "int32": ctypes.c_int32,
    "int64": ctypes.c_int64,
    "uint32": ctypes.c_uint32,
    "uint64": ctypes.c_uint64,
}
_TENSOR_TYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float64: "float64",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.int8: "int8",
}


class EmulatorError(RuntimeError):
    """A kernel failed in the emulator: deadlock, bad launch configuration, bad shuffle."""


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint32 * 3),
        ("block", ctypes.c_uint32 * 3),
        ("shared_bytes", ctypes.c_uint64),
        ("reverse", ctypes.c_int32),
    ]


def default_cache_dir() -> Path:
    """`$RINGLLM_CACHE_DIR/emu`, else `~/.cache/ringllm/emu`."""
    root = os.environ.get("RINGLLM_CACHE_DIR") or Path.home() / ".cache" / "ringllm"
    return Path(root) / "emu"


def kernel_names(source: str) -> list[str]:
    """The `extern "C" __global__` kernels a source defines, in order.

    The source is preprocessed first (without the emulator header, so `__global__` stays
    a word), because kernels are usually stamped out per dtype by a macro.
    """
    command = ["g++", "-E", "-P", "-x", "c++", "-DRINGLLM_EMULATOR", "-"]
    result = subprocess.run(command, input=source, capture_output=True, text=True)
    if result.returncode != 0:
        raise EmulatorError(f"g++ could not preprocess the kernel source:\n{result.stderr[-6000:]}")
    return _KERNEL_NAME.findall(result.stdout)


def translate_source(source: str, names: list[str]) -> str:
    """The C++ text g++ compiles: dynamic shared memory mapped, one export per kernel."""
    text = _DYNAMIC_SHARED.sub(
        lambda m: (
            f"{m[1]}* {m[2]} = reinterpret_cast<{m[1]}*>(::ringllm_emu::dynamic_shared_memory());"
        ),
        source,
    )
    exports = "".join(f"RINGLLM_EMU_EXPORT({name})\n" for name in names)
    return f"{text}\n// ---- emulator exports ----\n{exports}"


def compile_source(
    source: str, names: list[str], cache_dir: Path | None = None, defines: Sequence[str] = ()
) -> Path:
    """Builds (or finds in the cache) the shared library exporting kernels `names`.

    `defines` are extra -D macros, e.g. "RINGLLM_EMU_UCONTEXT" for the portable fibers.
    """
    cache_dir = cache_dir or default_cache_dir()
    text = translate_source(source, names)
    header = "".join(HEADER_PATH.with_name(name).read_text() for name in HEADER_FILES)
    flags = (*CXX_FLAGS, *(f"-D{d}" for d in defines))
    key = hashlib.sha256("\0".join([header, text, *flags]).encode()).hexdigest()[:24]
    library = cache_dir / f"{key}.so"
    if library.exists():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    cpp = cache_dir / f"{key}.{os.getpid()}.cpp"
    partial = cache_dir / f"{key}.{os.getpid()}.so.tmp"
    cpp.write_text(text)
    command = ["g++", *flags, "-include", str(HEADER_PATH), str(cpp), "-o", str(partial)]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise EmulatorError(
                f"g++ could not compile the kernel source:\n{result.stderr[-6000:]}"
            )
        partial.replace(library)  # atomic: a concurrent build of the same key is harmless
    finally:
        cpp.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return library


class EmulatedModule:
    """A compiled kernel source: the emulator's counterpart of `cupy.RawModule`."""

    def __init__(
        self,
        source: str,
        thread_order: str = "forward",
        cache_dir: Path | None = None,
        defines: Sequence[str] = (),
    ):
        if thread_order not in THREAD_ORDERS:
            raise ValueError(f"thread_order must be one of {THREAD_ORDERS}, got {thread_order!r}")
        self.thread_order = thread_order
        self.kernel_names = kernel_names(source)
        self._library = ctypes.CDLL(
            str(compile_source(source, self.kernel_names, cache_dir, defines))
        )

    def get_function(self, name: str) -> EmulatedKernel:
        if name not in self.kernel_names:
            raise KeyError(
                f'no extern "C" __global__ kernel {name!r}; this source defines {self.kernel_names}'
            )
        return EmulatedKernel(name, self._library, reverse=self.thread_order == "reverse")


class EmulatedKernel:
    """One kernel, launched like `cupy.RawKernel`: kernel(grid, block, args, shared_mem=0)."""

    def __init__(self, name: str, library: ctypes.CDLL, reverse: bool):
        self.name = name
        self.reverse = reverse
        self._launch = getattr(library, f"ringllm_emu_launch__{name}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [
            ctypes.POINTER(_LaunchConfig),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        signature = getattr(library, f"ringllm_emu_signature__{name}")
        signature.restype = ctypes.c_char_p
        self.param_types = [t for t in signature().decode().split(",") if t]

    def __call__(
        self,
        grid: Sequence[int],
        block: Sequence[int],
        args: Sequence[object],
        shared_mem: int = 0,
        stream: object = None,
    ) -> None:
        del stream  # one OS thread: every launch is synchronous
        config = _LaunchConfig(
            _dims("grid", grid), _dims("block", block), int(shared_mem), int(self.reverse)
        )
        values = self._marshal(args)
        pointers = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
        error = ctypes.create_string_buffer(_ERROR_BUFFER_BYTES)
        if self._launch(ctypes.byref(config), pointers, error, _ERROR_BUFFER_BYTES) != 0:
            raise EmulatorError(f"kernel {self.name}: {error.value.decode()}")

    def _marshal(self, args: Sequence[object]) -> list[ctypes._SimpleCData]:
        if len(args) != len(self.param_types):
            raise TypeError(
                f"kernel {self.name} takes {len(self.param_types)} arguments "
                f"({', '.join(self.param_types)}), got {len(args)}"
            )
        return [
            self._marshal_one(i, arg, t)
            for i, (arg, t) in enumerate(zip(args, self.param_types, strict=True))
        ]

    def _marshal_one(self, index: int, arg: object, param: str) -> ctypes._SimpleCData:
        where = f"kernel {self.name} argument {index} ({param})"
        if param.endswith("*"):
            if not isinstance(arg, torch.Tensor):
                raise TypeError(f"{where}: expected a torch tensor, got {type(arg).__name__}")
            if arg.device.type != "cpu":
                raise TypeError(
                    f"{where}: the emulator needs a CPU tensor, got one on {arg.device}"
                )
            pointee = param[:-1]
            if pointee != "void" and _TENSOR_TYPE_NAMES.get(arg.dtype) != pointee:
                raise TypeError(f"{where}: expected a {pointee} tensor, got {arg.dtype}")
            return ctypes.c_void_p(arg.data_ptr())
        if isinstance(arg, (bool, int, float)) and not isinstance(arg, np.generic):
            raise TypeError(
                f"{where}: got a Python {type(arg).__name__} ({arg!r}); pass np.{param}(...) "
                "-- CuPy would pass a Python number as an 8-byte int64/double and the kernel "
                "would misread it"
            )
        given = _SCALAR_TYPE_NAMES.get(type(arg))
        if given != param:
            raise TypeError(f"{where}: expected np.{param}, got {type(arg).__name__}")
        return _SCALAR_CTYPES[param](arg)


def _dims(what: str, dims: Sequence[int]) -> ctypes.Array:
    dims = tuple(int(d) for d in dims)
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {dims}")
    dims = dims + (1,) * (3 - len(dims))
    if any(d < 1 or d > 2**31 - 1 for d in dims):
        raise ValueError(f"{what} dimensions must be in 1..2**31-1, got {dims}")
    return (ctypes.c_uint32 * 3)(*dims)
