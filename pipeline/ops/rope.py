"""Rotary-embedding tables: inverse frequencies (with llama3 / linear scaling) and the
cos/sin cache the `rotary_embedding` op reads.

The maths follows the reference implementations exactly (float32, the same operation
order), so float32 runs match transformers to the last bits:

    inv_freq[i] = 1 / theta ** (2i / D)                    i = 0 .. D/2 - 1
    linear:  inv_freq /= factor                              (positions stretched)
    llama3:  wavelengths longer than old_ctx / low_freq_factor are divided by `factor`,
             shorter than old_ctx / high_freq_factor are kept, and the band between is a
             linear blend of the two.

    cos_sin_cache[p] = [cos(p * inv_freq) | sin(p * inv_freq)]      shape [max_pos, D]
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(
        f"rope_scaling: rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
    )


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
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of each angle in the first half, sin in the second."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)
