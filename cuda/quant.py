"""GGUF block-quantized matrices on the CUDA kernels of `quant_matmul.cu`.

A quantized [n, k] weight is its GGUF block bytes as they come from the file: a uint8
tensor [n, row_bytes] with row_bytes = k / block_elems * block_bytes, each row's bytes
contiguous. A row shard is a slice of rows; a block-aligned column shard is a column
slice of the bytes (a view whose row stride is the full row's bytes): both go to the
kernels as they are, without a copy.

    ops = CudaQuantOps()                      # "cupy": CUDA tensors, torch's stream
    ops = CudaQuantOps(backend="emulator")    # CPU tensors, the same .cu through g++
    ops.quant_gemv(x, blocks, "Q4_K", n, k)   # decode: x [m <= 8, k] -> [m, n]
    ops.dequantize(blocks, "Q4_K", n, k, torch.bfloat16)      # -> [n, k]
    ops.quant_linear(x, blocks, "Q4_K", n, k) # GEMV for m <= 8, else tiles + matmul

Numerics: `dequantize` in float32 is bit-exact against `gguf.quants.dequantize`; in
16 bits it is that value rounded once. `quant_gemv` dots those float32 weights with the
activations in float32 and rounds once to x's dtype. `quant_linear` above 8 rows
dequantizes row tiles to x's dtype and multiplies them with torch.matmul (cuBLAS on the
GPU), so prefill sees the numerics of a dense model with the dequantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from ringllm.cuda.emulator import EmulatedModule
from ringllm.cuda.loader import BACKENDS, SOURCE_DIR, Kernel, cuda_include_options, paste_common

FAMILY = "quant_matmul"
MAX_GEMV_ROWS = 8  # kMaxGemvRows in quant_matmul.cu: the GEMV keeps one sum per row in registers
GEMV_WARPS_PER_BLOCK = 4
DEQUANTIZE_THREADS = 256
CHUNK_ELEMS = 8  # weights one thread decodes at once (kChunkElems)
# quant_linear's prefill path dequantizes at most this many bytes of weight per tile.
DEFAULT_TILE_BYTES = 64 * 1024 * 1024
_DTYPE_SUFFIXES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block type: `block_elems` weights stored in `block_bytes` bytes."""

    name: str
    block_elems: int
    block_bytes: int

    def row_bytes(self, k: int) -> int:
        return k // self.block_elems * self.block_bytes


BLOCK_FORMATS = {
    f.name: f
    for f in (
        BlockFormat("Q4_0", 32, 18),
        BlockFormat("Q4_1", 32, 20),
        BlockFormat("Q5_0", 32, 22),
        BlockFormat("Q5_1", 32, 24),
        BlockFormat("Q8_0", 32, 34),
        BlockFormat("Q4_K", 256, 144),
        BlockFormat("Q5_K", 256, 176),
        BlockFormat("Q6_K", 256, 210),
    )
}


def block_format(qtype: str | Enum) -> BlockFormat:
    """The format of a type given by name ("Q4_K") or as gguf's GGMLQuantizationType."""
    name = qtype.name if isinstance(qtype, Enum) else str(qtype)
    if name.upper() not in BLOCK_FORMATS:
        raise ValueError(
            f"quantized type {name!r} has no CUDA kernel; supported: {', '.join(BLOCK_FORMATS)}"
        )
    return BLOCK_FORMATS[name.upper()]


def _suffix(dtype: torch.dtype, what: str) -> str:
    if dtype not in _DTYPE_SUFFIXES:
        raise ValueError(f"{what} must be float32, float16 or bfloat16, got {dtype}")
    return _DTYPE_SUFFIXES[dtype]


def check_blocks(blocks: torch.Tensor, fmt: BlockFormat, n: int, k: int) -> None:
    """Refuses a block tensor that is not [n, k / block_elems * block_bytes] uint8 bytes."""
    if n < 0 or k < 0 or k % fmt.block_elems:
        raise ValueError(
            f"{fmt.name} weight [n={n}, k={k}]: k must be a multiple of its "
            f"{fmt.block_elems}-element block (a column shard must cut between blocks)"
        )
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(
            f"{fmt.name} blocks must be a 2-D uint8 tensor of block bytes, "
            f"got {blocks.dtype} with shape {tuple(blocks.shape)}"
        )
    expected = (n, fmt.row_bytes(k))
    if tuple(blocks.shape) != expected:
        raise ValueError(
            f"{fmt.name} blocks for an [{n}, {k}] weight must have shape {expected} "
            f"({k // fmt.block_elems} blocks of {fmt.block_bytes} bytes per row), "
            f"got {tuple(blocks.shape)}"
        )
    gapped = n > 1 and blocks.stride(0) < expected[1]
    if (expected[1] > 1 and blocks.stride(1) != 1) or gapped:
        raise ValueError(
            f"{fmt.name} blocks must hold each row's bytes contiguously, got strides "
            f"{blocks.stride()}; pass .contiguous() (or a row / block-aligned column slice)"
        )


def _row_stride(t: torch.Tensor) -> np.int64:
    return np.int64(t.stride(0) if t.shape[0] > 1 else t.shape[1])


class CudaQuantOps:
    """Launches the quantized-matrix kernels on CuPy or the CPU emulator."""

    def __init__(self, backend: str = "cupy", thread_order: str = "forward"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.thread_order = thread_order
        self._module: object | None = None
        self._kernels: dict[str, Kernel] = {}

    def kernel(self, name: str) -> Kernel:
        if name not in self._kernels:
            self._kernels[name] = Kernel(name, self._compiled().get_function(name), self.backend)
        return self._kernels[name]

    def _compiled(self) -> object:
        # NOTE: loaded here rather than through KernelLoader because loader.KERNEL_FAMILIES
        # does not list this family yet; the build is the same (common.cuh pasted in).
        if self._module is None:
            source = paste_common((SOURCE_DIR / f"{FAMILY}.cu").read_text())
            if self.backend == "emulator":
                self._module = EmulatedModule(source, self.thread_order)
            else:
                import cupy

                options = ("--std=c++17", *cuda_include_options())
                self._module = cupy.RawModule(code=source, options=options)
        return self._module

    # ---- decode: dequantize-and-dot ----

    def quant_gemv(
        self,
        x: torch.Tensor,
        blocks: torch.Tensor,
        qtype: str | Enum,
        n: int,
        k: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [m, k] (m <= 8) times the [n, k] quantized weight transposed: [m, n] in x's dtype."""
        fmt = block_format(qtype)
        check_blocks(blocks, fmt, n, k)
        suffix = _suffix(x.dtype, "x")
        if x.dim() != 2 or x.shape[1] != k or x.shape[0] > MAX_GEMV_ROWS:
            raise ValueError(
                f"quant_gemv takes x [m, k={k}] with m <= {MAX_GEMV_ROWS} rows, got "
                f"{tuple(x.shape)}; use quant_linear for more rows"
            )
        if x.device != blocks.device:
            raise ValueError(f"x is on {x.device} but the blocks are on {blocks.device}")
        m = x.shape[0]
        out = self._gemv_out(out, x, m, n)
        if m == 0 or n == 0:
            return out
        if k == 0:
            return out.zero_()
        grid = (-(-n // GEMV_WARPS_PER_BLOCK),)
        block = (32 * GEMV_WARPS_PER_BLOCK,)
        args = (out, _row_stride(out), x.contiguous(), blocks, _row_stride(blocks))
        self.kernel(f"quant_gemv_{fmt.name.lower()}_{suffix}")(
            grid, block, (*args, np.int32(m), np.int32(n), np.int32(k))
        )
        return out

    @staticmethod
    def _gemv_out(out: torch.Tensor | None, x: torch.Tensor, m: int, n: int) -> torch.Tensor:
        if out is None:
            return torch.empty(m, n, dtype=x.dtype, device=x.device)
        if out.device != x.device:
            raise ValueError(f"out is on {out.device} but x is on {x.device}")
        if tuple(out.shape) != (m, n) or out.dtype != x.dtype or (n > 1 and out.stride(1) != 1):
            raise ValueError(
                f"out must be [{m}, {n}] {x.dtype} with contiguous rows, got "
                f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
            )
        return out

    # ---- prefill: dequantize, then a dense GEMM ----

    def dequantize(
        self,
        blocks: torch.Tensor,
        qtype: str | Enum,
        n: int,
        k: int,
        dtype: torch.dtype = torch.float32,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The [n, k] weight in `dtype`; `out` may be a row-contiguous view (a tile)."""
        fmt = block_format(qtype)
        check_blocks(blocks, fmt, n, k)
        suffix = _suffix(dtype, "dtype")
        if out is None:
            out = torch.empty(n, k, dtype=dtype, device=blocks.device)
        elif out.device != blocks.device:
            raise ValueError(f"out is on {out.device} but the blocks are on {blocks.device}")
        elif tuple(out.shape) != (n, k) or out.dtype != dtype or (k > 1 and out.stride(1) != 1):
            raise ValueError(
                f"out must be [{n}, {k}] {dtype} with contiguous rows, got "
                f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
            )
        num_chunks = n * (k // CHUNK_ELEMS)
        if num_chunks == 0:
            return out
        grid = (-(-num_chunks // DEQUANTIZE_THREADS),)
        self.kernel(f"dequantize_{fmt.name.lower()}_{suffix}")(
            grid,
            (DEQUANTIZE_THREADS,),
            (out, _row_stride(out), blocks, _row_stride(blocks), np.int32(n), np.int32(k)),
        )
        return out

    def quant_linear(
        self,
        x: torch.Tensor,
        blocks: torch.Tensor,
        qtype: str | Enum,
        n: int,
        k: int,
        tile_bytes: int = DEFAULT_TILE_BYTES,
    ) -> torch.Tensor:
        """x [..., k] times the [n, k] quantized weight transposed: [..., n] in x's dtype.

        Up to 8 rows run the GEMV (weights read once, never written out); more rows
        dequantize row tiles of at most `tile_bytes` into x's dtype and matmul them.
        """
        if x.shape[-1] != k:
            raise ValueError(f"x's last dimension must be k={k}, got shape {tuple(x.shape)}")
        rows = x.reshape(-1, k)
        if rows.shape[0] <= MAX_GEMV_ROWS:
            return self.quant_gemv(rows, blocks, qtype, n, k).view(*x.shape[:-1], n)
        fmt = block_format(qtype)
        check_blocks(blocks, fmt, n, k)
        out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
        tile_rows = max(1, tile_bytes // max(1, k * x.element_size()))
        tile = torch.empty(min(tile_rows, n), k, dtype=x.dtype, device=x.device)
        for first in range(0, n, tile_rows):
            last = min(n, first + tile_rows)
            weight = self.dequantize(
                blocks[first:last], fmt.name, last - first, k, x.dtype, out=tile[: last - first]
            )
            out[:, first:last] = torch.matmul(rows, weight.t())
        return out.view(*x.shape[:-1], n)


_DEFAULT_OPS: dict[str, CudaQuantOps] = {}


def _ops_for(t: torch.Tensor) -> CudaQuantOps:
    """CuPy for CUDA tensors, the emulator for CPU ones; one compiled module per backend."""
    backend = "cupy" if t.device.type == "cuda" else "emulator"
    if backend not in _DEFAULT_OPS:
        _DEFAULT_OPS[backend] = CudaQuantOps(backend)
    return _DEFAULT_OPS[backend]


def quant_gemv(x, blocks, qtype, n, k, out=None) -> torch.Tensor:
    """`CudaQuantOps.quant_gemv` on the backend of x's device."""
    return _ops_for(x).quant_gemv(x, blocks, qtype, n, k, out)


def dequantize(blocks, qtype, n, k, dtype=torch.float32) -> torch.Tensor:
    """`CudaQuantOps.dequantize` on the backend of the blocks' device."""
    return _ops_for(blocks).dequantize(blocks, qtype, n, k, dtype)


def quant_linear(x, blocks, qtype, n, k) -> torch.Tensor:
    """`CudaQuantOps.quant_linear` on the backend of x's device."""
    return _ops_for(x).quant_linear(x, blocks, qtype, n, k)
