"""The Llama family decoder (Llama, Mistral, Qwen2, Qwen3 are variants of it).

    embed -> [ RMSNorm -> qkv -> (q/k RMSNorm) -> rotary -> paged attention -> o_proj
               (+ residual) RMSNorm -> gate_up -> SiLU*mul -> down (+ residual) ] x L
          -> RMSNorm -> lm_head (rows of the tokens whose logits are wanted)

Weights are held as plain tensors, fused where the maths allows (q|k|v in one matrix,
gate|up in one), so a step runs one matmul per projection group. Tensor parallelism
(tp_size > 1) splits heads and the MLP's inner dimension across ranks: q/k/v and gate/up
are column shards (rows of the weight), o_proj and down are row shards (columns), whose
partial outputs are summed by `comm.all_reduce`. Every rank reads only its shards.

Pipeline parallelism (`stage`, models/stages.py): a stage builds and runs only layers
[start_layer, end_layer), reading only their tensors; the first stage alone holds the
embedding, the last alone the final norm and LM head (a tied head: the last stage reads
the embedding matrix for it). `self.layers` holds the local layers only, so
`len(self.layers)` (`num_local_layers`) is the number of KV caches the model takes. A
stage that is not the first starts from the previous stage's `IntermediateTensors`; one
that is not the last returns its own, before the final norm.

Variants differ by `adapt_config` (Qwen2: q/k/v bias; Qwen3: per-head q/k RMSNorm) and
register themselves in their own small module.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F

from ringllm.pipeline.models.attention import paged_attention
from ringllm.pipeline.models.communicator import Communicator
from ringllm.pipeline.models.decode_plan import PlanSlot, fused_decode_enabled, runs_fused
from ringllm.pipeline.models.forward_batch import ForwardBatch
from ringllm.pipeline.models.gguf_weights import GGUFBlocks
from ringllm.pipeline.models.hf_config import ArchConfig, check_tensor_parallel_split
from ringllm.pipeline.models.linear import PackedWeight16, linear, prepack, weight_dtype
from ringllm.pipeline.models.lora import (
    HEAD,
    GroupShape,
    LoraError,
    LoraSlots,
    group_shapes,
    read_adapter,
)
from ringllm.pipeline.models.quant_weights import (
    BF16_TILES,
    BlockEmbedding,
    bf16_tiles_here,
    cat_rows,
)
from ringllm.pipeline.models.registry import register
from ringllm.pipeline.models.stages import IntermediateTensors, StageInfo
from ringllm.pipeline.models.weights import Shard, WeightSource
from ringllm.pipeline.ops import Ops
from ringllm.pipeline.ops.rope import RotaryTable

# a plain / oneDNN tensor, 16-bit panels, or (models/quant_weights.py) a QuantMatrix,
# DeviceBlocks (on a GPU) or RowParts; GGUFBlocks between reading and packing
Weight = torch.Tensor | PackedWeight16 | object


@dataclasses.dataclass
class LayerWeights:
    """One layer's tensors; the four matrices in whichever layout models/linear.py chose."""

    input_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Weight
    post_norm: torch.Tensor
    gate_up: Weight | None  # None: a mixture-of-experts layer (`moe`)
    down: Weight | None
    moe: Any = None  # models/moe.py MoeWeights: the layer's router and experts
    # LoRA (models/lora.py): group ("qkv", "o_proj", "gate_up", "down") -> its slot stacks
    # (a, b) and its parts' output sizes
    lora: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] | None = None


@register("LlamaForCausalLM")
class LlamaForCausalLM:
    mlp_activation = "silu"  # the gated MLP's activation (decode_plan.py's ACT codes)
    supports_lora = True  # PEFT adapters on q/k/v/o/gate/up/down (models/lora.py)

    @classmethod
    def adapt_config(cls, arch: ArchConfig) -> ArchConfig:
        return arch

    def __init__(
        self,
        arch: ArchConfig,
        ops: Ops,
        dtype: torch.dtype,
        device: str,
        max_positions: int,
        comm: Communicator | None = None,
        stage: StageInfo | None = None,
        quantization: str | None = None,
    ) -> None:
        self.arch = arch
        # None; "gguf": matrices kept in the GGUF's block formats; "int8": a dense
        # checkpoint's matrices quantized at load; BF16_TILES: a bfloat16 checkpoint's
        # matrices as the AMX tile unit's tiles (models/quant_weights.py)
        self.quantization = quantization
        self.ops = ops
        self.dtype = dtype  # activations, norms, KV cache
        # matrices: a 16-bit checkpoint's own dtype where the CPU multiplies it widened in
        # registers (models/linear.py) or on the tile unit, else `dtype`
        tiles = quantization == BF16_TILES
        self.weight_dtype = torch.bfloat16 if tiles else weight_dtype(dtype, arch.dtype, device)
        self.device = device
        self.comm = comm
        self.tp_rank = comm.rank if comm else 0
        self.tp_size = comm.world_size if comm else 1
        check_tensor_parallel_split(arch, self.tp_size)
        self.stage = stage or StageInfo.whole(arch.num_hidden_layers)
        _check_stage(arch, self.stage)
        self.num_heads = arch.num_attention_heads // self.tp_size
        self.num_kv_heads = arch.num_key_value_heads // self.tp_size
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim**-0.5
        # rotary tables written as positions come (ops/rope.py RotaryTable; forward covers
        # each step's positions first)
        self._rotary_tables: list[RotaryTable] = []
        self.cos_sin = self._held_rotary(self.rotary_table(arch, max_positions))
        self.layers: list[LayerWeights] = []  # this stage's layers, start_layer first
        self.embed: torch.Tensor | None = None  # first stage only
        self.norm: torch.Tensor | None = None  # last stage only
        self.lm_head: Weight | None = None  # last stage only
        self.vocab_shard_rows = -(-arch.vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.vocab_shard_rows
        # Mistral's sliding window (every layer): each query sees its last W keys
        self.sliding_window = int(arch.sliding_window or 0)
        # decode steps' layers in one C call where the model allows (models/decode_plan.py)
        self.fused_decode = fused_decode_enabled() and device == "cpu"
        self._decode_plan = PlanSlot()
        # seconds per part of the C call (decode_plan.new_profile), while bench step profiles
        self.decode_profile: torch.Tensor | None = None
        self.lora: LoraSlots | None = None  # enable_lora
        self._lora_tokens: torch.Tensor | None = None  # the running step's token -> slot
        self._head_slots: torch.Tensor | None = None  # its logits rows' slots (LM head)

    def rotary_table(self, arch: ArchConfig, max_positions: int) -> RotaryTable:
        """The rotary cos / sin table the attention layers read (ops/rope.py)."""
        return RotaryTable(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)

    def _held_rotary(self, table: RotaryTable) -> torch.Tensor:
        """`table`'s tensor as the layers read it: on the CPU the growing table itself; on a
        GPU a whole copy (its memory is the KV cache's, and a copy per step would cost)."""
        if self.device == "cpu":
            self._rotary_tables.append(table)
            return table.table
        table.cover(table.table.shape[0])
        return table.table.to(self.device)

    def _cover_positions(self, batch: ForwardBatch) -> None:
        """Every rotary table written up to the step's last position."""
        if batch.seq_lens.numel() and any(t.rows < t.table.shape[0] for t in self._rotary_tables):
            last = int(batch.seq_lens.max())
            for t in self._rotary_tables:
                t.cover(last)

    # ---- loading -------------------------------------------------------------------

    @property
    def num_local_layers(self) -> int:
        """Decoder layers this model (stage) runs: one KV cache each."""
        return self.stage.num_layers

    def load_weights(self, source: WeightSource) -> None:
        """Reads this stage's tensors only (see the module docstring)."""
        a, stage = self.arch, self.stage
        embed = None
        if stage.is_first:
            embed = self._read_vocab(source, "model.embed_tokens.weight")
            # looked up, never multiplied
            self.embed = self._embedding(source, embed)
        if stage.is_last:
            self.norm = self._read(source, "model.norm.weight", (a.hidden_size,))
            self.lm_head = self._read_head(source, embed)
        layers = range(stage.start_layer, stage.end_layer)
        self.layers = [self._load_layer(source, i) for i in layers]
        self._prepack()

    def _embedding(self, source: WeightSource, embed):
        """The matrix rows are looked up from: blocks stay blocks (one rank's: from the
        file's mapping, not a copy); a dense matrix in the activations' dtype, or in its own
        16-bit one under wider activations (an int8 or 16-bit checkpoint computed in float32:
        the looked-up rows are widened, exactly, instead of the whole table: half its bytes)."""
        if not isinstance(embed, GGUFBlocks):
            if embed.is_floating_point() and embed.dtype.itemsize < self.dtype.itemsize:
                return embed
            return embed.to(self.dtype)
        whole = self.tp_size == 1 and hasattr(source, "mapped_rows")
        mapped = source.mapped_rows("model.embed_tokens.weight") if whole else None
        return BlockEmbedding(embed, mapped)

    def _read_head(self, source: WeightSource, embed: torch.Tensor | None) -> torch.Tensor:
        """The LM head's own matrix, or (tied, or no head saved) the embedding matrix: the
        first stage's `embed`, read again by a last stage that is not also the first."""
        if not self.arch.tie_word_embeddings and "lm_head.weight" in source:
            return self._read_vocab(source, "lm_head.weight")
        if embed is not None:
            return embed
        return self._read_vocab(source, "model.embed_tokens.weight")

    def _prepack(self) -> None:
        """Matrices only ever multiplied go to the fastest layout (see models/linear.py)."""
        quantization = self.quantization if self.quantization in ("int8", BF16_TILES) else None
        if (
            self.quantization == "gguf"
            and self.weight_dtype is torch.bfloat16
            and bf16_tiles_here()
        ):
            quantization = BF16_TILES  # a GGUF's BF16 matrices: tiles; its blocks stay blocks
        pack = functools.partial(
            prepack, compute=self.dtype, quantization=quantization, device=self.device
        )
        if self.lm_head is not None:  # a tied head gets its own copy; embed stays plain
            self.lm_head = pack(self.lm_head)
        for layer in self.layers:
            layer.qkv = pack(layer.qkv)
            layer.o_proj = pack(layer.o_proj)
            if layer.moe is not None:
                layer.moe.prepack(pack)
            else:
                layer.gate_up = pack(layer.gate_up)
                layer.down = pack(layer.down)

    # ---- LoRA adapters (models/lora.py) ----------------------------------------------

    def enable_lora(self, max_loras: int, max_rank: int, max_adapters: int) -> LoraSlots:
        """Slots for `max_loras` adapters of rank <= `max_rank`, attached to the layers."""
        if not self.supports_lora:
            raise LoraError(f"{type(self).__name__} does not take LoRA adapters")
        dense = self._dense_mlp_layers()
        local = dense[self.stage.start_layer : self.stage.end_layer]
        shapes = group_shapes(self.arch, self.tp_size)
        head = None
        if self.stage.is_last:  # this rank's vocabulary rows, padded (vocab-parallel)
            head = GroupShape(self.arch.hidden_size, (self.vocab_shard_rows,))
        self.lora = LoraSlots(
            shapes, len(self.layers), local, max_loras, max_rank, max_adapters,
            self.dtype, self.device, head,
        )  # fmt: skip
        self.attach_lora()
        return self.lora

    def attach_lora(self) -> None:
        """The slot stacks onto the layers (again after the weights were read anew)."""
        for layer, stacks in zip(self.layers, self.lora.stacks, strict=True):
            layer.lora = stacks

    def read_lora(self, path: str, name: str = ""):
        """This rank's and stage's part of the PEFT adapter at `path` (LoraError: unfit)."""
        if self.lora is None:
            raise LoraError("LoRA is not enabled (enable_lora=True, --enable-lora)")
        stage = self.stage
        return read_adapter(
            path, self.arch, self.lora.max_rank, name=name, tp_rank=self.tp_rank,
            tp_size=self.tp_size, layers=range(stage.start_layer, stage.end_layer),
            dense_mlp=self._dense_mlp_layers(), head=stage.is_last,
        )  # fmt: skip

    def _dense_mlp_layers(self) -> tuple[bool, ...]:
        sparse = getattr(self, "is_sparse", None)
        layers = range(self.arch.num_hidden_layers)
        return tuple(sparse is None or not sparse(i) for i in layers)

    def _project(self, h: torch.Tensor, w: LayerWeights, group: str, weight, bias=None):
        """`linear(h, weight, bias)` plus the step's LoRA deltas for the layer's `group`."""
        out = linear(h, weight, bias)
        tokens = self._lora_tokens
        if (
            tokens is not None
            and w.lora is not None
            and group in w.lora
            and group in self.lora.groups_used
        ):
            a_stack, b_stack, parts = w.lora[group]
            self.ops.lora_apply(out, h, a_stack, b_stack, tokens, parts)
        return out

    def _read(
        self,
        source: WeightSource,
        name: str,
        shape,
        shard: Shard | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        dtype = dtype or self.dtype
        return source.get(name, shard=shard, shape=shape).to(device=self.device, dtype=dtype)

    def _read_matrix(self, source: WeightSource, name: str, shape, shard: Shard | None = None):
        """A matrix in the matrices' dtype, or (quantization "gguf") as the GGUF's blocks."""
        if self.quantization == "gguf" and source.qtype(name) is not None:
            return source.get_blocks(name, shard=shard, shape=shape)
        return self._read(source, name, shape, shard, dtype=self.weight_dtype)

    def _read_vocab(self, source: WeightSource, name: str) -> torch.Tensor:
        """The whole [vocab, hidden] matrix, or (tp > 1) this rank's rows padded to S rows,
        in the matrices' dtype."""
        shape = (self.arch.vocab_size, self.arch.hidden_size)
        if self.tp_size == 1:
            return self._read_matrix(source, name, shape)
        shard = Shard(0, self.tp_rank, self.tp_size, padded=True)
        rows = self._read_matrix(source, name, shape, shard)
        missing = self.vocab_shard_rows - rows.shape[0]
        if isinstance(rows, GGUFBlocks):
            return _pad_block_rows(rows, self.vocab_shard_rows) if missing else rows
        return F.pad(rows, (0, 0, 0, missing)) if missing else rows

    def _load_layer(self, source: WeightSource, i: int) -> LayerWeights:
        a, p = self.arch, f"model.layers.{i}."
        col = Shard(0, self.tp_rank, self.tp_size)
        row = Shard(1, self.tp_rank, self.tp_size)
        h, d = a.hidden_size, a.head_dim
        q = self._read_matrix(source, p + "self_attn.q_proj.weight", (a.q_size, h), col)
        k = self._read_matrix(source, p + "self_attn.k_proj.weight", (a.kv_size, h), col)
        v = self._read_matrix(source, p + "self_attn.v_proj.weight", (a.kv_size, h), col)
        qkv_bias = None
        if a.attention_bias:
            qkv_bias = torch.cat(
                [
                    self._read(
                        source,
                        p + "self_attn.q_proj.bias",
                        (a.q_size,),
                        Shard(0, self.tp_rank, self.tp_size),
                    ),
                    self._read(
                        source,
                        p + "self_attn.k_proj.bias",
                        (a.kv_size,),
                        Shard(0, self.tp_rank, self.tp_size),
                    ),
                    self._read(
                        source,
                        p + "self_attn.v_proj.bias",
                        (a.kv_size,),
                        Shard(0, self.tp_rank, self.tp_size),
                    ),
                ]
            )
        q_norm = k_norm = None
        if a.qk_norm:
            q_norm = self._read(source, p + "self_attn.q_norm.weight", (d,))
            k_norm = self._read(source, p + "self_attn.k_norm.weight", (d,))
        return LayerWeights(
            input_norm=self._read(source, p + "input_layernorm.weight", (h,)),
            qkv=cat_rows([q, k, v]),
            qkv_bias=qkv_bias,
            q_norm=q_norm,
            k_norm=k_norm,
            o_proj=self._read_matrix(source, p + "self_attn.o_proj.weight", (h, a.q_size), row),
            post_norm=self._read(source, p + "post_attention_layernorm.weight", (h,)),
            **self._load_mlp(source, i),
        )

    def _load_mlp(self, source: WeightSource, i: int) -> dict[str, Any]:
        """Layer i's MLP as LayerWeights fields: the gated MLP's gate_up and down (this
        rank's shard); models/moe.py's layers give their experts instead."""
        a, p = self.arch, f"model.layers.{i}.mlp."
        col = Shard(0, self.tp_rank, self.tp_size)
        row = Shard(1, self.tp_rank, self.tp_size)
        h, inter = a.hidden_size, a.intermediate_size
        gate = self._read_matrix(source, p + "gate_proj.weight", (inter, h), col)
        up = self._read_matrix(source, p + "up_proj.weight", (inter, h), col)
        down = self._read_matrix(source, p + "down_proj.weight", (h, inter), row)
        return {"gate_up": cat_rows([gate, up]), "down": down}

    # ---- forward -------------------------------------------------------------------

    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs_embeds: torch.Tensor | None = None,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Runs this stage's layers over the flat batch (`kv_caches`: one per local layer).
        Returns the final hidden states [T, H] (normed) on the last stage, else the
        `IntermediateTensors` for the next stage.

        `inputs_embeds` [T, H] in the model dtype (first stage): the input rows to use
        instead of looking up `batch.input_ids` (a multimodal model's text and image
        embeddings, merged). `intermediate` (every other stage): the previous stage's."""
        hidden, residual = self._stage_input(batch, inputs_embeds, intermediate)
        self._cover_positions(batch)
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"kv_caches: {len(kv_caches)} caches for the {len(self.layers)} layers "
                f"of pipeline stage {self.stage.rank} (one per local layer)"
            )
        lora_slots = batch.lora_slots if self.lora is not None else None
        self._lora_tokens = lora_slots
        # the LM head's rows (compute_logits, next): the slots of the rows it is given
        self._head_slots = None
        if lora_slots is not None and self.stage.is_last and HEAD in self.lora.groups_used:
            self._head_slots = lora_slots[batch.logits_indices]
        try:
            fused = self._fused_layers(batch, kv_caches, hidden, residual)
            if fused is not None:
                hidden, residual = fused
            else:
                for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                    layer_batch = batch.for_layer(i)
                    hidden, residual = self._layer(layer, hidden, residual, kv_cache, layer_batch)
        finally:
            self._lora_tokens = None
        if not self.stage.is_last:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.ops.rms_norm(hidden, self.norm, self.arch.rms_norm_eps, residual)
        return hidden

    def _fused_layers(self, batch: ForwardBatch, kv_caches, hidden, residual):
        """(hidden, residual) after every local layer in one C call (models/decode_plan.py),
        or None: this step or model takes the layers one by one."""
        if not (self.fused_decode and runs_fused(batch)):
            return None
        plan = self._decode_plan.get(self, kv_caches, batch.layer_groups)
        if plan is None:
            return None
        return plan.run(self.ops, batch, hidden, residual, self._lora_tokens, self.decode_profile)

    def _stage_input(self, batch: ForwardBatch, inputs_embeds, intermediate):
        """(hidden, residual) the first local layer takes."""
        stage = self.stage
        if stage.is_first:
            if intermediate is not None:
                raise ValueError("intermediate: the first pipeline stage embeds its input ids")
            hidden = self._embed(batch.input_ids) if inputs_embeds is None else inputs_embeds
            return hidden, None
        if intermediate is None or inputs_embeds is not None:
            raise ValueError(
                f"pipeline stage {stage.rank} of {stage.size} takes the previous stage's "
                "IntermediateTensors (and no inputs_embeds)"
            )
        return intermediate.hidden, intermediate.residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab] in float32 (the last pipeline stage)."""
        if self.lm_head is None:
            raise ValueError(
                f"compute_logits: pipeline stage {self.stage.rank} of {self.stage.size} "
                "holds no LM head (the last stage computes the logits)"
            )
        logits = linear(hidden, self.lm_head)
        slots, self._head_slots = self._head_slots, None
        if slots is not None and slots.shape[0] == hidden.shape[0]:  # LoRA on the head
            a_stack, b_stack, _ = self.lora.head
            self.ops.lora_apply(logits, hidden, a_stack, b_stack, slots)
        if self.tp_size == 1:
            return logits.float()
        # [N, S] per rank -> [N, tp_size * S]; the padded tail columns are dropped.
        gathered = self.comm.all_gather(logits, dim=-1)
        return gathered[:, : self.arch.vocab_size].float().contiguous()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            raise ValueError(
                f"pipeline stage {self.stage.rank} of {self.stage.size} holds no embedding "
                "(the first stage embeds the input ids)"
            )
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.vocab_shard_rows)
        rows = self._lookup(local_ids.masked_fill(outside, 0))
        # Exactly one rank holds each id, so the sum adds zeros only: no rounding.
        return self._reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, BlockEmbedding):
            return self.embed.lookup(ids, self.dtype)
        rows = F.embedding(ids, self.embed)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)

    def _layer(self, w: LayerWeights, hidden, residual, kv_cache, batch: ForwardBatch):
        ops, eps = self.ops, self.arch.rms_norm_eps
        if residual is None:
            residual = hidden
            h = ops.rms_norm(hidden, w.input_norm, eps)
        else:
            h, residual = ops.rms_norm(hidden, w.input_norm, eps, residual)
        out = self._attend(w, h, kv_cache, batch, *self.layer_attention(w))
        h, residual = ops.rms_norm(out, w.post_norm, eps, residual)
        return self._reduce(self._mlp(w, h)), residual

    def _mlp(self, w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """The MLP of normed h, before the reduction over the ranks."""
        if w.moe is not None:
            return w.moe.forward(self.ops, h)
        gate_up = self._project(h, w, "gate_up", w.gate_up)
        return self._project(self.ops.silu_and_mul(gate_up), w, "down", w.down)

    @classmethod
    def layer_windows(cls, arch: ArchConfig) -> list[int]:
        """Every layer's sliding window (0: global), from the config alone: the model's
        window on every layer (Mistral, Phi-3), none without one."""
        return [int(arch.sliding_window or 0)] * arch.num_hidden_layers

    def layer_attention(self, w: LayerWeights) -> tuple[torch.Tensor, int]:
        """Layer `w`'s rotary table and sliding window (0: none): the model's, every layer."""
        return self.cos_sin, self.sliding_window

    def _attend(self, w: LayerWeights, h, kv_cache, batch: ForwardBatch, cos_sin, window: int):
        """The attention sublayer's output (o_proj, reduced over the ranks) for normed h."""
        q, k, v = self._qkv(w, h)
        self.ops.rotary_embedding(batch.positions, q, k, cos_sin)
        attn = paged_attention(self.ops, q, k, v, kv_cache, batch, self.scale, window)
        return self._reduce(self._project(attn.reshape(attn.shape[0], -1), w, "o_proj", w.o_proj))

    def _qkv(self, w: LayerWeights, h: torch.Tensor):
        num_tokens = h.shape[0]
        qkv = self._project(h, w, "qkv", w.qkv, w.qkv_bias)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if w.q_norm is not None:
            eps = self.arch.rms_norm_eps
            q = self.ops.rms_norm(q, w.q_norm, eps)
            k = self.ops.rms_norm(k, w.k_norm, eps)
        return q, k, v

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(x) if self.comm is not None and self.tp_size > 1 else x


def _pad_block_rows(rows: GGUFBlocks, num_rows: int) -> GGUFBlocks:
    """Zero rows of blocks appended up to `num_rows` (a zero block dequantizes to zeros)."""
    zeros = torch.zeros(num_rows - rows.n, rows.blocks.shape[1], dtype=torch.uint8)
    return GGUFBlocks(rows.qtype, num_rows, rows.k, torch.cat([rows.blocks, zeros]))


def _check_stage(arch: ArchConfig, stage: StageInfo) -> None:
    """The stage's layers are the model's: the first starts at 0, the last ends at L."""
    num_layers = arch.num_hidden_layers
    first_ok = not stage.is_first or stage.start_layer == 0
    last_ok = not stage.is_last or stage.end_layer == num_layers
    if stage.end_layer > num_layers or not (first_ok and last_ok):
        raise ValueError(
            f"pipeline stage {stage.rank} of {stage.size}: layers [{stage.start_layer}, "
            f"{stage.end_layer}) do not fit the model's {num_layers} layers (the first stage "
            f"starts at layer 0, the last ends at {num_layers}; see models/stages.py "
            "pipeline_stages)"
        )
