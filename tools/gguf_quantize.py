"""Float matrices -> GGUF block bytes, in every block format ringllm runs.

The `gguf` package quantizes F16 / BF16 and the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0) but only decodes the K-quants; this module encodes Q4_K, Q5_K and Q6_K with numpy, in
the byte layout `gguf.quants.dequantize` (and llama.cpp) decodes. It makes test files and
benchmark files, not the best possible quantization: each sub-block gets a small grid search
plus a least-squares refit, which lands within a few percent of llama.cpp's own error.

A K-quant super-block covers 256 consecutive values of one row:

    Q4_K  144 bytes   d f16 | dmin f16 | scales 12 | qs 128         x = d*sc[s]*q - dmin*m[s]
    Q5_K  176 bytes   d f16 | dmin f16 | scales 12 | qh 32 | qs 128 (q 0..15 / 0..31,
                                                                      8 sub-blocks of 32)
    Q6_K  210 bytes   ql 128 | qh 64 | scales 16 (int8) | d f16     x = d*sc[s]*(q - 32)
                                                                      (16 sub-blocks of 16)

Q4_K / Q5_K's 12 scale bytes hold eight 6-bit scales sc[0..7] and eight 6-bit mins m[0..7]:

    byte j     (j < 4)  sc[j]   | (sc[j+4] >> 4) << 6
    byte 4+j            m[j]    | (m[j+4]  >> 4) << 6
    byte 8+j            sc[j+4] & 15 | (m[j+4] & 15) << 4

Nibbles: Q4_K / Q5_K byte i of qs[32c : 32c+32] holds value i of sub-block 2c (low) and of
sub-block 2c+1 (high); Q5_K's bit 4 of value i of sub-block s is bit s of qh[i]. Q6_K's value
e (h = e // 128, r = e % 128) keeps its low nibble in ql[64h + r % 64] (high nibble when
r >= 64) and its top two bits in qh[32h + r % 32] at bit 2 * (r // 32).

Invariant: `quantize(x, t)` returns uint8 [rows, cols / block * block_bytes] that
`gguf.quants.dequantize(_, t)` turns back into an array of x's shape.
"""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
QK_K = 256
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
# What gguf.quants encodes itself (F32 is the array as it is).
GGUF_ENCODED = (T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# The grid of scale candidates tried per sub-block (offsets to the number of levels).
_SEARCH_STEPS = np.linspace(-1.0, 1.0, 17)
_CHUNK_BLOCKS = 16384  # super-blocks encoded at once


def block_size(qtype: T) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def quantize(array: np.ndarray, qtype: T) -> np.ndarray:
    """`array` [rows, cols] (float) in block format `qtype`: uint8 [rows, row_bytes], or the
    dense array itself for F32 / F16 / BF16 (BF16 as uint16 bit patterns)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == T.F32:
        return array
    if qtype in GGUF_ENCODED:
        return gguf.quants.quantize(array, qtype)
    if qtype not in K_QUANTS:
        raise ValueError(f"qtype: {qtype.name} is not a format ringllm encodes")
    cols = array.shape[-1]
    if cols % QK_K:
        raise ValueError(
            f"a {qtype.name} row is whole {QK_K}-value super-blocks; this matrix has {cols} "
            "columns: use Q8_0 (or another 32-value format) for it"
        )
    super_blocks = array.reshape(-1, QK_K)
    encode = {T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}[qtype]
    # in chunks: the search's float64 temporaries stay ~100 MB whatever the matrix
    blocks = np.concatenate(
        [
            encode(super_blocks[start : start + _CHUNK_BLOCKS].astype(np.float64))
            for start in range(0, len(super_blocks), _CHUNK_BLOCKS)
        ]
    )
    return blocks.reshape(*array.shape[:-1], cols // QK_K * blocks.shape[-1])


# ---- per-sub-block fits -------------------------------------------------------------------


def _affine_fit(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """x [..., n] ~ scale * q - offset, q in 0..nmax, scale >= 0, offset >= 0 (the formats
    store a non-negative min): the best of a grid of ranges, each refit by least squares."""
    lo = np.minimum(x.min(-1), 0.0)
    hi = x.max(-1)
    span = np.maximum(hi - lo, 1e-30)
    n = x.shape[-1]
    best_err = np.full(lo.shape, np.inf)
    best_scale, best_offset = span / nmax, -lo
    for step in _SEARCH_STEPS:
        q = np.clip(np.rint((x - lo[..., None]) * ((nmax + step) / span)[..., None]), 0, nmax)
        sq, sx = q.sum(-1), x.sum(-1)
        sqq, sxq = (q * q).sum(-1), (x * q).sum(-1)
        det = n * sqq - sq * sq
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(det > 0, (n * sxq - sx * sq) / det, 0.0)
            bias = (sx - scale * sq) / n
            # a positive bias cannot be stored (mins are subtracted): refit through zero
            through_zero = np.where(sqq > 0, sxq / sqq, 0.0)
        scale = np.where(bias > 0, through_zero, scale)
        bias = np.minimum(bias, 0.0)
        err = ((scale[..., None] * q + bias[..., None] - x) ** 2).sum(-1)
        better = (err < best_err) & (scale >= 0)
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
        best_offset = np.where(better, -bias, best_offset)
    return best_scale, best_offset


def _symmetric_fit(x: np.ndarray, nneg: int) -> np.ndarray:
    """x [..., n] ~ scale * q, q in -nneg..nneg-1: the signed extreme maps near -nneg (the
    level the range has one more of), the best of a grid, each refit by least squares."""
    idx = np.abs(x).argmax(-1)
    extreme = np.take_along_axis(x, idx[..., None], -1)[..., 0]
    extreme = np.where(extreme == 0, 1e-30, extreme)
    best_err = np.full(extreme.shape, np.inf)
    best_scale = -extreme / nneg
    for step in _SEARCH_STEPS:
        q = np.clip(np.rint(x * (-(nneg + step) / extreme)[..., None]), -nneg, nneg - 1)
        sqq, sxq = (q * q).sum(-1), (x * q).sum(-1)
        scale = np.where(sqq > 0, sxq / np.maximum(sqq, 1e-30), 0.0)
        err = ((scale[..., None] * q - x) ** 2).sum(-1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
    return best_scale


def _super_scale(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-super-block fp16 `d` and integer codes so values [B, S] ~ d * code, |code| <=
    levels. `d` is rounded to fp16 first, so codes are computed against the stored value."""
    d = (np.abs(values).max(-1) / levels).astype(np.float16)
    d32 = d.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(d32[:, None] > 0, np.rint(values / d32[:, None]), 0)
    return d, np.clip(codes, -levels, levels)


def _levels(x, scale, offset, nmax):
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.rint((x + offset) / scale), 0)
    return np.clip(q, 0, nmax).astype(np.uint8)


# ---- Q4_K / Q5_K ----------------------------------------------------------------------------


def _k_affine(rows: np.ndarray, nmax: int):
    """Shared by Q4_K / Q5_K: header bytes (d, dmin, 12 scale bytes) and q [B, 8, 32]."""
    x = rows.reshape(-1, 8, 32)
    scale, offset = _affine_fit(x, nmax)
    d, sc = _super_scale(scale, 63)
    dmin, mn = _super_scale(offset, 63)
    eff_scale = (d.astype(np.float64)[:, None] * sc)[..., None]
    eff_offset = (dmin.astype(np.float64)[:, None] * mn)[..., None]
    q = _levels(x, eff_scale, eff_offset, nmax)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    packed = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
        ],
        axis=1,
    )
    header = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed], axis=1)
    return header, q


def _pack_nibble_pairs(q: np.ndarray) -> np.ndarray:
    # q [B, 8, 32]: sub-blocks 2c / 2c+1 share bytes 32c..32c+31 (low / high nibble)
    low = q[:, 0::2] & 15
    high = q[:, 1::2] & 15
    return (low | (high << 4)).reshape(q.shape[0], 128)


def _q4_k(rows: np.ndarray) -> np.ndarray:
    header, q = _k_affine(rows, 15)
    return np.concatenate([header, _pack_nibble_pairs(q)], axis=1)


def _q5_k(rows: np.ndarray) -> np.ndarray:
    header, q = _k_affine(rows, 31)
    bit4 = (q >> 4).astype(np.uint8)  # [B, 8, 32]
    shifts = np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(bit4 << shifts, axis=1)  # [B, 32]
    return np.concatenate([header, qh, _pack_nibble_pairs(q)], axis=1)


# ---- Q6_K ---------------------------------------------------------------------------------


def _q6_k(rows: np.ndarray) -> np.ndarray:
    x = rows.reshape(-1, 16, 16)
    scale = _symmetric_fit(x, 32)
    d, sc = _super_scale(scale, 127)
    eff = (d.astype(np.float64)[:, None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff != 0, np.rint(x / eff), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    low = (q & 15).reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = np.bitwise_or.reduce(high << shifts, axis=2).reshape(-1, 64)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh, scales, _f16_bytes(d)], axis=1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(-1, 2)
