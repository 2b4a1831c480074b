"""Quantized matrices in a model: GGUF blocks kept as they are, and `--quantization int8`.

A matrix read from a GGUF in a block format arrives as `GGUFBlocks` (models/gguf_weights.py)
and is packed once, at load, into the integer kernels' layout (`QuantMatrix`,
pipeline/ops/quant.py); `linear` (models/linear.py) multiplies float32 rows by it. A
bfloat16 / float32 checkpoint's matrices become `QuantMatrix` "i8" (one scale per output
row) under `--quantization int8`.

The model fuses q | k | v and gate | up into one matrix each. Parts in one block format are
fused as blocks (rows of blocks concatenate); a GGUF may store the parts in different
formats (Q4_K_M keeps some v and down projections in Q6_K), and then the fused weight is
`RowParts`: neighbouring parts of one format joined as blocks (q | k beside a Q6_K v), each
part multiplied on its own and the outputs concatenated, in order.

The embedding of a GGUF stays in its blocks too (`BlockEmbedding`): a step dequantizes only
the rows of its tokens, through the portable kernels' packing and `dequantize` (bit for bit
gguf's own `dequantize`, their oracle, at a fifth of its time).

On a CUDA device the blocks are not repacked: they go to the device as the file holds them
(`DeviceBlocks`) and cuda/quant.py's kernels read them there (a dequantize-and-dot GEMV for
decode, dequantized tiles and cuBLAS above 8 rows). `--quantization int8` is CPU-only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ringllm.pipeline.models.gguf_weights import GGUFBlocks

QUANTIZATION_METHODS = ("int8",)
# Not a quantization a user asks for: how the loader holds a bfloat16 checkpoint's matrices
# where the AMX tile unit multiplies them (worker/model_loader.py): `QuantMatrix` "bf16",
# the tile unit's B tiles of the same values, multiplying float32 rows (each rounded to
# bfloat16 as the tile unit reads it) in the integer kernels' calls, so a step's layers run
# in one C call (models/decode_plan.py) as a GGUF's and int8's do.
BF16_TILES = "bf16-tiles"


@dataclass(frozen=True)
class RowParts:
    """A fused matrix whose row parts are held (and multiplied) separately."""

    parts: list  # a list, so sleep mode can take each part out and put it back

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])


def cat_rows(parts: list):
    """The parts as one matrix: torch.cat of tensors, blocks of one format joined, else
    RowParts (see the module docstring) of the parts with neighbours of one format joined
    (Q4_K_M's q | k in Q4_K beside a Q6_K v: two products a step, not three, and the
    activations quantized once for the two)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    joined = []
    for key, run in itertools.groupby(
        parts, lambda p: (p.qtype, p.k) if isinstance(p, GGUFBlocks) else id(p)
    ):
        run = list(run)
        if len(run) == 1:
            joined.append(run[0])
        else:  # one format: one copy of the run's rows
            blocks = torch.cat([p.blocks for p in run])
            joined.append(GGUFBlocks(key[0], blocks.shape[0], key[1], blocks))
    return joined[0] if len(joined) == 1 else RowParts(joined)


@dataclass  # not frozen: sleep mode takes `blocks` out and puts it back
class DeviceBlocks:
    """GGUF blocks [n, row bytes] on a CUDA device, as the file holds them."""

    qtype: str
    n: int
    k: int
    blocks: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)


def pack_quantized(weight, quantization: str | None, device: torch.device | str = "cpu"):
    """A weight as `linear` multiplies it on `device`: GGUF blocks packed for the CPU's
    integer kernels (or, on a CUDA device, moved there as they are), a dense matrix
    int8-quantized under `quantization="int8"`, RowParts part by part; any other weight as
    it came (returned None: the caller packs it its usual way)."""
    from ringllm.pipeline.ops import quant

    on_cpu = torch.device(device).type == "cpu"
    if isinstance(weight, RowParts):
        return RowParts([_pack_part(p, quantization, device) for p in weight.parts])
    if isinstance(weight, GGUFBlocks):
        if not on_cpu:
            return DeviceBlocks(weight.qtype, weight.n, weight.k, weight.blocks.to(device))
        return quant.pack_gguf(weight.qtype, weight.blocks, weight.n, weight.k)
    if quantization == "int8" and isinstance(weight, torch.Tensor):
        if not on_cpu:
            raise ValueError(
                f"quantization int8 runs on the CPU's integer kernels, not on {device}; "
                "on a GPU serve the checkpoint in its own dtype or a GGUF file"
            )
        return quant.pack_int8(weight)
    if quantization == BF16_TILES and isinstance(weight, torch.Tensor):
        if weight.dtype is torch.bfloat16 and on_cpu:  # float16 / float32 are never rounded
            return quant.pack_bf16(weight)
    return None


def bf16_tiles_here() -> bool:
    """Whether bfloat16 matrices go to the AMX tile unit's layout in this process: the tile
    unit is the quantized kernels' default set here and the weight layouts are the default
    ones (RINGLLM_WEIGHT_LAYOUT, RINGLLM_QUANT_KERNELS, RINGLLM_CPU_ISA rule it out)."""
    from ringllm.pipeline.models.linear import layout_policy
    from ringllm.pipeline.ops.quant import bf16_tiles_available

    return layout_policy() == "auto" and bf16_tiles_available()


def _pack_part(part, quantization: str | None, device):
    packed = pack_quantized(part, quantization, device)
    return part.to(device=device, dtype=torch.float32) if packed is None else packed


def is_quantized(weight) -> bool:
    from ringllm.pipeline.ops.quant import QuantMatrix

    return isinstance(weight, (QuantMatrix, RowParts, DeviceBlocks))


def quant_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] (any float dtype) times a quantized weight -> [..., n] in x's dtype."""
    from ringllm.pipeline.ops import quant

    if x.dim() == 2 and x.dtype is torch.float32 and type(weight) is quant.QuantMatrix:
        return quant.qlinear(x, weight, None if bias is None else bias.float())
    if isinstance(weight, DeviceBlocks):
        return _device_linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])  # qlinear takes float32 / bf16 rows with unit stride
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    if isinstance(weight, RowParts):
        out = torch.cat([_part_linear(rows, p) for p in weight.parts], dim=-1)
        if bias is not None:
            out += bias
    elif x.dtype is torch.bfloat16 and quant.writes_bf16(weight, rows.shape[0]):
        out = torch.empty(rows.shape[0], weight.n, dtype=torch.bfloat16)  # no float32 pass
        quant.qlinear(rows, weight, bias, out=out)
    else:
        out = quant.qlinear(rows, weight, bias)
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def _part_linear(rows: torch.Tensor, part) -> torch.Tensor:
    from ringllm.pipeline.ops import quant

    if isinstance(part, torch.Tensor):
        return torch.nn.functional.linear(rows.float(), part)
    if isinstance(part, DeviceBlocks):
        return _device_linear(rows, part, None).float()
    return quant.qlinear(rows, part)


def _device_linear(x: torch.Tensor, weight: DeviceBlocks, bias) -> torch.Tensor:
    from ringllm.pipeline.ops import quant

    out = quant.blocks_linear(x.contiguous(), weight.blocks, weight.qtype, weight.n, weight.k)
    return out if bias is None else out + bias.to(out.dtype)


class BlockEmbedding:
    """An embedding matrix kept in its GGUF block format; `lookup` dequantizes rows."""

    def __init__(self, blocks: GGUFBlocks, mapped: np.ndarray | None = None) -> None:
        """`mapped`: the same rows as a view of the file's mapping, used instead of the
        copy in `blocks` (which is then not kept)."""
        self.qtype, self.k = blocks.qtype, blocks.k
        self._rows = blocks.blocks.numpy() if mapped is None else mapped
        self.shape = blocks.shape

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (any shape) -> [*ids.shape, k] in `dtype`."""
        from ringllm.pipeline.ops import quant

        flat = ids.reshape(-1).cpu().numpy()
        out = quant.dequantize_gguf_rows(self.qtype, np.take(self._rows, flat, axis=0), self.k)
        return out.reshape(*ids.shape, self.k).to(device=ids.device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self._rows.nbytes
