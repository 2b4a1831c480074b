"""Gemma 3 (text): the Llama decoder with Gemma's changes, as transformers' Gemma3ForCausalLM.

    embed * sqrt(H) -> [ RMSNorm -> qkv -> q/k RMSNorm -> rotary (local or global base)
                          -> paged attention (sliding window or global) -> o_proj -> RMSNorm
                          (+ residual) RMSNorm -> gate_up -> GELU(tanh)*mul -> down -> RMSNorm
                          (+ residual) ] x L
          -> RMSNorm -> tied head (-> tanh soft-cap where the config has one)

- Sandwich norms: each sublayer's output is normed before it joins the residual
  (post_attention_layernorm, post_feedforward_layernorm); the MLP's input norm is
  pre_feedforward_layernorm. The running sum flows as the Llama decoder's does
  (ops.rms_norm with a residual adds, then norms), so only two norms are new per layer.
- Gemma's RMSNorm multiplies by (1 + w): the weights are stored as w and read as 1 + w,
  computed in float32 before the cast to the model dtype.
- Layer types: `layer_types` in config.json (transformers 5), else every
  `sliding_window_pattern`-th layer global (five sliding to one). A sliding layer attends
  to its last `sliding_window` keys (its own included) with rotary base
  `rope_local_base_freq`; a global one to every key, with `rope_theta` and any
  `rope_scaling`.
- Attention scale: query_pre_attn_scalar ** -0.5 (not head_dim's).

Under an engine the sliding layers free the blocks that fell out of their window
(pipeline/core/kv_groups.py: the layers in groups of one kind, each with its own block
table), so a long context costs the global layers' blocks and a window per sliding group.
A decode step's layers run in one C call as the Llama decoder's do (models/decode_plan.py:
the sandwich norms, each layer's table and window, GELU(tanh) as `gelu_tanh_and_mul`,
the op this file's layers call, so both paths give the same bits).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ringllm.pipeline.models.forward_batch import ForwardBatch
from ringllm.pipeline.models.hf_config import ArchConfig
from ringllm.pipeline.models.llama import LayerWeights, LlamaForCausalLM
from ringllm.pipeline.models.registry import register
from ringllm.pipeline.models.weights import WeightSource
from ringllm.pipeline.ops.rope import RotaryTable

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_SLIDING_WINDOW_PATTERN = 6  # transformers' Gemma3TextConfig


@dataclasses.dataclass
class Gemma3LayerWeights(LayerWeights):
    pre_ff_norm: torch.Tensor | None = None
    post_ff_norm: torch.Tensor | None = None
    sliding_window: int = 0  # keys a query sees; 0: a global layer
    cos_sin: torch.Tensor | None = None  # this layer's rotary table (local or global base)


def gemma3_layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's attention type, from `layer_types` or the sliding-window pattern."""
    types = raw.get("layer_types")
    if types is not None:
        if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
            raise ValueError(
                f"config.json: layer_types must list {num_layers} entries of "
                f"{SLIDING!r} / {FULL!r}, got {types!r}"
            )
        return list(types)
    pattern = int(
        raw.get("sliding_window_pattern")
        or raw.get("_sliding_window_pattern")
        or DEFAULT_SLIDING_WINDOW_PATTERN
    )
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]


def gemma3_local_rope_theta(raw: dict[str, Any]) -> float:
    """The sliding layers' rotary base: `rope_local_base_freq` (transformers 4) or
    rope_parameters' sliding_attention entry (transformers 5)."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get(SLIDING), dict):
        return float(params[SLIDING].get("rope_theta", 10000.0))
    return float(raw.get("rope_local_base_freq", 10000.0))


@register("Gemma3ForCausalLM")
class Gemma3ForCausalLM(LlamaForCausalLM):
    mlp_activation = "gelu_tanh"

    @classmethod
    def adapt_config(cls, arch: ArchConfig) -> ArchConfig:
        raw = arch.raw_config or {}
        if raw.get("attn_logit_softcapping") is not None:
            raise ValueError(
                "config.json: attn_logit_softcapping is set; the attention kernels do not "
                "soft-cap scores (Gemma 3 leaves it null; Gemma 2 is not supported)"
            )
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(
                f"config.json: hidden_activation {act!r}; Gemma 3 uses gelu_pytorch_tanh"
            )
        return dataclasses.replace(arch, qk_norm=True)

    def __init__(self, arch: ArchConfig, ops, dtype, device, max_positions, **kwargs) -> None:
        super().__init__(arch, ops, dtype, device, max_positions, **kwargs)
        raw = arch.raw_config or {}
        self.scale = float(raw.get("query_pre_attn_scalar", arch.head_dim)) ** -0.5
        self.layer_types = gemma3_layer_types(raw, arch.num_hidden_layers)
        self.sliding_window = int(arch.sliding_window or 0)
        if self.sliding_window < 0:
            raise ValueError(f"config.json: sliding_window {self.sliding_window} is negative")
        self.local_cos_sin = self._held_rotary(
            RotaryTable(arch.head_dim, max_positions, gemma3_local_rope_theta(raw), None)
        )
        # transformers: sqrt(H) as a float32 tensor, cast to the weights' dtype
        self.embed_scale = torch.tensor(math.sqrt(arch.hidden_size)).to(dtype)
        self.final_logit_softcapping = raw.get("final_logit_softcapping")

    # ---- loading -------------------------------------------------------------------

    def load_weights(self, source: WeightSource) -> None:
        super().load_weights(source)
        if self.norm is not None:
            self.norm = self._gemma_norm(self.norm)

    def _gemma_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """w as stored -> the 1 + w Gemma's RMSNorm multiplies by (float32, then cast)."""
        return (1.0 + weight.float()).to(self.dtype)

    def _read_norm(self, source: WeightSource, name: str, size: int) -> torch.Tensor:
        return self._gemma_norm(self._read(source, name, (size,), dtype=torch.float32))

    def _load_layer(self, source: WeightSource, i: int) -> Gemma3LayerWeights:
        base = super()._load_layer(source, i)
        p, h, d = f"model.layers.{i}.", self.arch.hidden_size, self.arch.head_dim
        sliding = self.layer_types[i] == SLIDING
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LayerWeights)}
        fields.update(
            input_norm=self._read_norm(source, p + "input_layernorm.weight", h),
            post_norm=self._read_norm(source, p + "post_attention_layernorm.weight", h),
            q_norm=self._read_norm(source, p + "self_attn.q_norm.weight", d),
            k_norm=self._read_norm(source, p + "self_attn.k_norm.weight", d),
        )
        return Gemma3LayerWeights(
            **fields,
            pre_ff_norm=self._read_norm(source, p + "pre_feedforward_layernorm.weight", h),
            post_ff_norm=self._read_norm(source, p + "post_feedforward_layernorm.weight", h),
            sliding_window=self.sliding_window if sliding else 0,
            cos_sin=self.local_cos_sin if sliding else self.cos_sin,
        )

    # ---- forward -------------------------------------------------------------------

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super()._embed(input_ids) * self.embed_scale

    def _layer(self, w: Gemma3LayerWeights, hidden, residual, kv_cache, batch: ForwardBatch):
        ops, eps = self.ops, self.arch.rms_norm_eps
        if residual is None:
            residual = hidden
            h = ops.rms_norm(hidden, w.input_norm, eps)
        else:
            h, residual = ops.rms_norm(hidden, w.input_norm, eps, residual)
        out = self._attend(w, h, kv_cache, batch, w.cos_sin, w.sliding_window)
        out = ops.rms_norm(out, w.post_norm, eps)
        h, residual = ops.rms_norm(out, w.pre_ff_norm, eps, residual)
        gate_up = self._project(h, w, "gate_up", w.gate_up)
        mlp = self._reduce(self._project(ops.gelu_tanh_and_mul(gate_up), w, "down", w.down))
        return ops.rms_norm(mlp, w.post_ff_norm, eps), residual

    @classmethod
    def layer_windows(cls, arch: ArchConfig) -> list[int]:
        window = int(arch.sliding_window or 0)
        types = gemma3_layer_types(arch.raw_config or {}, arch.num_hidden_layers)
        return [window if t == SLIDING else 0 for t in types]

    def layer_attention(self, w: Gemma3LayerWeights) -> tuple[torch.Tensor, int]:
        return w.cos_sin, w.sliding_window

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
