"""Paged attention for one layer: write this step's keys/values into the cache, then attend.

Shared by every architecture. It splits the flat batch at `num_decodes` (see
pipeline/models/forward_batch.py): the decode op for the one-token requests, the prefill op for
the chunks, both reading the same paged cache through the ops interface.
"""

from __future__ import annotations

import torch

from ringllm.pipeline.models.forward_batch import ForwardBatch
from ringllm.pipeline.ops import Ops


def paged_attention(
    ops: Ops,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hk, D] -> out [T, Hq, D]."""
    key_cache, value_cache = kv_cache
    ops.reshape_and_cache(key, value, key_cache, value_cache, batch.slot_mapping)
    nd = batch.num_decodes
    if nd == batch.num_reqs:
        return ops.paged_attention_decode(
            query, key_cache, value_cache, batch.block_tables, batch.seq_lens, scale
        )
    prefill = ops.paged_attention_prefill(
        query[nd:],
        key_cache,
        value_cache,
        batch.prefill_block_tables,
        batch.prefill_query_start_loc,
        batch.prefill_seq_lens,
        scale,
    )
    if nd == 0:
        return prefill
    decode = ops.paged_attention_decode(
        query[:nd],
        key_cache,
        value_cache,
        batch.decode_block_tables,
        batch.decode_seq_lens,
        scale,
    )
    return torch.cat([decode, prefill], dim=0)
