"""Matrix products of the models: `linear(x, weight, bias)` over the weight layouts below.

A matrix is prepared once, at load (`prepack`), into the fastest layout this CPU runs, and
every product then goes through `linear`:

    layout      weights                      product                       where
    ringllm16   bf16 / fp16, 16-col panels   the C kernels' own GEMM:      float32 compute of a
                (pipeline/ops/csrc/          16-bit weights widened in     16-bit checkpoint on
                simd_gemm.h)                 registers, float32 sums       AVX2 / AVX-512 CPUs
    onednn      compute dtype, oneDNN's      torch.ops.mkldnn              compute dtype taken by
                blocked layout               ._linear_pointwise            oneDNN here (below)
    plain       compute dtype                F.linear                      anything else

`RINGLLM_WEIGHT_LAYOUT=auto` (the default) picks as above; `onednn` never uses ringllm16
(float32 weights for a float32 run); `plain` keeps every matrix a plain tensor (F.linear),
the path that runs on every CPU and that tests hold the others to.

Why these (decode layers of the demo model, measured on a 2-core AMD EPYC, AVX-512 BF16,
torch 2.13): oneDNN's packed float32 product ran 1.5-2.8x faster than F.linear (MKL) at
4-64 rows, on AVX2 and AVX-512 alike; bf16 with AVX512_BF16 packed 0.8 -> 0.5 ms per layer.
Where the CPU has no bf16 arithmetic a bf16 checkpoint runs in float32 (pipeline/ops/
cpu_features.py); keeping its weights 16-bit then halves the bytes every step streams, and
ringllm's product matched oneDNN's float32 one at 64 rows and beat it at 1-16 (1.2-2.7x,
more for the 57 MB logits matrix) with AVX2. Widening bf16 or fp16 to float32 is exact, so
ringllm16 computes what float32 weights would, to the order of the sums.

oneDNN refuses bf16 / fp16 weights on a CPU without the instructions it needs (the AVX2
machines' start failure), so that layout is used only where cpu_features says it runs and
a one-time probe of the op on this machine agreed with F.linear.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ringllm.pipeline.ops.cpu_features import cpu_features

logger = logging.getLogger(__name__)

_BATCH_HINT = 64  # the decode batch oneDNN's blocked layout is tuned for (any batch works)
_WDTYPES = {torch.bfloat16: 1, torch.float16: 2}  # the C kernels' DT_* codes
_PANEL = 16  # output columns per panel of the ringllm16 layout
# Smaller matrices stay plain: a packed product has a fixed cost per call (oneDNN ~10 us,
# ringllm16 ~4 us, against F.linear's ~2 us) that a 256 x 256 matrix does not earn back at
# one row; from 576 x 576 up both packed layouts win at every row count measured.
MIN_PACKED_ELEMENTS = 1 << 17
ENV_LAYOUT = "RINGLLM_WEIGHT_LAYOUT"
POLICIES = ("auto", "onednn", "plain")


@functools.cache
def layout_policy() -> str:
    """RINGLLM_WEIGHT_LAYOUT, read once per process."""
    policy = os.environ.get(ENV_LAYOUT, "auto").strip().lower() or "auto"
    if policy not in POLICIES:
        raise ValueError(f"{ENV_LAYOUT}={policy!r}: not one of {', '.join(POLICIES)}")
    return policy


@dataclass(frozen=True)
class PackedWeight16:
    """A [n, k] bf16 / fp16 matrix in 16-column panels for the C kernels' product."""

    panels: torch.Tensor  # int16, ceil(n / 16) * 16 * k elements
    n: int
    k: int
    dtype: torch.dtype  # torch.bfloat16 or torch.float16
    kernel_set: int  # index of the C kernel set that multiplies it

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)


def weight_dtype(compute: torch.dtype, checkpoint: torch.dtype, device: str) -> torch.dtype:
    """The dtype a model keeps its matrices in: the checkpoint's 16-bit dtype when it
    computes in float32 on a CPU whose C kernels multiply 16-bit weights, else `compute`."""
    if (
        device == "cpu"
        and compute == torch.float32
        and checkpoint in _WDTYPES
        and _ringllm16_set() is not None
    ):
        return checkpoint
    return compute


def bf16_layout(kernel_set: str) -> str:
    """The layout name of bf16 weights held by quantized kernel set `kernel_set` (one of
    ops/quant.py BF16_SETS): 'amx-bf16' on the tile unit, 'avx512-bf16' on VDPBF16PS."""
    from ringllm.pipeline.ops.quant import TILE_SET

    return "amx-bf16" if kernel_set == TILE_SET else "avx512-bf16"


def layout(weight) -> str:
    """'ringllm16', 'onednn', 'plain', 'amx-bf16' (a bfloat16 checkpoint's matrices as the
    AMX tile unit's tiles: models/quant_weights.py BF16_TILES), 'avx512-bf16' (the same
    layout multiplied with VDPBF16PS, on a CPU with AVX512_BF16 and no tile unit) or (GGUF
    blocks, int8) 'quantized'."""
    if isinstance(weight, PackedWeight16):
        return "ringllm16"
    if getattr(weight, "qtype", None) == "bf16":
        return bf16_layout(weight.kernel_set)
    if not isinstance(weight, torch.Tensor):
        return "quantized"
    return "onednn" if weight.is_mkldnn else "plain"


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether oneDNN's blocked layout takes this weight here."""
    return (
        layout_policy() != "plain"
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and cpu_features().prepacks(weight.dtype)
        and _probe(weight.dtype)
    )


def prepack(
    weight,
    compute: torch.dtype | None = None,
    enabled: bool = True,
    quantization: str | None = None,
    device: torch.device | str = "cpu",
):
    """The weight in the fastest layout for products in `compute` (default: its own dtype);
    GGUF blocks and `quantization="int8"` go to the integer kernels of `device`
    (models/quant_weights.py)."""
    if not isinstance(weight, torch.Tensor) or quantization is not None:
        from ringllm.pipeline.models.quant_weights import pack_quantized

        packed = pack_quantized(weight, quantization, device)
        if packed is not None:
            return packed
    compute = compute or weight.dtype
    if weight.numel() < MIN_PACKED_ELEMENTS:
        return weight.to(compute)
    if weight.dtype != compute:
        if enabled and weight.dtype in _WDTYPES and compute == torch.float32:
            index = _ringllm16_set()
            if index is not None and weight.device.type == "cpu" and weight.dim() == 2:
                return _pack16(weight.contiguous(), index)
        weight = weight.to(compute)
    if not (enabled and can_prepack(weight)):
        return weight
    return pack_onednn(weight.contiguous())


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        if weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
        return F.linear(x, weight, bias)
    if isinstance(weight, PackedWeight16):
        return _linear16(x, weight, bias)
    return _quant_linear()(x, weight, bias)


@functools.cache
def _quant_linear():
    """models/quant_weights.py's product, imported on the first quantized weight (a dense
    model never loads the quantized kernels); cached, as a decode step calls it 100 times."""
    from ringllm.pipeline.models.quant_weights import quant_linear

    return quant_linear


# ---- ringllm16 -------------------------------------------------------------------------


@functools.cache
def _ringllm16_set() -> int | None:
    """The C kernel set that multiplies 16-bit weights here: the process's default set when
    it is a SIMD one (the portable set's product is too slow to choose), under the `auto`
    policy."""
    from ringllm.pipeline.ops import cpu_kernels
    from ringllm.pipeline.ops.cpu import default_kernel_set

    name = default_kernel_set()
    if layout_policy() != "auto" or name in (None, "generic"):
        return None
    return cpu_kernels.KERNEL_SETS.index(name)


def _pack16(weight: torch.Tensor, kernel_set: int) -> PackedWeight16:
    from ringllm.pipeline.ops import cpu_kernels

    n, k = weight.shape
    panels = torch.empty(-(-n // _PANEL) * _PANEL * k, dtype=torch.int16)
    bits = weight.view(torch.int16)
    cpu_kernels.pack_linear_weight(panels.data_ptr(), bits.data_ptr(), n, k, bits.stride(0))
    return PackedWeight16(panels, n, k, weight.dtype, kernel_set)


def _linear16(x: torch.Tensor, w: PackedWeight16, bias: torch.Tensor | None) -> torch.Tensor:
    from ringllm.pipeline.ops import cpu_kernels

    if x.dtype != torch.float32 or x.shape[-1] != w.k or x.device.type != "cpu":
        raise ValueError(
            f"linear: a {w.dtype} panel weight [{w.n}, {w.k}] multiplies float32 CPU rows of "
            f"{w.k}, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    rows = x.reshape(-1, w.k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None:
        if bias.shape != (w.n,) or bias.dtype != torch.float32:
            raise ValueError(
                f"linear: bias must be float32 [{w.n}], got {bias.dtype} {tuple(bias.shape)}"
            )
        bias = bias.contiguous()
    out = torch.empty(rows.shape[0], w.n, dtype=torch.float32)
    if rows.shape[0]:
        cpu_kernels.linear(
            w.kernel_set,
            torch.get_num_threads(),
            out.data_ptr(),
            rows.data_ptr(),
            w.panels.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            rows.shape[0],
            w.n,
            w.k,
            rows.stride(0),
            _WDTYPES[w.dtype],
        )
    return out.reshape(*x.shape[:-1], w.n)


# ---- oneDNN ----------------------------------------------------------------------------


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """A weight in oneDNN's packed layout (what `linear` multiplies by; sleep mode re-packs
    the dense copy it kept with it on wake)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)


@functools.cache
def _probe(dtype: torch.dtype) -> bool:
    """Packs and multiplies a small matrix once: True when the packed product runs here and
    agrees with F.linear (to the dtype's rounding), else the weights stay plain. A CPU that
    the feature checks misjudge then costs speed, never a failed start."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=gen).to(dtype)
    x = torch.randn(5, 32, generator=gen).to(dtype)
    try:
        got = linear(x, pack_onednn(w)).float()
    except RuntimeError as e:
        logger.warning(
            "oneDNN prepacking of %s weights unavailable here (%s): plain F.linear", dtype, e
        )
        return False
    want = F.linear(x.float(), w.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol * 4):
        logger.warning("oneDNN prepacked %s product disagrees with F.linear: plain F.linear", dtype)
        return False
    return True
