"""`CudaOps`: the ops interface (pipeline/ops/interface.py) on the project's CUDA kernels.

Same method names, shapes and numerics as `TorchOps`; every call launches kernels from
the `.cu` sources beside this file. Tensors go to the kernels as pointers (`data_ptr()`,
no copies) when their layout is the one the kernel reads; otherwise a contiguous copy
is made (and, for the in-place rotary op, copied back).

The backend is chosen at construction:

    CudaOps()                       # "cupy": CUDA tensors, cupy.RawModule, torch's stream
    CudaOps(backend="emulator")     # CPU tensors, the same .cu text through emulator.py

so the wrapper code tested on the CPU is the code that runs on the GPU.

Decode attention has two launch plans. The single-pass plan runs one CTA per
(KV head, request) over the whole context. The partitioned plan splits contexts longer
than `partition_tokens` across CTAs and combines them with a reduce kernel; "auto" takes
it when the single-pass grid would be too small to fill the GPU. With a sliding window
both plans cover the window only: the kernels start at its first key, so the partitions
needed are those of min(context, window) tokens. Preconditions the
kernels rely on and do not check: positions < cos_sin_cache rows, block ids < num_blocks,
copy_blocks destinations are not also sources. (That block tables are wide enough for
seq_lens is checked: it costs nothing, the max is read anyway. swap_blocks, called a few
times a step at most, checks everything its kernel trusts on the host first.)

An int8 KV cache (--kv-cache-dtype int8, pipeline/ops/kv_int8.py) carries one float32
scale per (block, KV head) right after its values; the kernels take the scales as a
pointer of their own, and block copies move them after the values (`copy_block_scales`).
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import torch

from ringllm.cuda.loader import KernelLoader
from ringllm.cuda.swap_checks import check_swap_blocks

DTYPE_SUFFIXES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
PARTITION_MODES = ("auto", "always", "never")
MAX_SHARED_BYTES = 48 * 1024  # CUDA's default dynamic shared memory limit per CTA
ATTENTION_THREADS = 128
# "auto" partitions decode only when the single-pass grid has fewer CTAs than this
# (a few per SM on current GPUs): below it, long contexts leave SMs idle.
MIN_SINGLE_PASS_CTAS = 256
INT32_MAX = 2**31 - 1
# moe.cu's `int gelu` flag, by the name moe_experts takes.
MOE_ACTIVATIONS = {"silu": np.int32(0), "gelu_tanh": np.int32(1)}
MOE_WARPS = 4  # per CTA of the gate_up and down kernels: one (pair, column) dot product each
MAX_GRID_Y = 65535  # CUDA's limit on a grid's y dimension
MOE_GROUP_THREADS = 256  # at most: the grouping's one CTA, one segment of pairs per thread
LORA_SHRINK_WARPS = 4  # per CTA of lora_shrink: one (token, rank row) dot product each
LORA_EXPAND_THREADS = 128  # at most, per CTA of lora_expand: one (token, column) each
INT8_SCALE_BYTES = 4  # an int8 cache's float32 scale per (block, KV head), after its values
INT8_WRITE_WARPS = 8  # at most, per CTA of the int8 cache write: one (cache, head) per warp


def _suffix(x: torch.Tensor) -> str:
    if x.dtype not in DTYPE_SUFFIXES:
        raise ValueError(f"CudaOps supports float32, float16 and bfloat16 tensors, got {x.dtype}")
    return DTYPE_SUFFIXES[x.dtype]


def _block_suffix(cache: torch.Tensor) -> str:
    """Block copies move elements: a float8 or int8 cache's are bytes ("u8"; an int8
    cache's scales then move by copy_block_scales)."""
    return "u8" if cache.dtype in (torch.float8_e4m3fn, torch.int8) else _suffix(cache)


def _int8_scales(cache: torch.Tensor, what: str) -> torch.Tensor:
    """The float32 [num_blocks, kv_heads] scales behind an int8 cache's values, a view (the
    layout of pipeline/ops/kv_int8.py's `new_cache` / `kv_scales`, restated here because
    cuda/ imports nothing of pipeline/). Refused where they are not there: the kernels read
    and write past the values blindly."""
    storage = cache.untyped_storage()
    if (
        cache.dim() != 4
        or cache.storage_offset() != 0
        or not cache.is_contiguous()
        or cache.numel() % INT8_SCALE_BYTES
        or storage.nbytes() != cache.numel() + INT8_SCALE_BYTES * cache.shape[0] * cache.shape[1]
    ):
        raise ValueError(
            f"{what}: an int8 cache of shape {tuple(cache.shape)} must be a KV cache made by "
            "kv_int8.new_cache (contiguous [num_blocks, kv_heads, block_size, head_size], its "
            "float32 scales right after its values)"
        )
    scales = torch.empty(0, dtype=torch.float32, device=cache.device)
    return scales.set_(storage, cache.numel() // INT8_SCALE_BYTES, tuple(cache.shape[:2]))


def _scales_args(key_cache: torch.Tensor, value_cache: torch.Tensor, what: str) -> tuple:
    """The attention kernels' (key_scales, value_scales) for int8 caches; () for others."""
    if key_cache.dtype != torch.int8:
        return ()
    return _int8_scales(key_cache, what), _int8_scales(value_cache, what)


def _threads_for(items: int, limit: int = 512) -> int:
    """A block size that is a multiple of 32, covers `items` if it can, at most `limit`."""
    return min(limit, max(32, -(-items // 32) * 32))


def _heads_layout(x: torch.Tensor, what: str) -> torch.Tensor:
    """x [T, H, D] as the kernels read it: heads contiguous within a token, any token stride."""
    if x.dim() != 3:
        raise ValueError(f"{what} must be [tokens, heads, head_size], got shape {tuple(x.shape)}")
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _cache_suffix(x: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str:
    """The kernel suffix for activations x over these caches: x's own ("f32"...) when the
    caches hold x's dtype, "<x's>_fp8" over float8 e4m3fn caches (--kv-cache-dtype fp8),
    "<x's>_i8" over int8 ones (--kv-cache-dtype int8, whose kernels take the scales too)."""
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache must have the key cache's dtype {key_cache.dtype}, got {value_cache.dtype}"
        )
    if key_cache.dtype == torch.float8_e4m3fn:
        return f"{_suffix(x)}_fp8"
    if key_cache.dtype == torch.int8:
        return f"{_suffix(x)}_i8"
    _same_dtype(x, key_cache=key_cache)
    return _suffix(x)


def _same_dtype(reference: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != reference.dtype:
            raise ValueError(
                f"{name} must have dtype {reference.dtype} like the input, got {t.dtype}"
            )


def _check_table_capacity(max_seq_len: int, block_tables: torch.Tensor, block_size: int) -> None:
    """The kernels read block_tables blindly: a context longer than its table would read
    block ids (and then cache rows) out of bounds, so it is refused here."""
    capacity_tokens = block_tables.shape[1] * block_size
    if max_seq_len > capacity_tokens:
        raise ValueError(
            f"seq_lens reaches {max_seq_len} tokens but block_tables holds "
            f"{block_tables.shape[1]} blocks of {block_size} = {capacity_tokens} tokens per request"
        )


def _window_arg(sliding_window: int) -> np.int32:
    """The kernels' `int sliding_window`. A window past int32 covers every context the
    kernels can index, as 0 (no window) does, so it is clamped rather than refused."""
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 tokens (0: no window), got {sliding_window}")
    return np.int32(min(sliding_window, INT32_MAX))


def _check_moe(h, weights, experts, w_gate_up, w_down, activation) -> None:
    """What moe.cu reads blindly: shapes, dtypes, one device, contiguous expert stacks."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(MOE_ACTIVATIONS)}, got {activation!r}")
    if h.dim() != 2:
        raise ValueError(f"h must be [tokens, hidden_size], got shape {tuple(h.shape)}")
    _suffix(h)
    num_tokens, hidden_size = h.shape
    if experts.dim() != 2 or experts.shape[0] != num_tokens or experts.dtype != torch.int64:
        raise ValueError(
            f"experts must be int64 [{num_tokens}, top_k] (torch.topk's indices), got "
            f"{experts.dtype} {tuple(experts.shape)}"
        )
    if weights.shape != experts.shape:
        raise ValueError(
            f"weights must be [{num_tokens}, {experts.shape[1]}] like experts, got "
            f"{tuple(weights.shape)}"
        )
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2 or w_gate_up.shape[2] != hidden_size:
        raise ValueError(
            f"w_gate_up must be [experts, 2 * intermediate_size, {hidden_size}], got shape "
            f"{tuple(w_gate_up.shape)}"
        )
    num_experts, intermediate_size = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if tuple(w_down.shape) != (num_experts, hidden_size, intermediate_size):
        raise ValueError(
            f"w_down must be [{num_experts}, {hidden_size}, {intermediate_size}] "
            f"(experts, hidden_size, intermediate_size), got shape {tuple(w_down.shape)}"
        )
    _same_dtype(h, weights=weights, w_gate_up=w_gate_up, w_down=w_down)
    others = {"weights": weights, "experts": experts, "w_gate_up": w_gate_up, "w_down": w_down}
    for name, t in others.items():
        if t.device != h.device:
            raise ValueError(f"{name} is on {t.device}, h on {h.device}: put them on one device")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous (the experts stacked once, not copied every call)"
            )
    if max(hidden_size, intermediate_size) > MAX_GRID_Y * MOE_WARPS:
        raise ValueError(
            f"moe_experts: hidden_size {hidden_size} or intermediate_size {intermediate_size} "
            f"exceeds {MAX_GRID_Y * MOE_WARPS} columns (a grid's y dimension of "
            f"{MAX_GRID_Y} CTAs of {MOE_WARPS} columns)"
        )
    if experts.numel() > INT32_MAX:
        raise ValueError(
            f"moe_experts: {experts.numel()} (token, expert) pairs exceed the kernels' int32 "
            f"limit of {INT32_MAX}; split the batch"
        )


def _check_lora(y, x, a_stack, b_stack, token_slots, parts) -> None:
    """What lora.cu reads blindly: shapes, dtypes, one device, contiguous adapter stacks."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, in_features], got shape {tuple(x.shape)}")
    _suffix(x)
    num_tokens, in_features = x.shape
    if y.dim() != 2 or y.shape[0] != num_tokens:
        raise ValueError(
            f"y must be [{num_tokens}, out_features] (a row per token of x), got shape "
            f"{tuple(y.shape)}"
        )
    if token_slots.dtype != torch.int32 or tuple(token_slots.shape) != (num_tokens,):
        raise ValueError(
            f"token_slots must be int32 [{num_tokens}] (a LoRA slot per token, -1: none), got "
            f"{token_slots.dtype} {tuple(token_slots.shape)}"
        )
    if a_stack.dim() != 3 or a_stack.shape[2] != in_features:
        raise ValueError(
            f"a_stack must be [slots, rank, {in_features}] (slots, max rank, in_features), got "
            f"shape {tuple(a_stack.shape)}"
        )
    num_slots, width, out_features = a_stack.shape[0], a_stack.shape[1], y.shape[1]
    num_parts = len(parts or (out_features,))
    if not 1 <= num_parts <= 4 or sum(parts or (out_features,)) != out_features:
        raise ValueError(
            f"parts: {parts} must be 1 to 4 sizes summing to y's {out_features} columns"
        )
    if width % num_parts or tuple(b_stack.shape) != (num_slots, width // num_parts, out_features):
        raise ValueError(
            f"b_stack must be [{num_slots}, {width // num_parts}, {out_features}] (slots, "
            f"a_stack's {width} rows over {num_parts} parts, out_features), got shape "
            f"{tuple(b_stack.shape)}"
        )
    rank = width
    _same_dtype(x, y=y, a_stack=a_stack, b_stack=b_stack)
    others = {"y": y, "a_stack": a_stack, "b_stack": b_stack, "token_slots": token_slots}
    for name, t in others.items():
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: put them on one device")
    for name, t in (("a_stack", a_stack), ("b_stack", b_stack)):
        if not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous (the adapters stacked once, not copied every call)"
            )
    if rank > MAX_GRID_Y * LORA_SHRINK_WARPS or out_features > MAX_GRID_Y * LORA_EXPAND_THREADS:
        raise ValueError(
            f"lora_apply: rank {rank} exceeds {MAX_GRID_Y * LORA_SHRINK_WARPS} rows or "
            f"out_features {out_features} exceeds {MAX_GRID_Y * LORA_EXPAND_THREADS} columns "
            f"(a grid's y dimension of {MAX_GRID_Y} CTAs)"
        )


def decode_tile_tokens(num_groups: int, head_size: int) -> int:
    """Largest key tile whose decode shared memory fits in 48 KiB."""
    for tile in (64, 32, 16, 8):
        floats = (
            2 * num_groups * head_size + tile * (head_size + 1) + num_groups * tile + 3 * num_groups
        )
        if 4 * floats <= MAX_SHARED_BYTES:
            return tile
    raise ValueError(
        f"decode attention: {num_groups} query heads per KV head x head_size {head_size} do not "
        f"fit the kernel's shared memory ({MAX_SHARED_BYTES} bytes)"
    )


def decode_shared_bytes(num_groups: int, head_size: int, tile: int) -> int:
    return 4 * (
        2 * num_groups * head_size + tile * (head_size + 1) + num_groups * tile + 3 * num_groups
    )


def prefill_tiles(head_size: int) -> tuple[int, int, int]:
    """(q_tile, k_tile, shared bytes): the largest tiles that fit in 48 KiB."""
    for q_tile, k_tile in ((16, 32), (16, 16), (8, 16), (8, 8)):
        floats = (
            2 * q_tile * head_size + k_tile * (2 * head_size + 1) + q_tile * k_tile + 3 * q_tile
        )
        if 4 * floats <= MAX_SHARED_BYTES:
            return q_tile, k_tile, 4 * floats
    raise ValueError(f"prefill attention: head_size {head_size} does not fit in shared memory")


class CudaOps:
    name = "cuda"

    def __init__(
        self,
        backend: str = "cupy",
        thread_order: str = "forward",
        partition_tokens: int = 512,
        partition_mode: str = "auto",
    ):
        if partition_tokens < 1:
            raise ValueError(f"partition_tokens must be >= 1 token, got {partition_tokens}")
        if partition_mode not in PARTITION_MODES:
            raise ValueError(
                f"partition_mode must be one of {PARTITION_MODES}, got {partition_mode!r}"
            )
        self.loader = KernelLoader(backend, thread_order)
        self.partition_tokens = partition_tokens
        self.partition_mode = partition_mode

    # ---- elementwise and normalisation ----

    def rms_norm(self, x, weight, eps, residual=None):
        _same_dtype(x, weight=weight)
        hidden_size = x.shape[-1]
        rows = x.contiguous().view(-1, hidden_size)
        out = torch.empty_like(rows)
        block = (_threads_for(hidden_size),)
        tail = (weight.contiguous(), np.int32(hidden_size), np.float32(eps))
        if residual is None:
            if rows.shape[0] > 0:
                self.loader.kernel("norm", f"rms_norm_{_suffix(x)}")(
                    (rows.shape[0],), block, (out, rows, *tail)
                )
            return out.view(x.shape)
        _same_dtype(x, residual=residual)
        residual_rows = residual.contiguous().view(-1, hidden_size)
        residual_out = torch.empty_like(rows)
        if rows.shape[0] > 0:
            kernel = self.loader.kernel("norm", f"fused_add_rms_norm_{_suffix(x)}")
            kernel((rows.shape[0],), block, (out, residual_out, rows, residual_rows, *tail))
        return out.view(x.shape), residual_out.view(x.shape)

    def silu_and_mul(self, x):
        return self._gated_act(x, "silu_and_mul")

    def gelu_tanh_and_mul(self, x):
        return self._gated_act(x, "gelu_tanh_and_mul")

    def _gated_act(self, x, name: str):
        intermediate_size = x.shape[-1] // 2
        rows = x.contiguous().view(-1, 2 * intermediate_size)
        out = torch.empty(rows.shape[0], intermediate_size, dtype=x.dtype, device=x.device)
        if rows.shape[0] > 0:
            kernel = self.loader.kernel("activation", f"{name}_{_suffix(x)}")
            kernel(
                (rows.shape[0],),
                (_threads_for(intermediate_size),),
                (out, rows, np.int32(intermediate_size)),
            )
        return out.view(*x.shape[:-1], intermediate_size)

    def rotary_embedding(self, positions, query, key, cos_sin_cache):
        _same_dtype(query, key=key)
        q, k = _heads_layout(query, "query"), _heads_layout(key, "key")
        num_tokens, num_heads, head_size = q.shape
        if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.shape[-1] != head_size:
            raise ValueError(
                f"cos_sin_cache must be float32 [max_positions, {head_size}], got "
                f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}"
            )
        if num_tokens > 0:
            kernel = self.loader.kernel("rotary", f"rotary_embedding_{_suffix(query)}")
            args = (
                positions.to(torch.int64).contiguous(),
                q,
                k,
                cos_sin_cache.contiguous(),
                np.int64(q.stride(0)),
                np.int64(k.stride(0)),
                np.int32(num_heads),
                np.int32(k.shape[1]),
                np.int32(head_size),
            )
            kernel(
                (num_tokens,), (_threads_for((num_heads + k.shape[1]) * head_size // 2, 256),), args
            )
        for original, rotated in ((query, q), (key, k)):
            if rotated is not original:
                original.copy_(rotated)

    # ---- KV cache ----

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        _same_dtype(key, value=value)
        suffix = _cache_suffix(key, key_cache, value_cache)
        for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
            if not cache.is_contiguous():
                raise ValueError(
                    f"{name} must be contiguous [num_blocks, kv_heads, block_size, head_size]"
                )
        k, v = _heads_layout(key, "key"), _heads_layout(value, "value")
        num_tokens, num_kv_heads, head_size = k.shape
        scales = _scales_args(key_cache, value_cache, "reshape_and_cache")
        if num_tokens == 0:
            return
        kernel = self.loader.kernel("cache_ops", f"reshape_and_cache_{suffix}")
        args = (
            k,
            v,
            key_cache,
            value_cache,
            *scales,
            slot_mapping.to(torch.int64).contiguous(),
            np.int64(k.stride(0)),
            np.int64(v.stride(0)),
            np.int32(num_kv_heads),
            np.int32(head_size),
            np.int32(key_cache.shape[2]),
        )
        if scales:  # int8: a warp per (cache, head) of each run of tokens in one block
            warps = min(2 * num_kv_heads, INT8_WRITE_WARPS)
            kernel((num_tokens,), (32 * warps,), args)
            return
        kernel((num_tokens,), (_threads_for(num_kv_heads * head_size, 256),), args)

    def copy_blocks(self, key_caches, value_caches, block_mapping):
        caches = [*key_caches, *value_caches]
        if not caches or block_mapping.shape[0] == 0:
            return
        first = caches[0]
        for cache in caches:
            if (
                cache.dtype != first.dtype
                or cache.shape != first.shape
                or not cache.is_contiguous()
            ):
                raise ValueError(
                    "copy_blocks needs contiguous caches of one dtype and shape; got "
                    f"{cache.dtype} {tuple(cache.shape)} next to {first.dtype} {tuple(first.shape)}"
                )
        if first.dtype == torch.int8:
            for cache in caches:
                _int8_scales(cache, "copy_blocks")
        pointers = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).to(first.device)
        mapping = block_mapping.to(device=first.device, dtype=torch.int64).contiguous()
        block_elems = first[0].numel()
        kernel = self.loader.kernel("cache_ops", f"copy_blocks_{_block_suffix(first)}")
        grid = (mapping.shape[0], len(caches))
        kernel(grid, (_threads_for(block_elems, 256),), (pointers, mapping, np.int64(block_elems)))
        if first.dtype == torch.int8:  # then the blocks' scales, within each cache
            self._copy_block_scales(grid, pointers, pointers, mapping, first, first)

    def _copy_block_scales(self, grid, src_pointers, dst_pointers, mapping, src, dst):
        """An int8 cache's scales of the mapped blocks (cache_ops.cu: copy_block_scales),
        after their values; src, dst: a cache of each side (their block counts place the
        scales)."""
        num_kv_heads = src.shape[1]
        kernel = self.loader.kernel("cache_ops", "copy_block_scales")
        args = (
            src_pointers, dst_pointers, mapping, np.int64(src.numel()), np.int64(dst.numel()),
            np.int32(num_kv_heads),
        )  # fmt: skip
        kernel(grid, (_threads_for(num_kv_heads, 128),), args)

    def swap_blocks(self, src_caches, dst_caches, block_mapping, stream=None):
        """Blocks between two sets of caches (the interface's contract) in one launch: grid
        (pairs, layers x {keys, values}), one CTA per block copy, 16 bytes a load where every
        cache's address and the block size allow it. A CPU side must be pinned memory, which
        the kernel reaches through unified addressing (int8 caches: a second launch moves
        the blocks' scales). The pointer table's upload and the launches go on `stream`;
        the call returns before the copy is done."""
        mapping = check_swap_blocks(src_caches, dst_caches, block_mapping)
        if not src_caches:
            return
        first = src_caches[0][0]
        suffix = _block_suffix(first)
        if first.dtype == torch.int8:
            for side in (src_caches, dst_caches):
                for pair in side:
                    for cache in pair:
                        _int8_scales(cache, "swap_blocks")
        device = self._swap_device(src_caches, dst_caches)
        if mapping.shape[0] == 0:
            return
        caches = [c for side in (src_caches, dst_caches) for pair in side for c in pair]
        block_bytes = first[0].numel() * first.element_size()
        vectorized = block_bytes % 16 == 0 and all(c.data_ptr() % 16 == 0 for c in caches)
        name, block_units = (
            ("swap_blocks_b16", block_bytes // 16)
            if vectorized
            else (f"swap_blocks_{suffix}", first[0].numel())
        )
        kernel = self.loader.kernel("cache_ops", name)
        # One table, one upload: every cache's address (the src side's, then the dst side's),
        # then the pairs. Pinned, so the upload is asynchronous on the stream too.
        on_gpu = device.type == "cuda"
        table = torch.empty(len(caches) + mapping.numel(), dtype=torch.int64, pin_memory=on_gpu)
        table[: len(caches)] = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
        table[len(caches) :] = mapping.view(-1)
        n = 2 * len(src_caches)  # caches per side
        with self._swap_stream(stream, device):
            table = table.to(device, non_blocking=True)
            args = (table[:n], table[n : 2 * n], table[2 * n :], np.int64(block_units))
            kernel((mapping.shape[0], n), (_threads_for(block_units, 256),), args)
            if first.dtype == torch.int8:  # then the blocks' scales, on the same stream
                grid, dst = (mapping.shape[0], n), dst_caches[0][0]
                self._copy_block_scales(grid, *args[:3], first, dst)

    def _swap_device(self, src_caches, dst_caches) -> torch.device:
        """The device the swap kernel runs on: the emulator's is the CPU; on CuPy, the one
        CUDA device of the CUDA caches, the CPU caches being pinned."""
        caches = [
            (f"{side}[{layer}] {name} cache", cache)
            for side, pairs in (("src_caches", src_caches), ("dst_caches", dst_caches))
            for layer, pair in enumerate(pairs)
            for name, cache in zip(("key", "value"), pair, strict=True)
        ]
        if self.loader.backend == "emulator":
            for where, cache in caches:
                if cache.device.type != "cpu":
                    raise ValueError(
                        f"swap_blocks: {where} is on {cache.device}; the emulator takes CPU tensors"
                    )
            return torch.device("cpu")
        for where, cache in caches:
            if cache.device.type == "cpu" and not cache.is_pinned():
                raise ValueError(
                    f"swap_blocks: {where} is in pageable CPU memory; the kernel reads and "
                    "writes host memory only where it is pinned (allocate it with "
                    "pin_memory=True)"
                )
            if cache.device.type not in ("cpu", "cuda"):
                raise ValueError(f"swap_blocks: {where} is on {cache.device}, not CUDA or CPU")
        devices = {cache.device for _, cache in caches if cache.device.type == "cuda"}
        if len(devices) != 1:
            raise ValueError(
                f"swap_blocks: the caches must include CUDA ones, all on one device; got "
                f"{sorted(map(str, devices)) or 'none'} (CPU <-> CPU: CpuOps or TorchOps)"
            )
        return devices.pop()

    def _swap_stream(self, stream, device: torch.device):
        """`with` this to queue work on `stream` (a torch.cuda.Stream, or a CuPy stream by its
        pointer; None: the current one). Emulated launches are synchronous: no stream."""
        if self.loader.backend == "emulator":
            return contextlib.nullcontext()
        if stream is None:
            return torch.cuda.stream(torch.cuda.current_stream(device))
        if not isinstance(stream, torch.cuda.Stream):
            if not isinstance(getattr(stream, "ptr", None), int):
                raise ValueError(
                    "swap_blocks: stream must be a torch.cuda.Stream or a CuPy stream, got "
                    f"{type(stream).__name__}"
                )
            stream = torch.cuda.ExternalStream(stream.ptr, device=device)
        if stream.device != device:
            raise ValueError(
                f"swap_blocks: the stream is on {stream.device}, the CUDA caches on {device}"
            )
        return torch.cuda.stream(stream)

    # ---- mixture of experts ----

    fused_moe_experts = True  # MoeWeights.forward hands its dense experts to moe_experts

    def moe_group(self, experts, num_experts: int):
        """moe.cu's counting sort of the (token, slot) pairs of experts [T, k] int64 by expert:
        (counts [E], offsets [E + 1], sorted_pairs [T * k], pair_positions [T * k]), int32;
        pair p = t * k + slot, tokens in order within an expert (see moe.cu's layouts)."""
        if experts.dtype != torch.int64:
            raise ValueError(f"experts must be int64 (torch.topk's indices), got {experts.dtype}")
        num_pairs = experts.numel()
        threads = _threads_for(num_pairs, MOE_GROUP_THREADS)
        ints = torch.empty(
            threads * num_experts + 2 * num_experts + 1 + 2 * num_pairs,
            dtype=torch.int32,
            device=experts.device,
        )
        sizes = (threads * num_experts, num_experts, num_experts + 1, num_pairs, num_pairs)
        segment_counts, counts, offsets, sorted_pairs, pair_positions = ints.split(sizes)
        kernel = self.loader.kernel("moe", "moe_group_pairs")
        args = (
            counts, offsets, sorted_pairs, pair_positions, segment_counts, experts.contiguous(),
            np.int32(num_pairs), np.int32(num_experts),
        )  # fmt: skip
        kernel((1,), (threads,), args)
        return counts, offsets, sorted_pairs, pair_positions

    def moe_experts(self, h, weights, experts, w_gate_up, w_down, activation="silu"):
        """The experts of a sparse MLP after routing (the interface's contract), in four
        launches of moe.cu: group the pairs by expert (one CTA), gate_up and the activation
        (a warp per (pair, intermediate column)), down (a warp per (pair, hidden column)),
        then each token's weighted sum over its slots (a thread per (token, column))."""
        _check_moe(h, weights, experts, w_gate_up, w_down, activation)
        num_tokens, hidden_size = h.shape
        num_experts, intermediate_size = w_gate_up.shape[0], w_gate_up.shape[1] // 2
        top_k, num_pairs = experts.shape[1], experts.numel()
        if num_pairs == 0:
            return torch.zeros_like(h)
        suffix = _suffix(h)
        x, experts = h.contiguous(), experts.contiguous()
        _, _, sorted_pairs, pair_positions = self.moe_group(experts, num_experts)
        # act [N, I] and y [N, H] in the element type, rows in sorted order: one allocation.
        scratch = torch.empty(
            num_pairs * (intermediate_size + hidden_size), dtype=h.dtype, device=h.device
        )
        act = scratch[: num_pairs * intermediate_size]
        y = scratch[num_pairs * intermediate_size :]
        block, sizes = (MOE_WARPS * 32,), (np.int32(hidden_size), np.int32(intermediate_size))
        gate_up = self.loader.kernel("moe", f"moe_gate_up_{suffix}")
        gate_up_args = (act, x, w_gate_up, experts, sorted_pairs, np.int32(top_k), *sizes)
        gate_up(
            (num_pairs, -(-intermediate_size // MOE_WARPS)),
            block,
            (*gate_up_args, MOE_ACTIVATIONS[activation]),
        )
        down = self.loader.kernel("moe", f"moe_down_{suffix}")
        down_args = (y, act, w_down, experts, sorted_pairs, *sizes)
        down((num_pairs, -(-hidden_size // MOE_WARPS)), block, down_args)
        out = torch.empty_like(x)
        combine = self.loader.kernel("moe", f"moe_combine_{suffix}")
        combine(
            (num_tokens,),
            (_threads_for(hidden_size, 256),),
            (out, y, weights.contiguous(), pair_positions, np.int32(top_k), np.int32(hidden_size)),
        )
        return out

    # ---- LoRA adapters ----

    def lora_apply(self, y, x, a_stack, b_stack, token_slots, parts=None):
        """Each token's LoRA delta added to y in place (the interface's contract), in two
        launches of lora.cu with no grouping by slot: shrink (a warp per (token, rank row),
        into a float32 scratch [T, R]), then expand (a thread per (token, output column),
        adding to y and rounding once). y and x are read at their row strides; a y whose
        columns are not contiguous goes through a copy. A slot >= S adds nothing."""
        _check_lora(y, x, a_stack, b_stack, token_slots, parts)
        num_tokens, in_features = x.shape
        num_slots, rank, out_features = a_stack.shape[0], a_stack.shape[1], y.shape[1]
        part_rank = b_stack.shape[1]
        ends = [int(e) for e in itertools.accumulate(parts or (out_features,))]
        ends = (ends + [out_features] * 3)[:3]  # the first three ends (a fourth part: the rest)
        if num_tokens == 0 or num_slots == 0 or rank == 0 or out_features == 0:
            return  # no delta: y + 0 rounds to y
        suffix = _suffix(x)
        rows = x if x.stride(1) == 1 else x.contiguous()
        out = y if y.stride(1) == 1 else y.contiguous()
        slots = token_slots.contiguous()
        sizes = (np.int32(num_slots), np.int32(rank))
        shrunk = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
        shrink = self.loader.kernel("lora", f"lora_shrink_{suffix}")
        shrink(
            (num_tokens, -(-rank // LORA_SHRINK_WARPS)),
            (LORA_SHRINK_WARPS * 32,),
            (shrunk, rows, a_stack, slots, np.int64(rows.stride(0)), *sizes, np.int32(in_features)),
        )
        threads = _threads_for(out_features, LORA_EXPAND_THREADS)
        expand = self.loader.kernel("lora", f"lora_expand_{suffix}")
        expand(
            (num_tokens, -(-out_features // threads)),
            (threads,),
            (
                out,
                shrunk,
                b_stack,
                slots,
                np.int64(out.stride(0)),
                *sizes,
                np.int32(part_rank),
                np.int32(out_features),
                *(np.int32(e) for e in ends),
            ),
        )
        if out is not y:
            y.copy_(out)

    # ---- attention ----

    def paged_attention_decode(
        self, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0
    ):
        window = _window_arg(sliding_window)
        cache_suffix = _cache_suffix(query, key_cache, value_cache)
        q = query.contiguous()
        num_reqs, num_heads, head_size = q.shape
        num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        out = torch.empty_like(q)
        if num_reqs == 0:
            return out
        groups = num_heads // num_kv_heads
        tile = decode_tile_tokens(groups, head_size)
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        max_seq_len = int(lens.max())
        _check_table_capacity(max_seq_len, tables, block_size)
        max_attended = min(max_seq_len, int(window)) if window > 0 else max_seq_len
        num_partitions = self._decode_partitions(max_attended, num_reqs * num_kv_heads)
        partition_tokens = self.partition_tokens if num_partitions > 1 else 0
        if num_partitions > 1:
            partial_out = torch.empty(
                num_reqs, num_heads, num_partitions, head_size, dtype=torch.float32, device=q.device
            )
            partial_max = torch.empty(
                num_reqs, num_heads, num_partitions, dtype=torch.float32, device=q.device
            )
            partial_sum = torch.empty_like(partial_max)
        else:
            partial_out = partial_max = partial_sum = torch.empty(
                1, dtype=torch.float32, device=q.device
            )
        suffix = _suffix(query)
        scales = _scales_args(key_cache, value_cache, "paged_attention_decode")
        args = (
            out, partial_out, partial_max, partial_sum, q, key_cache, value_cache, *scales, tables,
            lens, np.float32(scale), window, np.int32(num_heads), np.int32(num_kv_heads),
            np.int32(head_size), np.int32(block_size), np.int32(tables.shape[1]), np.int32(tile),
            np.int32(partition_tokens),
        )  # fmt: skip
        decode = self.loader.kernel("paged_attention", f"paged_attention_decode_{cache_suffix}")
        grid = (num_kv_heads, num_reqs, num_partitions)
        decode(
            grid,
            (ATTENTION_THREADS,),
            args,
            shared_mem=decode_shared_bytes(groups, head_size, tile),
        )
        if num_partitions > 1:
            reduce = self.loader.kernel("paged_attention", f"paged_attention_reduce_{suffix}")
            reduce_args = (
                out, partial_out, partial_max, partial_sum, lens, window, np.int32(head_size),
                np.int32(partition_tokens), np.int32(num_partitions),
            )  # fmt: skip
            reduce(
                (num_heads, num_reqs),
                (_threads_for(head_size, 128),),
                reduce_args,
                shared_mem=4 * num_partitions,
            )
        return out

    def _decode_partitions(self, max_attended: int, single_pass_ctas: int) -> int:
        """max_attended: the most keys one request attends to (its window, if it has one)."""
        num_partitions = -(-max_attended // self.partition_tokens)
        if self.partition_mode == "never" or num_partitions <= 1:
            return 1
        if self.partition_mode == "auto" and single_pass_ctas >= MIN_SINGLE_PASS_CTAS:
            return 1
        if 4 * num_partitions > MAX_SHARED_BYTES:
            raise ValueError(
                f"decode: {num_partitions} partitions of {self.partition_tokens} tokens exceed the "
                f"reduce kernel's limit of {MAX_SHARED_BYTES // 4}; raise partition_tokens"
            )
        return num_partitions

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
        window = _window_arg(sliding_window)
        cache_suffix = _cache_suffix(query, key_cache, value_cache)
        q = query.contiguous()
        num_tokens, num_heads, head_size = q.shape
        num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        out = torch.empty_like(q)
        starts = query_start_loc.to(torch.int32).contiguous()
        if num_tokens == 0 or starts.shape[0] < 2:
            return out
        max_query_len = int((starts[1:] - starts[:-1]).max())
        lens = seq_lens.to(torch.int32).contiguous()
        _check_table_capacity(int(lens.max()), block_tables, block_size)
        q_tile, k_tile, shared_bytes = prefill_tiles(head_size)
        tables = block_tables.to(torch.int32).contiguous()
        scales = _scales_args(key_cache, value_cache, "paged_attention_prefill")
        args = (
            out, q, key_cache, value_cache, *scales, tables, starts, lens,
            np.float32(scale), window, np.int32(num_heads), np.int32(num_kv_heads),
            np.int32(head_size), np.int32(block_size), np.int32(tables.shape[1]), np.int32(q_tile),
            np.int32(k_tile),
        )  # fmt: skip
        grid = (-(-max_query_len // q_tile), starts.shape[0] - 1, num_heads)
        kernel = self.loader.kernel("prefill_attention", f"paged_attention_prefill_{cache_suffix}")
        kernel(grid, (ATTENTION_THREADS,), args, shared_mem=shared_bytes)
        return out
