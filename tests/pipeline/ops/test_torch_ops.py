"""TorchOps attention against dense attention written out directly (numpy-style, float64)."""

from __future__ import annotations

import pytest
import torch

from ringllm.pipeline.ops import TorchOps, torch_ref


def dense_reference(q, k, v, q_start, scale, window=0):
    """q [Q, Hq, D] at positions q_start.., k/v [L, Hk, D]: causal attention in float64
    (window > 0: the query at p sees keys p - window + 1 .. p only)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    hidden = k_pos > q_pos
    if window:
        hidden |= k_pos <= q_pos - window
    scores.masked_fill_(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def fill_cache(num_blocks, num_kv_heads, block_size, head_size, contexts, gen):
    key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=gen)
    value_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=gen)
    max_blocks = max(-(-n // block_size) for n in contexts)
    perm = torch.randperm(num_blocks, generator=gen)[: len(contexts) * max_blocks]
    return key_cache, value_cache, perm.view(len(contexts), max_blocks).to(torch.int32)


def dense_kv(cache, blocks, length):
    return (
        cache[blocks.long()]
        .permute(0, 2, 1, 3)
        .reshape(-1, cache.shape[1], cache.shape[3])[:length]
    )


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_prefill_matches_dense_attention(batched, heads, monkeypatch):
    monkeypatch.setattr(torch_ref, "MAX_PREFILL_PADDING", 1.0 if batched else -1.0)
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads = heads
    contexts, q_lens = [9, 40, 17, 33], [9, 12, 1, 30]  # cached prefix = context - q_len
    key_cache, value_cache, tables = fill_cache(64, num_kv_heads, 8, 16, contexts, gen)
    query = torch.randn(sum(q_lens), num_heads, 16, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = TorchOps().paged_attention_prefill(
        query,
        key_cache,
        value_cache,
        tables,
        starts,
        torch.tensor(contexts, dtype=torch.int32),
        0.25,
    )
    for r, (n, q_len) in enumerate(zip(contexts, q_lens, strict=True)):
        k, v = dense_kv(key_cache, tables[r], n), dense_kv(value_cache, tables[r], n)
        ref = dense_reference(query[starts[r] : starts[r + 1]], k, v, n - q_len, 0.25)
        assert torch.allclose(out[starts[r] : starts[r + 1]].double(), ref, atol=1e-5)


def test_decode_matches_dense_attention():
    gen = torch.Generator().manual_seed(1)
    contexts = [1, 15, 16, 17, 70]
    key_cache, value_cache, tables = fill_cache(80, 2, 16, 32, contexts, gen)
    query = torch.randn(len(contexts), 6, 32, generator=gen)
    ops = TorchOps()
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    out = ops.paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, 0.2)
    again = ops.paged_attention_decode(
        query, key_cache, value_cache, tables, seq_lens, 0.2
    )  # per-step memo
    assert torch.equal(out, again)
    for r, n in enumerate(contexts):
        k, v = dense_kv(key_cache, tables[r], n), dense_kv(value_cache, tables[r], n)
        ref = dense_reference(query[r : r + 1], k, v, n - 1, 0.2)
        assert torch.allclose(out[r : r + 1].double(), ref, atol=1e-5)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("window", [1, 5, 19, 1000])
def test_a_sliding_window_sees_the_last_keys_only(batched, window, monkeypatch):
    """Prefill chunks after cached prefixes and decode, with a window smaller than a block,
    spanning blocks, and past every context (the same as none), against dense float64."""
    monkeypatch.setattr(torch_ref, "MAX_PREFILL_PADDING", 1.0 if batched else -1.0)
    gen = torch.Generator().manual_seed(3)
    contexts, q_lens = [9, 40, 17, 33], [9, 12, 1, 30]
    key_cache, value_cache, tables = fill_cache(64, 2, 8, 16, contexts, gen)
    query = torch.randn(sum(q_lens), 6, 16, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    ops = TorchOps()
    out = ops.paged_attention_prefill(
        query, key_cache, value_cache, tables, starts, seq_lens, 0.25, sliding_window=window
    )
    last = query[starts[1:] - 1]
    decoded = ops.paged_attention_decode(
        last, key_cache, value_cache, tables, seq_lens, 0.25, sliding_window=window
    )
    for r, (n, q_len) in enumerate(zip(contexts, q_lens, strict=True)):
        k, v = dense_kv(key_cache, tables[r], n), dense_kv(value_cache, tables[r], n)
        ref = dense_reference(query[starts[r] : starts[r + 1]], k, v, n - q_len, 0.25, window)
        assert torch.allclose(out[starts[r] : starts[r + 1]].double(), ref, atol=1e-5)
        assert torch.allclose(decoded[r].double(), ref[-1], atol=1e-5)
    with pytest.raises(ValueError, match="sliding_window: -1"):
        ops.paged_attention_decode(last, key_cache, value_cache, tables, seq_lens, 0.25, -1)
