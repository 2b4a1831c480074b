"""Torch reference ops: the numerics every other implementation is checked against.

They also are a complete CPU path (`RINGLLM_CPU_KERNELS=torch`, and the fallback of
`CpuOps`, pipeline/ops/cpu.py, for what its C kernels do not take), so they are vectorized
over the batch where it matters: decode attention is one batched matmul over the requests' gathered blocks; prefill
attention loops over the (few) requests that carry a prompt chunk; what every layer of a
step would derive again from the step's own tensors (rotary tables, gather indices,
masks) is derived once per step.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ringllm.cuda.swap_checks import check_swap_blocks
from ringllm.pipeline.ops import kv_int8

# Prefill chunks of several requests go through one padded attention call when padding
# them to the longest adds at most this fraction of wasted work; else one call each.
MAX_PREFILL_PADDING = 0.5


class TorchOps:
    name = "torch"

    def __init__(self) -> None:
        # Per-step derived tensors (rotary tables, gather indices, masks), computed by the
        # first layer of a step and reused by the others. Keyed by the identity of the
        # step's own tensors, which the memo holds, so a new step can never hit a stale entry.
        self._memo: dict[str, tuple[tuple[torch.Tensor, ...], object]] = {}

    def _per_step(self, name: str, inputs: tuple[torch.Tensor, ...], make):
        cached = self._memo.get(name)
        if (
            cached is not None
            and len(cached[0]) == len(inputs)
            and all(a is b for a, b in zip(cached[0], inputs, strict=True))
        ):
            return cached[1]
        value = make()
        self._memo[name] = (inputs, value)
        return value

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps)
        out = weight * h.to(x.dtype)
        return out if residual is None else (out, residual)

    def rotary_embedding(self, positions, query, key, cos_sin_cache):
        def tables():
            cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
            return torch.cat([cos, cos], dim=-1)[:, None, :], torch.cat([sin, sin], dim=-1)[
                :, None, :
            ]

        cos, sin = self._per_step("rotary", (positions, cos_sin_cache), tables)
        for x in _adjacent_heads(query, key) or (query, key):
            x.copy_(_rotate(x, cos, sin))

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def moe_experts(self, h, weights, experts, w_gate_up, w_down, activation="silu"):
        """The torch loop over the experts (models/moe.py's, on stacked dense experts): the
        pairs grouped by expert (a stable sort), each expert's rows through gate_up, the
        activation and down in h's dtype, scaled by their weights, added by `index_add_`."""
        act_and_mul = {"silu": self.silu_and_mul, "gelu_tanh": self.gelu_tanh_and_mul}[activation]

        def expert_mlp(e: int, x: torch.Tensor) -> torch.Tensor:
            return F.linear(act_and_mul(F.linear(x, w_gate_up[e])), w_down[e])

        return experts_loop(h, weights, experts, w_gate_up.shape[0], expert_mlp)

    def lora_apply(self, y, x, a_stack, b_stack, token_slots, parts=None):
        """Per slot in use (at most --max-loras a step): its rows gathered, the products
        in float32 (one shrink, one expand per part), the delta added with `index_copy_`;
        the grouping is made once a step."""
        parts, rank = parts or (y.shape[1],), b_stack.shape[1]
        for slot, rows in self._per_step(
            "lora_rows", (token_slots,), lambda: lora_rows(token_slots)
        ):
            a, b = a_stack[slot].float(), b_stack[slot].float()
            xs = x.float() if rows is None else x.index_select(0, rows).float()
            shrunk = xs @ a.T
            delta, first = [], 0
            for p, n in enumerate(parts):
                delta.append(shrunk[:, p * rank : (p + 1) * rank] @ b[:, first : first + n])
                first += n
            delta = delta[0] if len(delta) == 1 else torch.cat(delta, dim=1)
            if rows is None:  # every token of the step takes this adapter
                y.copy_((y.float() + delta).to(y.dtype))
            else:
                y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        if kv_int8.is_int8(key_cache):  # row by row: a block's scale may grow (kv_int8.py)
            kv_int8.write_rows(key_cache, key, slot_mapping)
            kv_int8.write_rows(value_cache, value, slot_mapping)
            return
        block_size = key_cache.shape[2]

        def slots():
            keep = slot_mapping >= 0
            keep = None if bool(keep.all()) else keep
            kept = slot_mapping if keep is None else slot_mapping[keep]
            return keep, kept // block_size, kept % block_size

        keep, blocks, offsets = self._per_step("slots", (slot_mapping,), slots)
        if keep is not None:
            key, value = key[keep], value[keep]
        # key_cache[b, :, o, :] = key[t] for every token t (advanced indexing on dims 0 and 2).
        key_cache[blocks, :, offsets, :] = key.to(key_cache.dtype)
        value_cache[blocks, :, offsets, :] = value.to(value_cache.dtype)

    def paged_attention_decode(
        self, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0
    ):
        check_sliding_window(sliding_window)
        num_reqs, num_heads, head_size = query.shape
        num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
        group = num_heads // num_kv_heads

        def layout():
            num_blocks = -(-int(seq_lens.max()) // block_size)
            index = block_tables[:, :num_blocks].long()
            positions = torch.arange(num_blocks * block_size, device=query.device)
            hidden = positions[None, :] >= seq_lens[:, None]  # [R, nb * bs]
            if sliding_window:  # the query at seq_len - 1 sees the last sliding_window keys
                hidden |= positions[None, :] < seq_lens[:, None] - sliding_window
            return num_blocks, index, hidden[:, None, None, :]

        num_blocks, index, hidden = self._per_step(
            f"decode{sliding_window}", (block_tables, seq_lens), layout
        )
        # NOTE: attention block by block, on the blocks as they lie in the cache: gathering
        # whole blocks is one contiguous copy each, and no [R, Hk, L, D] re-layout is made.
        # One query token per request, so a KV head's G query heads share its keys.
        # Products in the cache dtype (as transformers' eager attention computes them),
        # softmax in float32 over all of a request's blocks at once.
        # an 8-bit or 16-bit cache under wider activations: products in the query's dtype
        compute = _compute_dtype(query, key_cache)
        keys = _blocks(key_cache, index, compute)  # [R, nb, Hk, bs, D]
        values = _blocks(value_cache, index, compute)
        q = query.to(compute).view(num_reqs, 1, num_kv_heads, group, head_size)
        scores = torch.matmul(q, keys.transpose(-1, -2))  # [R, nb, Hk, G, bs]
        scores = (
            scores.permute(0, 2, 3, 1, 4).reshape(num_reqs, num_kv_heads, group, -1).float() * scale
        )
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)  # [R, Hk, G, nb * bs]
        probs = probs.view(num_reqs, num_kv_heads, group, num_blocks, block_size).permute(
            0, 3, 1, 2, 4
        )
        out = torch.matmul(probs, values).sum(dim=1)  # [R, nb, Hk, G, D] -> [R, Hk, G, D]
        return out.reshape(num_reqs, num_heads, head_size).to(query.dtype)

    def paged_attention_prefill(
        self,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        sliding_window=0,
    ):
        check_sliding_window(sliding_window)
        starts = query_start_loc.tolist()
        lens = seq_lens.tolist()
        if len(lens) > 1 and _padding_fraction(starts, lens) <= MAX_PREFILL_PADDING:
            return _batched_causal_attention(
                query, key_cache, value_cache, block_tables, starts, lens, scale, sliding_window
            )
        out = torch.empty_like(query)
        compute = _compute_dtype(query, key_cache)
        for r, seq_len in enumerate(lens):
            q = query[starts[r] : starts[r + 1]].to(compute)
            keys = _gather(key_cache, block_tables[r : r + 1], seq_len)[0].to(q.dtype)  # [Hk, L, D]
            values = _gather(value_cache, block_tables[r : r + 1], seq_len)[0].to(q.dtype)
            out[starts[r] : starts[r + 1]] = _causal_attention(
                q, keys, values, seq_len, scale, sliding_window
            )
        return out

    def copy_blocks(self, key_caches, value_caches, block_mapping):
        src, dst = block_mapping[:, 0], block_mapping[:, 1]
        for cache in (*key_caches, *value_caches):
            if kv_int8.is_int8(cache):
                kv_int8.copy_block_scales(cache, cache, src, dst)
            cache = bit_view(cache)
            cache[dst] = cache[src]

    def swap_blocks(self, src_caches, dst_caches, block_mapping, stream=None):
        mapping = check_swap_blocks(src_caches, dst_caches, block_mapping)
        if mapping.shape[0] == 0:
            return
        with _stream_context(stream):
            copy_swapped_blocks(src_caches, dst_caches, mapping)


def check_sliding_window(sliding_window: int) -> None:
    if sliding_window < 0:
        raise ValueError(
            f"sliding_window: {sliding_window} keys; a window is at least 1 key (0: no window)"
        )


def bit_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache itself, or for a float8 cache its bytes (torch's indexed copies have no
    float8 kernels; moving blocks never needs the values)."""
    return cache.view(torch.uint8) if cache.dtype is torch.float8_e4m3fn else cache


def copy_swapped_blocks(src_caches, dst_caches, mapping: torch.Tensor) -> None:
    """The reference copy of swap_blocks, on arguments check_swap_blocks passed: per cache,
    the blocks gathered, moved to the destination's device and scattered (index_select +
    index_copy_: ~1.7x faster than the same through advanced indexing); the block ids are
    moved once to each device that holds a cache."""
    ids: dict[torch.device, torch.Tensor] = {}  # [2, N]: src ids, dst ids

    def on(device: torch.device) -> torch.Tensor:
        if device not in ids:
            ids[device] = mapping.T.contiguous().to(device)
        return ids[device]

    for src_pair, dst_pair in zip(src_caches, dst_caches, strict=True):
        for src_cache, dst_cache in zip(src_pair, dst_pair, strict=True):
            src_cache, dst_cache = bit_view(src_cache), bit_view(dst_cache)
            blocks = src_cache.index_select(0, on(src_cache.device)[0])
            dst_cache.index_copy_(0, on(dst_cache.device)[1], blocks.to(dst_cache.device))
    copy_swapped_scales(src_caches, dst_caches, mapping)


def copy_swapped_scales(src_caches, dst_caches, mapping: torch.Tensor) -> None:
    """The scales of the swapped blocks of int8 caches (kv_int8.py), after their values."""
    if not kv_int8.is_int8(src_caches[0][0]):
        return
    for src_pair, dst_pair in zip(src_caches, dst_caches, strict=True):
        for src_cache, dst_cache in zip(src_pair, dst_pair, strict=True):
            kv_int8.copy_block_scales(src_cache, dst_cache, mapping[:, 0], mapping[:, 1])


def _stream_context(stream):
    """`with` this to run torch's CUDA work on `stream` (a torch.cuda.Stream, or a CuPy
    stream by its pointer); None: the current stream."""
    if stream is None:
        return contextlib.nullcontext()
    if not isinstance(stream, torch.cuda.Stream):
        if not isinstance(getattr(stream, "ptr", None), int):
            raise ValueError(
                f"swap_blocks: stream must be a torch.cuda.Stream or a CuPy stream, got "
                f"{type(stream).__name__}"
            )
        stream = torch.cuda.ExternalStream(stream.ptr)
    return torch.cuda.stream(stream)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX rotation of the two halves of the last dim, computed in float32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Cached tokens 0..length-1 of each request: [R, num_kv_heads, length, head_size]."""
    num_blocks = -(-length // cache.shape[2])
    return _gather_blocks(cache, block_tables[:, :num_blocks].long(), length)


def _compute_dtype(query: torch.Tensor, cache: torch.Tensor) -> torch.dtype:
    """What attention computes in: the query's dtype, or float32 over an int8 cache (its
    values are q * scale, kept unrounded as the C and CUDA kernels keep them)."""
    return torch.float32 if kv_int8.is_int8(cache) else query.dtype


def _blocks(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[index] as `dtype` values (an int8 cache's times their scales)."""
    if kv_int8.is_int8(cache):
        return kv_int8.dequantize_blocks(cache, index, dtype)
    return cache[index].to(dtype)


def _gather_blocks(cache: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:
    # NOTE: indexing the [Hk, num_blocks, bs, D] view copies the blocks straight into
    # [Hk, R, nb, bs, D] order, where (nb, bs) merge into one token axis without a second
    # copy; indexing the cache itself would give [R, nb, Hk, bs, D] and need one.
    blocks = cache.transpose(0, 1)[:, index]  # [Hk, R, nb, bs, D]
    if kv_int8.is_int8(cache):  # float32 values: the rows times their (block, head) scale
        scales = kv_int8.kv_scales(cache).transpose(0, 1)[:, index]  # [Hk, R, nb]
        blocks = blocks.float() * scales[..., None, None]
    hk, r, nb, bs, d = blocks.shape
    return blocks.permute(1, 0, 2, 3, 4).reshape(r, hk, nb * bs, d)[:, :, :length]


def _causal_attention(q, keys, values, seq_len, scale, sliding_window=0):
    """q [Q, Hq, D] (the last Q positions of seq_len) over keys/values [Hk, L, D]; with a
    sliding_window W > 0 the query at position p sees keys p - W + 1 .. p only."""
    q_len, num_heads, head_size = q.shape
    num_kv_heads = keys.shape[0]
    group = num_heads // num_kv_heads
    qh = q.float().view(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)  # [Hk, G, Q, D]
    scores = torch.matmul(qh, keys.float()[:, None].transpose(-1, -2)) * scale  # [Hk, G, Q, L]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    hidden = k_pos > q_pos
    if sliding_window:
        hidden |= k_pos <= q_pos - sliding_window
    scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.float()[:, None])  # [Hk, G, Q, D]
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size).to(q.dtype)


def _padding_fraction(starts: list[int], lens: list[int]) -> float:
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    padded = len(lens) * max(q_lens) * max(lens)
    used = sum(q * k for q, k in zip(q_lens, lens, strict=True))
    return 1.0 - used / padded


def _batched_causal_attention(
    query, key_cache, value_cache, block_tables, starts, lens, scale, sliding_window=0
):
    """Every request's chunk in one SDPA call: queries padded to the longest chunk, keys to
    the longest context, the G query heads of a KV head folded into the query axis."""
    num_tokens, num_heads, head_size = query.shape
    num_reqs, num_kv_heads = len(lens), key_cache.shape[1]
    group = num_heads // num_kv_heads
    dev = query.device
    q_lens = torch.tensor([starts[i + 1] - starts[i] for i in range(num_reqs)], device=dev)
    seq_lens = torch.tensor(lens, device=dev)
    max_q, max_len = int(q_lens.max()), int(seq_lens.max())
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs, device=dev), q_lens)
    slot = (
        torch.arange(num_tokens, device=dev) - torch.tensor(starts[:-1], device=dev)[req_of_token]
    )
    compute = _compute_dtype(query, key_cache)
    padded = query.new_zeros(num_reqs, max_q, num_heads, head_size, dtype=compute)
    padded[req_of_token, slot] = query
    # [R, Q, Hk, G, D] -> [R, Hk, G * Q, D]: row g * Q + i is query i of head g.
    q = padded.view(num_reqs, max_q, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_reqs, num_kv_heads, group * max_q, head_size)
    keys = _gather(key_cache, block_tables, max_len).to(compute)  # [R, Hk, L, D]
    values = _gather(value_cache, block_tables, max_len).to(compute)
    # Query i of request r sits at position seq_len - q_len + i and sees keys 0..that.
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=dev)[None, :]  # [R, Q]
    k_pos = torch.arange(max_len, device=dev)[None, None, :]
    visible = k_pos <= q_pos[:, :, None]  # [R, Q, L]
    if sliding_window:  # and from p - W + 1 only
        visible &= k_pos > q_pos[:, :, None] - sliding_window
    pad = torch.arange(max_q, device=dev)[None, :] >= q_lens[:, None]  # [R, Q]
    visible[:, :, 0] |= pad  # padding queries see one key, so no row is all -inf
    mask = visible[:, None, None].expand(num_reqs, 1, group, max_q, max_len)
    mask = mask.reshape(num_reqs, 1, group * max_q, max_len)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    out = out.view(num_reqs, num_kv_heads, group, max_q, head_size).permute(0, 3, 1, 2, 4)
    return out[req_of_token, slot].reshape(num_tokens, num_heads, head_size).to(query.dtype)


def _adjacent_heads(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor] | None:
    """query [T, Hq, D] and key [T, Hk, D] as one [T, Hq + Hk, D] view, when they are
    neighbouring slices of the rows of one fused qkv product (the models' layout), so the
    rotation runs once over both; None when they are separate tensors."""
    t, hq, d = query.shape
    if (
        key.dtype != query.dtype
        or key.shape[0] != t
        or key.shape[2] != d
        or query.stride() != key.stride()
        or query.stride()[1:] != (d, 1)
        or key.data_ptr() != query.data_ptr() + hq * d * query.element_size()
    ):
        return None
    return (query.as_strided((t, hq + key.shape[1], d), query.stride()),)


def experts_loop(h, weights, experts, num_experts: int, expert_mlp) -> torch.Tensor:
    """A sparse MLP's experts after routing, in torch: the (token, slot) pairs grouped by
    expert (a stable sort: tokens in order), `expert_mlp(e, rows)` over each expert's rows,
    scaled by their weights and added per token by `index_add_` (models/moe.py's loop and
    the reference `moe_experts`)."""
    out = torch.zeros_like(h)
    if experts.numel() == 0:
        return out
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // experts.shape[1]
    rows = h.index_select(0, tokens)
    outputs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            outputs.append(expert_mlp(e, rows[start : start + n]))
            start += n
    scaled = torch.cat(outputs) * weights.reshape(-1)[order].unsqueeze(1)
    return out.index_add_(0, tokens, scaled)


def lora_rows(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """Each LoRA slot a step uses with its token rows (int64; None: every token), slots
    in increasing order; tokens without an adapter (slot < 0) are in none."""
    slots = token_slots.tolist()
    used = sorted({s for s in slots if s >= 0})
    if len(used) == 1 and len(slots) and min(slots) == used[0]:
        return [(used[0], None)]
    return [(s, (token_slots == s).nonzero().reshape(-1)) for s in used]
