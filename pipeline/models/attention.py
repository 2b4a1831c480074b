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
    sliding_window: int = 0,
) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hk, D] -> out [T, Hq, D]; `sliding_window` W > 0:
    each query sees its last W keys only (a sliding-window layer)."""
    key_cache, value_cache = kv_cache
    ops.reshape_and_cache(key, value, key_cache, value_cache, batch.slot_mapping)
    # the keyword only where a window is: an Ops without windows still runs the others
    window = {"sliding_window": sliding_window} if sliding_window else {}
    nd = batch.num_decodes
    if nd == batch.num_reqs:
        return ops.paged_attention_decode(
            query, key_cache, value_cache, batch.block_tables, batch.seq_lens, scale, **window
        )
    prefill = ops.paged_attention_prefill(
        query[nd:],
        key_cache,
        value_cache,
        batch.prefill_block_tables,
        batch.prefill_query_start_loc,
        batch.prefill_seq_lens,
        scale,
        **window,
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
        **window,
    )
    return torch.cat([decode, prefill], dim=0)
