"""`ForwardBatch`: the flat description of one model step, as tensors.

The requests of a step are concatenated along one token dimension, never padded:

    tokens:     | d0 | d1 | d2 |  p0 p0 p0 p0 p0  |  p1 p1 p1  |
    requests:     decodes first   prefill chunk     prefill chunk
                  (1 token each)  (cached prefix may precede it)

Decode requests (exactly one new token) come first so attention can run the decode op on
tokens [0, num_decodes) and the prefill op on the rest without any gather. The model
runner builds this; the models only read it.
"""

from __future__ import annotations

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
