"""Torch reference ops: the numerics every other implementation is checked against.

They also are the CPU path, so they are vectorized over the batch where it matters:
decode attention is one batched matmul over the requests' gathered blocks; prefill
attention loops over the (few) requests that carry a prompt chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    name = "torch"

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(x.dtype)
        return out if residual is None else (out, residual)

    def rotary_embedding(self, positions, query, key, cos_sin_cache):
        cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        for x in (query, key):
            x.copy_(_rotate(x, cos, sin))

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        block_size = key_cache.shape[2]
        blocks = slot_mapping // block_size
        offsets = slot_mapping % block_size
        # key_cache[b, :, o, :] = key[t] for every token t (advanced indexing on dims 0 and 2).
        key_cache[blocks, :, offsets, :] = key.to(key_cache.dtype)
        value_cache[blocks, :, offsets, :] = value.to(value_cache.dtype)

    def paged_attention_decode(self, query, key_cache, value_cache, block_tables, seq_lens, scale):
        num_reqs, num_heads, head_size = query.shape
        max_len = int(seq_lens.max())
        keys = _gather(key_cache, block_tables, max_len)  # [R, Hk, L, D]
        values = _gather(value_cache, block_tables, max_len)
        num_kv_heads = keys.shape[1]
        # NOTE: one query token per request, so a KV head's G query heads can ride in the
        # query-length slot: [R, Hk, G, D] against [R, Hk, L, D]. That is one fused SDPA
        # call (float accumulation, no float copies of the keys and values), with no
        # causal mask: every query of request r sees its first seq_lens[r] keys.
        q = query.view(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_size)
        visible = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible[:, None, None, :], scale=scale
        )  # [R, Hk, G, D]
        return out.reshape(num_reqs, num_heads, head_size)

    def paged_attention_prefill(
        self, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale
    ):
        out = torch.empty_like(query)
        starts = query_start_loc.tolist()
        lens = seq_lens.tolist()
        for r, seq_len in enumerate(lens):
            q = query[starts[r] : starts[r + 1]]
            keys = _gather(key_cache, block_tables[r : r + 1], seq_len)[0]  # [Hk, L, D]
            values = _gather(value_cache, block_tables[r : r + 1], seq_len)[0]
            out[starts[r] : starts[r + 1]] = _causal_attention(q, keys, values, seq_len, scale)
        return out

    def copy_blocks(self, key_caches, value_caches, block_mapping):
        src, dst = block_mapping[:, 0], block_mapping[:, 1]
        for cache in (*key_caches, *value_caches):
            cache[dst] = cache[src]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX rotation of the two halves of the last dim, computed in float32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]
    return (xf * cos + rotated * sin).to(x.dtype)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Cached tokens 0..length-1 of each request: [R, num_kv_heads, length, head_size]."""
    block_size = cache.shape[2]
    num_blocks = -(-length // block_size)
    blocks = cache[block_tables[:, :num_blocks].long()]  # [R, nb, Hk, bs, D]
    r, nb, hk, bs, d = blocks.shape
    return blocks.permute(0, 2, 1, 3, 4).reshape(r, hk, nb * bs, d)[:, :, :length]


def _causal_attention(q, keys, values, seq_len, scale):
    """q [Q, Hq, D] (the last Q positions of seq_len) over keys/values [Hk, L, D]."""
    q_len, num_heads, head_size = q.shape
    num_kv_heads = keys.shape[0]
    group = num_heads // num_kv_heads
    qh = q.float().view(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)  # [Hk, G, Q, D]
    scores = torch.matmul(qh, keys.float()[:, None].transpose(-1, -2)) * scale  # [Hk, G, Q, L]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    scores.masked_fill_(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.float()[:, None])  # [Hk, G, Q, D]
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size).to(q.dtype)
