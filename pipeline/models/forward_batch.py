"""`ForwardBatch`: the flat description of one model step, as tensors.

The requests of a step are concatenated along one token dimension, never padded:

    tokens:     | d0 | d1 | d2 |  p0 p0 p0 p0 p0  |  p1 p1 p1  |
    requests:     decodes first   prefill chunk     prefill chunk
                  (1 token each)  (cached prefix may precede it)

Decode requests (exactly one new token) come first so attention can run the decode op on
tokens [0, num_decodes) and the prefill op on the rest without any gather. The model
runner builds this; the models only read it.

Layers in KV groups (sliding-window layers freeing blocks: pipeline/core/kv_groups.py):
each group has its own block table and slots (`group_block_tables` [G, R, max_blocks],
`group_slot_mapping` [G, T]); `for_layer(i)` is the batch local layer i reads, the same
object for every layer of a group in a step. The ops' per-step caches hold one entry per
name, so they are reused along a run of one group's layers and recomputed where the group
changes (Gemma 3 270M: about 8 of 18 layers; measured within the noise of a step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32, cached + new tokens after this step
    block_tables: torch.Tensor  # [R, max_blocks] int32
    num_decodes: int  # the first num_decodes requests have one token each
    logits_indices: torch.Tensor  # [N] int64, token rows whose logits are wanted
    # KV groups (None: one table for every layer): group of each local layer, the tables
    # and slots of every group (block_tables / slot_mapping above are group 0's)
    layer_groups: tuple[int, ...] | None = None
    group_block_tables: torch.Tensor | None = None  # [G, R, max_blocks] int32
    group_slot_mapping: torch.Tensor | None = None  # [G, T] int64
    # LoRA (models/lora.py): each token's adapter slot, int32 [T], -1: the base model;
    # None: no token of the step takes an adapter
    lora_slots: torch.Tensor | None = None

    def for_layer(self, layer: int) -> ForwardBatch:
        """The batch local layer `layer` attends with (its group's table and slots)."""
        if self.layer_groups is None:
            return self
        return self.group_batches[self.layer_groups[layer]]

    @cached_property
    def group_batches(self) -> list[ForwardBatch]:
        """One batch per KV group (just this one without groups)."""
        if self.group_block_tables is None:
            return [self]
        return [
            dataclasses.replace(
                self,
                block_tables=tables,
                slot_mapping=slots,
                layer_groups=None,
                group_block_tables=None,
                group_slot_mapping=None,
            )
            for tables, slots in zip(self.group_block_tables, self.group_slot_mapping, strict=True)
        ]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    # The decode / prefill halves of the per-request tensors, made once per step: every layer
    # then passes the very same tensor objects, which lets the ops derive what they need
    # from them once per step (see TorchOps._per_step).

    @cached_property
    def decode_block_tables(self) -> torch.Tensor:
        return self.block_tables[: self.num_decodes]

    @cached_property
    def decode_seq_lens(self) -> torch.Tensor:
        return self.seq_lens[: self.num_decodes]

    @cached_property
    def prefill_block_tables(self) -> torch.Tensor:
        return self.block_tables[self.num_decodes :]

    @cached_property
    def prefill_seq_lens(self) -> torch.Tensor:
        return self.seq_lens[self.num_decodes :]

    @cached_property
    def prefill_query_start_loc(self) -> torch.Tensor:
        """query_start_loc of the chunks, counted from the first prefill token."""
        return self.query_start_loc[self.num_decodes :] - self.num_decodes
