"""Rotary-embedding tables: inverse frequencies (with llama3 / linear scaling) and the
cos/sin cache the `rotary_embedding` op reads.

The maths follows the reference implementations exactly (float32, the same operation
order), so float32 runs match transformers to the last bits:

    inv_freq[i] = 1 / theta ** (2i / D)                    i = 0 .. D/2 - 1
    linear:  inv_freq /= factor                              (positions stretched)
    llama3:  wavelengths longer than old_ctx / low_freq_factor are divided by `factor`,
             shorter than old_ctx / high_freq_factor are kept, and the band between is a
             linear blend of the two.
    longrope (Phi-3): inv_freq[i] = 1 / (ext[i] * theta ** (2i / D)), ext the config's
             `long_factor` when the engine's context (max_positions) passes
             `original_max_position_embeddings`, else its `short_factor` (llama.cpp's
             choice, made once per engine so the cache's keys all share one rotation;
             transformers chooses per forward by its longest position, which is the same
             for any sequence inside the original context); cos and sin are then scaled by
             the attention factor (config's, or sqrt(1 + ln(s) / ln(original)) with
             s = max_position_embeddings / original).

    cos_sin_cache[p] = [cos(p * inv_freq) | sin(p * inv_freq)]      shape [max_pos, D]

Partial rotary (rotary_dim R < D, Phi-4-mini's 0.75): the frequencies are those of an
R-dimensional rotation, laid out for a model whose q / k rows were permuted so its
rotated pairs (i, i + R/2) sit at (i, i + D/2) (`partial_rotary_permutation`); the other
D/2 - R/2 pairs get cos 1, sin 0 and pass unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ringllm.pipeline.config import SUPPORTED_ROPE_TYPES


def inverse_frequencies(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_positions: int | None = None,
) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "longrope":
        return 1.0 / (_longrope_factors(head_dim, scaling, max_positions) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(
        f"rope_scaling: rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
    )


def _original_context(scaling: dict[str, Any]) -> int:
    value = scaling.get("original_max_position_embeddings")
    if value is None:
        raise ValueError("rope_scaling: longrope needs original_max_position_embeddings")
    return int(value)


def _longrope_factors(
    rotary_dim: int, scaling: dict[str, Any], max_positions: int | None
) -> torch.Tensor:
    long = max_positions is not None and max_positions > _original_context(scaling)
    key = "long_factor" if long else "short_factor"
    factors = scaling.get(key)
    if not isinstance(factors, (list, tuple)) or len(factors) != rotary_dim // 2:
        raise ValueError(
            f"rope_scaling: longrope's {key} must be a list of {rotary_dim // 2} numbers "
            f"(half the rotary dimensions), got {factors!r}"
        )
    return torch.tensor([float(f) for f in factors], dtype=torch.float32)


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: 1 but for longrope."""
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = _original_context(scaling)
    factor = scaling.get("factor")
    if factor is None:
        factor = float(scaling.get("max_position_embeddings", original)) / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def partial_rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """new dim j of a head <- old dim perm[j]: the rotated pairs (i, i + R/2) of a partial
    rotary of R dims move to (i, i + D/2), the pass-through dims fill the rest in order.
    Applied to q and k alike, it leaves every q . k unchanged."""
    half, r = head_dim // 2, rotary_dim // 2
    rest = list(range(rotary_dim, head_dim))
    perm = list(range(r)) + rest[: half - r] + list(range(r, rotary_dim)) + rest[half - r :]
    return torch.tensor(perm, dtype=torch.int64)


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict[str, Any] | None,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of each angle in the first half, sin in the
    second (rotary_dim < head_dim: the layout of partial_rotary_permutation)."""
    return RotaryTable(head_dim, max_positions, theta, scaling, rotary_dim, max_positions).table


class RotaryTable:
    """cos_sin_cache's table, its rows written as positions first need them (`cover`).

    The tensor is allocated whole, so its address never changes (the layers and the decode
    plan keep it), but only the pages of the rows written are resident: a model's table for
    its full context (Gemma 3's 32,768 positions of 256: 32 MiB, two tables) took that much
    memory from load, whatever the prompts' lengths. A row's values do not depend on when it
    is written (elementwise float32 arithmetic), so a table filled in steps equals one made
    whole (tests/pipeline/ops/test_rope.py)."""

    FIRST_ROWS = 4096

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
        rows: int | None = None,
    ) -> None:
        """`rows`: written now (default FIRST_ROWS)."""
        rotary_dim = rotary_dim or head_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary dimensions {rotary_dim} must be even and at most {head_dim}")
        self.inv_freq = inverse_frequencies(rotary_dim, theta, scaling, max_positions)
        self.factor = attention_factor(scaling)
        self.pad = (head_dim - rotary_dim) // 2
        self.table = torch.empty(max_positions, head_dim, dtype=torch.float32)
        self.rows = 0
        self.cover(self.FIRST_ROWS if rows is None else rows)

    def cover(self, positions: int) -> None:
        """Rows 0 .. positions - 1 written (at least twice the rows before, so a growing
        context costs a few fills)."""
        if positions <= self.rows:
            return
        end = min(max(positions, 2 * self.rows), self.table.shape[0])
        angles = torch.arange(self.rows, end, dtype=torch.int64).to(torch.float32)[:, None]
        angles = angles * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        if self.pad:
            cos = torch.cat([cos, torch.ones(end - self.rows, self.pad)], dim=-1)
            sin = torch.cat([sin, torch.zeros(end - self.rows, self.pad)], dim=-1)
        self.table[self.rows : end] = torch.cat([cos, sin], dim=-1)
        self.rows = end
