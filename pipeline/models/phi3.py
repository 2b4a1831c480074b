"""Phi-3 / Phi-4-mini: the Llama decoder, read from checkpoints that fuse q | k | v
(`self_attn.qkv_proj`) and gate | up (`mlp.gate_up_proj`), with LongRoPE scaling and a
partial rotary (Phi-4-mini turns 3/4 of each head).

The fused tensors are served to the Llama loader as the parts it asks for
(`FusedPhi3Weights`), each rank's shard cut from its own part (a rank reads a fused tensor
whole, once per layer, and keeps its shard), so tensor parallelism splits
q, k and v as it does a Llama's. A partial rotary of R < D dimensions becomes a full one:
q's and k's rows are permuted within each head (rope.partial_rotary_permutation) so the
rotated pairs sit where the rotary kernels pair dimensions, and the rotary table gives the
other dimensions cos 1, sin 0. Attention scores are unchanged by the permutation (q and k
move alike); v and o_proj are untouched. Phi-3's `sliding_window` is attended on every
layer, as transformers does (the Llama decoder takes the window).
"""

from __future__ import annotations

import dataclasses

import torch

from ringllm.pipeline.models.hf_config import ArchConfig
from ringllm.pipeline.models.llama import LlamaForCausalLM
from ringllm.pipeline.models.registry import register
from ringllm.pipeline.models.weights import Shard, _shard_index
from ringllm.pipeline.ops.rope import RotaryTable, partial_rotary_permutation


def rotary_dim_of(arch: ArchConfig) -> int:
    raw = arch.raw_config or {}
    factor = raw.get("partial_rotary_factor")
    if factor is None:
        factor = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    dim = int(arch.head_dim * float(factor))
    if dim % 2 or not 0 < dim <= arch.head_dim:
        raise ValueError(
            f"partial_rotary_factor {factor} gives {dim} rotary dimensions of a "
            f"{arch.head_dim}-dimension head: they must be even and at most the head's"
        )
    return dim


class FusedPhi3Weights:
    """A weight source that answers the Llama loader's q / k / v and gate / up names from
    Phi-3's fused tensors (the rows of each part, q and k permuted for a partial rotary,
    then the rank's shard); every other name goes to `source` as it is."""

    def __init__(self, source, arch: ArchConfig, rotary_dim: int) -> None:
        self.source = source
        self.arch = arch
        self.perm = (
            partial_rotary_permutation(arch.head_dim, rotary_dim)
            if rotary_dim < arch.head_dim
            else None
        )
        q, kv, inter = arch.q_size, arch.kv_size, arch.intermediate_size
        self.parts = {
            "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0, q, q + 2 * kv),
            "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", q, kv, q + 2 * kv),
            "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", q + kv, kv, q + 2 * kv),
            "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0, inter, 2 * inter),
            "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", inter, inter, 2 * inter),
        }
        self._last: tuple[str, torch.Tensor] | None = None  # q, k, v read the fused once

    def _part(self, name: str):
        prefix, _, leaf = name.partition("self_attn.")
        if leaf:
            leaf = "self_attn." + leaf
        else:
            prefix, _, leaf = name.partition("mlp.")
            leaf = "mlp." + leaf if leaf else ""
        if not name.startswith("model.layers.") or leaf not in self.parts:
            return None
        fused, start, rows, total = self.parts[leaf]
        return prefix + fused, start, rows, total, leaf

    def __contains__(self, name: str) -> bool:
        part = self._part(name)
        return name in self.source or (part is not None and part[0] in self.source)

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def get(self, name: str, shard: Shard | None = None, shape=None) -> torch.Tensor:
        part = self._part(name)
        if part is None:
            return self.source.get(name, shard=shard, shape=shape)
        fused, start, rows, total, leaf = part
        if fused not in self.source:  # it serves the parts itself (a GGUF's fused tensors)
            t = self.source.get(name, shape=shape)
        else:
            if self._last is None or self._last[0] != fused:
                shape_of_fused = (total, self.arch.hidden_size)
                self._last = (fused, self.source.get(fused, shape=shape_of_fused))
            t = self._last[1][start : start + rows]
        if self._permuted(leaf):
            d = self.arch.head_dim
            t = t.reshape(rows // d, d, -1)[:, self.perm].reshape(rows, -1)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"tensor {fused!r}: its part {leaf} has shape {tuple(t.shape)}, not {shape}"
            )
        if shard is not None and shard.size > 1:
            t = t[_shard_index(tuple(t.shape), shard, name)]
        return t.contiguous()

    def get_blocks(self, name: str, shard: Shard | None = None, shape=None):
        """A part served in its block format by the source (a GGUF's), q's and k's rows
        permuted within each head for a partial rotary (rows of blocks move whole, and a
        shard holds whole heads, so the permutation commutes with the shard)."""
        blocks = self.source.get_blocks(name, shard=shard, shape=shape)
        part = self._part(name)
        if part is None or not self._permuted(part[4]):
            return blocks
        d = self.arch.head_dim
        rows = (torch.arange(blocks.n // d)[:, None] * d + torch.as_tensor(self.perm)).reshape(-1)
        return dataclasses.replace(blocks, blocks=blocks.blocks[rows].contiguous())

    def _permuted(self, leaf: str) -> bool:
        return self.perm is not None and leaf in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
        )


@register("Phi3ForCausalLM")
class Phi3ForCausalLM(LlamaForCausalLM):
    supports_lora = False  # its fused, permuted q|k|v rows are not PEFT's q/k/v

    def rotary_table(self, arch: ArchConfig, max_positions: int) -> RotaryTable:
        return RotaryTable(
            arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, rotary_dim_of(arch)
        )

    def load_weights(self, source) -> None:
        super().load_weights(FusedPhi3Weights(source, self.arch, rotary_dim_of(self.arch)))
