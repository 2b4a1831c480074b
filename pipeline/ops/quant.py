"""Quantized matrix kernels on the CPU: GGUF block types and int8 weights as `QuantMatrix`.

A weight matrix W [n, k] stays quantized in memory, repacked once at load (`pack_gguf`,
`pack_int8`) into the layout of the kernel set that multiplies it (drawn in
pipeline/ops/csrc/quant/quant.h): rows interleaved in panels of 8 (generic, avx2) or 16
(avx512, avx512vnni) so one integer dot-product instruction yields one output per lane,
nibbles ordered so one AND or one shift gives a whole vector of weights, K-quants' packed
6-bit scales unpacked to bytes. The bytes per weight stay within 3% of GGUF's (q4_k
4.625 bits against 4.5, q5_k 5.625 against 5.5, the others equal).

Numerics of `qlinear` (y = x . W^T + bias): every type is read as groups of 32 weights
along k, w = D_g * u + M_g with u integers (q4_0: D=d, M=-8d; q4_1 / q5_1: D=d, M=m; q5_0:
M=-16d; q4_k / q5_k: D=d*sc, M=-dmin*mn; q6_k: groups of 16, D=d*sc, M=-32*d*sc; q8_0 and
i8: signed u, M=0). Each activation row is quantized per group of 32 (as Q8_0):
da = max|x| / 127, q = round-to-nearest-even(x / da), its integer sum sa kept; a group then
dots as da * (D_g * (u . q) + M_g * sa) with u . q exact in int32 (i8, whose D is one
scale per output row: sum_g da * (u . q), times D once after the last group). For the K-quants the
activations are quantized per super-block of 256 instead (as llama.cpp's Q8_K), so the
sub-blocks' integer scales and mins multiply exact int32 sums and a super-block ends in one
float step: da * (d * sum_s sc_s (u_s . q_s) - dmin * sum_s mn_s sa_s) (csrc/quant/quant_kq.h;
the tiled q4_k / q6_k product ran 1.25-1.3x faster for it on Zen 3). The one approximation
is |x - q * da| <= da / 2 per element, so |y - y_exact| <= sum_b (da_b / 2) *
sum_{j in b} |w_j| (b: the activation blocks, 32 or 256) plus float32 summation.

A row's result does not depend on the batch: each row is quantized alone and its groups
are summed in one order on both paths (GEMV for m <= 4, tiled above) and in any row tile.

`dequantize` is bit for bit gguf.quants.dequantize of the same blocks (same float32
operations in the same order, no fused multiply-add).

Kernel sets: 'generic' (plain C, any CPU), 'avx2' (AVX2 + FMA + F16C: maddubs + madd),
'avx512' (F/BW/VL/DQ, the same on zmm), 'avx512vnni' (vpdpbusd), 'avx512bf16' (the VNNI set,
and bf16 weights on VDPBF16PS) and 'avx512amx' (the VNNI set, and int8 and bf16 weights on
the AMX tile unit); the fastest this CPU runs is the default, RINGLLM_QUANT_KERNELS=name picks one. Everything the C code indexes
is checked here first: it trusts its pointers and sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import gguf
import numpy as np
import torch

# After torch: the extension's libgomp.so.1 then resolves to the copy torch loaded.
from ringllm.pipeline.ops import quant_kernels as _q

QUANT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "i8", "bf16")
TILE_SET = "avx512amx"  # the set that multiplies on the AMX tile unit
# the sets that multiply "bf16" weights: the tile unit's, and VDPBF16PS's on a CPU with
# AVX512_BF16 but no tile unit (AMD Zen 4 / 5); the same layout (quant_bf16.h)
BF16_SETS = ("avx512bf16", TILE_SET)
_T = gguf.GGMLQuantizationType
GGML_TYPES = {
    _T.Q4_0: "q4_0",
    _T.Q4_1: "q4_1",
    _T.Q5_0: "q5_0",
    _T.Q5_1: "q5_1",
    _T.Q8_0: "q8_0",
    _T.Q4_K: "q4_k",
    _T.Q5_K: "q5_k",
    _T.Q6_K: "q6_k",
}
ENV_KERNELS = "RINGLLM_QUANT_KERNELS"
_XTYPES = {torch.float32: 0, torch.bfloat16: 1}
assert _q.QTYPES == QUANT_TYPES, "quant_kernels and quant.py disagree on the type order"


@dataclass(frozen=True)
class QuantMatrix:
    """A quantized [n, k] weight in the layout of `kernel_set` (its bytes in `data`)."""

    qtype: str
    n: int  # output rows
    k: int  # input columns
    data: torch.Tensor  # uint8, the packed panels (one allocation)
    kernel_set: str  # the set whose layout it is in
    # checked once here, so a product (every step, every layer) checks only its x
    _indices: tuple[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_indices", _check_matrix(self))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def kernel_sets() -> tuple[str, ...]:
    """The kernel sets this CPU runs, slowest first."""
    return tuple(name for name, ok in zip(_q.KERNEL_SETS, _q.SUPPORTED, strict=True) if ok)


def default_kernel_set() -> str:
    """RINGLLM_QUANT_KERNELS if set (it must be a set this CPU runs), else the fastest one
    within the ISA level ringllm uses (cpu_features: RINGLLM_CPU_ISA caps it, as it caps
    the other kernels: an emulated AVX2 machine runs the avx2 set)."""
    wanted = os.environ.get(ENV_KERNELS, "").strip().lower()
    if wanted:
        return _check_set(wanted, ENV_KERNELS)
    from ringllm.pipeline.ops.cpu_features import cpu_features

    allowed = _SETS_OF_LEVEL[cpu_features().isa]
    return [name for name in kernel_sets() if name in allowed][-1]


# The quantized sets each ISA level of cpu_features may use (VNNI comes with AVX-512 here;
# a CPU without it runs "avx512").
_SETS_OF_LEVEL = {
    "generic": ("generic",),
    "avx2": ("generic", "avx2"),
    "avx512": ("generic", "avx2", "avx512", "avx512vnni"),
    "avx512bf16": ("generic", "avx2", "avx512", "avx512vnni", "avx512bf16", "avx512amx"),
}


def _check_set(name: str, what: str = "kernel_set") -> str:
    if name not in kernel_sets():
        raise ValueError(f"{what}={name!r}: this CPU runs {', '.join(kernel_sets())}")
    return name


def _set_index(name: str | None) -> int:
    return _q.KERNEL_SETS.index(default_kernel_set() if name is None else _check_set(name))


def _qtype_index(qtype: str) -> int:
    if qtype not in QUANT_TYPES:
        raise ValueError(f"qtype {qtype!r}: the quantized kernels take {', '.join(QUANT_TYPES)}")
    return QUANT_TYPES.index(qtype)


def _threads(threads: int | None) -> int:
    threads = torch.get_num_threads() if threads is None else threads
    if not 1 <= threads <= 4096:
        raise ValueError(f"threads must be 1..4096, got {threads}")
    return threads


def _empty_packed(qt: int, n: int, k: int, set_index: int) -> torch.Tensor:
    return torch.empty(_q.packed_bytes(qt, n, k, _q.ROWS_PER_PANEL[set_index]), dtype=torch.uint8)


def _as_uint8_rows(blocks, n: int, row_bytes: int, qtype: str) -> torch.Tensor:
    if isinstance(blocks, np.ndarray):
        blocks = torch.from_numpy(np.ascontiguousarray(blocks))
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
        raise ValueError(f"{qtype} blocks: want a uint8 numpy array or tensor, got {blocks!r:.80}")
    if blocks.device.type != "cpu":
        raise ValueError(f"{qtype} blocks: want a CPU tensor, got one on {blocks.device}")
    if tuple(blocks.shape) != (n, row_bytes):
        raise ValueError(
            f"{qtype} blocks: want shape ({n}, {row_bytes}) (n rows of k / block size blocks), "
            f"got {tuple(blocks.shape)}"
        )
    return blocks.contiguous()


def pack_gguf(qtype: str, blocks, n: int, k: int, kernel_set: str | None = None) -> QuantMatrix:
    """GGUF's native blocks [n, row_bytes] (uint8) of a [n, k] matrix into `kernel_set`'s
    layout; k must be a multiple of the type's block (32, or 256 for the K-quants)."""
    index = _set_index(kernel_set)
    dst = _pack_blocks(qtype, blocks, n, k, index, _threads(None))
    return QuantMatrix(qtype, n, k, dst, _q.KERNEL_SETS[index])


def _pack_blocks(qtype: str, blocks, n: int, k: int, index: int, threads: int) -> torch.Tensor:
    """pack_gguf's packed bytes in set `index`'s layout, `blocks` checked first."""
    qt = _qtype_index(qtype)
    if qtype in ("i8", "bf16"):
        raise ValueError(f"qtype {qtype!r} is not a GGUF block type: use pack_int8 / pack_bf16")
    block_k = _q.BLOCK_K[qt]
    if n < 1 or k < 1 or k % block_k:
        raise ValueError(
            f"{qtype} matrix [{n}, {k}]: n must be >= 1 and k a positive multiple of "
            f"{block_k} (the type's block); cut column shards at block boundaries"
        )
    src = _as_uint8_rows(blocks, n, k // block_k * _q.GGUF_BLOCK_BYTES[qt], qtype)
    dst = _empty_packed(qt, n, k, index)
    _q.pack(index, threads, qt, dst.data_ptr(), src.data_ptr(), 0, n, k)
    return dst


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: scale = max|w_row| / 127, q = round(w / scale) (float32)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _dense_shape(fn: str, weight: torch.Tensor, dtypes: tuple) -> tuple[int, int]:
    """(n, k) of a non-empty 2-D weight in one of `dtypes`, else a clear error."""
    if weight.dtype not in dtypes or weight.dim() != 2:
        names = " / ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"{fn}: want a 2-D {names} weight, got {weight.dtype} of shape {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if n < 1 or k < 1:
        raise ValueError(f"{fn}: empty weight of shape {tuple(weight.shape)}")
    return n, k


def pack_int8(weight: torch.Tensor, kernel_set: str | None = None) -> QuantMatrix:
    """A [n, k] float32 / bfloat16 / float16 weight as qtype 'i8' (see `quantize_int8`)."""
    n, k = _dense_shape("pack_int8", weight, (torch.float32, torch.bfloat16, torch.float16))
    q, scale = quantize_int8(weight.cpu())
    q, scale = q.contiguous(), scale.contiguous()
    qt, index = QUANT_TYPES.index("i8"), _set_index(kernel_set)
    dst = _empty_packed(qt, n, k, index)
    _q.pack(index, _threads(None), qt, dst.data_ptr(), q.data_ptr(), scale.data_ptr(), n, k)
    return QuantMatrix("i8", n, k, dst, _q.KERNEL_SETS[index])


def bf16_tiles_available() -> bool:
    """Whether this process multiplies bf16 weights in its own kernels (`pack_bf16`): on the
    AMX tile unit (the CPU has it and the OS gave this process its state), or with
    VDPBF16PS on a CPU with AVX512_BF16 and no tile unit; the default set is then one of
    BF16_SETS (RINGLLM_QUANT_KERNELS and RINGLLM_CPU_ISA can rule it out)."""
    return default_kernel_set() in BF16_SETS


def pack_bf16(weight: torch.Tensor, kernel_set: str | None = None) -> QuantMatrix:
    """A [n, k] bfloat16 weight as qtype 'bf16': the AMX tile unit's B tiles, its values as
    they are. `qlinear` then rounds each activation to bfloat16 and sums in float32, on the
    tile unit (quant_avx512amx.c) or with VDPBF16PS (quant_avx512bf16.c), at any number of
    rows; the BF16_SETS' only."""
    if weight.device.type != "cpu":
        raise ValueError(f"pack_bf16: want a CPU weight, got one on {weight.device}")
    n, k = _dense_shape("pack_bf16", weight, (torch.bfloat16,))
    index = _set_index(kernel_set)
    if _q.KERNEL_SETS[index] not in BF16_SETS:
        raise ValueError(
            f"pack_bf16: bf16 weights are the {' and '.join(BF16_SETS)} sets', "
            f"not {_q.KERNEL_SETS[index]}'s"
        )
    src = weight.contiguous()
    qt = QUANT_TYPES.index("bf16")
    dst = _empty_packed(qt, n, k, index)
    _q.pack(index, _threads(None), qt, dst.data_ptr(), src.data_ptr(), 0, n, k)
    return QuantMatrix("bf16", n, k, dst, _q.KERNEL_SETS[index])


def _check_matrix(qm: QuantMatrix) -> tuple[int, int]:
    qt, index = _qtype_index(qm.qtype), _set_index(qm.kernel_set)
    want = _q.packed_bytes(qt, qm.n, qm.k, _q.ROWS_PER_PANEL[index])
    data = qm.data
    if data.dtype != torch.uint8 or not data.is_contiguous() or data.numel() != want:
        raise ValueError(
            f"QuantMatrix {qm.qtype} [{qm.n}, {qm.k}] ({qm.kernel_set}): want {want} contiguous "
            f"uint8 bytes, got {data.numel()} {data.dtype}"
        )
    return qt, index


def dequantize(qm: QuantMatrix) -> torch.Tensor:
    """float32 [n, k]; for GGUF types bit for bit gguf.quants.dequantize of the blocks."""
    qt, index = qm._indices
    out = torch.empty(qm.n, qm.k, dtype=torch.float32)
    _q.dequantize(index, _threads(None), qt, out.data_ptr(), qm.data.data_ptr(), qm.n, qm.k)
    return out


# Rows looked up at a time on one thread (an embedding's decode step: one or a few
# tokens); more rows take the thread pool.
_ONE_THREAD_ROWS = 16


def dequantize_gguf_rows(qtype: str, blocks: np.ndarray, k: int) -> torch.Tensor:
    """float32 [m, k] of GGUF blocks [m, row_bytes] (uint8, rows of one [*, k] matrix, e.g.
    an embedding's looked-up rows), bit for bit gguf.quants.dequantize: packed into the
    portable set's layout and dequantized by the kernels `dequantize` checks against gguf.
    A token's Q4_K row of 2,048 took 8 us against gguf's 41 (Zen 5, warm): pack_gguf and
    dequantize would take 14, on the thread pool and through a QuantMatrix's checks."""
    m = blocks.shape[0]
    out = torch.empty(m, k, dtype=torch.float32)
    if m == 0:
        return out
    generic, threads = 0, 1 if m <= _ONE_THREAD_ROWS else _threads(None)
    packed = _pack_blocks(qtype, blocks, m, k, generic, threads)
    _q.dequantize(generic, threads, _qtype_index(qtype), out.data_ptr(), packed.data_ptr(), m, k)
    return out


def writes_bf16(qm: QuantMatrix, m: int) -> bool:
    """Whether `qlinear` of m rows can write a bfloat16 `out` (bf16 weights, and on the AMX
    set's tile unit int8 ones from AMX_MIN_ROWS rows on); elsewhere out is float32."""
    if qm.qtype == "bf16":
        return qm.kernel_set in BF16_SETS
    return qm.kernel_set == TILE_SET and qm.qtype == "i8" and m >= _q.AMX_MIN_ROWS


def qlinear(
    x: torch.Tensor,
    qm: QuantMatrix,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """x [m, k] float32 (bfloat16 accepted, widened) . W^T (+ bias [n]) -> float32 [m, n]
    (`out` bfloat16 where `writes_bf16`: the float32 result rounded to nearest even)."""
    qt, index = qm._indices
    if (
        bias is None
        and out is None
        and threads is None
        and x.dtype is torch.float32
        and x.is_cpu
        and x.dim() == 2
        and x.is_contiguous()
        and x.shape[1] == qm.k
    ):
        # the decode step's case, a hundred calls a token: its checks in one test (a
        # contiguous x's rows are k apart; a single row's stride is never read)
        m = x.shape[0]
        out = torch.empty(m, qm.n, dtype=torch.float32)
        if m:
            threads = torch.get_num_threads()
            xtype, data = _XTYPES[torch.float32], qm.data.data_ptr()
            _q.qlinear(
                index,
                threads,
                qt,
                out.data_ptr(),
                x.data_ptr(),
                xtype,
                qm.k,
                data,
                0,
                m,
                qm.n,
                qm.k,
            )
        return out
    xtype = _XTYPES.get(x.dtype)
    if xtype is None or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(
            f"qlinear: x must be a 2-D float32 / bfloat16 CPU tensor, got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    m, k = x.shape
    if k != qm.k:
        raise ValueError(f"qlinear: x has {k} columns, the {qm.qtype} weight takes {qm.k}")
    if m and (x.stride(1) != 1 or x.stride(0) < k):
        raise ValueError(
            f"qlinear: x rows must be contiguous (strides {x.stride()}); pass x.contiguous()"
        )
    if bias is not None and (
        bias.dtype != torch.float32 or tuple(bias.shape) != (qm.n,) or not bias.is_contiguous()
    ):
        raise ValueError(
            f"qlinear: bias must be contiguous float32 [{qm.n}], got {bias.dtype} "
            f"{tuple(bias.shape)}"
        )
    if out is None:
        out = torch.empty(m, qm.n, dtype=torch.float32)
    elif (
        out.dtype not in (torch.float32, torch.bfloat16)
        or (out.dtype is torch.bfloat16 and not writes_bf16(qm, m))
        or tuple(out.shape) != (m, qm.n)
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"qlinear: out must be contiguous float32 [{m}, {qm.n}] (bfloat16 where "
            f"writes_bf16), got {out.dtype} {tuple(out.shape)}"
        )
    if m == 0:
        return out
    _q.qlinear(
        index,
        torch.get_num_threads() if threads is None else _threads(threads),
        qt,
        out.data_ptr(),
        x.data_ptr(),
        xtype,
        x.stride(0),
        qm.data.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        m,
        qm.n,
        k,
        _XTYPES[out.dtype],
    )
    return out


def blocks_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str, n: int, k: int):
    """x [..., k] times [n, k] GGUF blocks as the file holds them (uint8 [n, row bytes]),
    on cuda/quant.py's kernels: CuPy for CUDA tensors (the model on a GPU), the emulator
    for CPU ones. [..., n] in x's dtype."""
    from ringllm.cuda import quant as cuda_quant

    return cuda_quant.quant_linear(x, blocks, qtype, n, k)
