"""CPU kernels behind the ops interface: `CpuOps`, the default ops of the CPU device.

The hot ops of a layer run as C kernels (pipeline/ops/csrc/, the `cpu_kernels` extension)
instead of chains of torch ops: paged attention reads the cache blocks where they lie (no
gather of the keys into a contiguous copy), RMSNorm adds the residual in the same pass,
rotary works in place on q and k, SiLU*mul reads the fused gate|up rows once; swap_blocks
(between KV-cache tiers) is one memcpy per block and cache, any dtype. Each kernel
computes in float32 and rounds its output once, as the torch reference (`TorchOps`, which
defines the numerics and which these are tested against) rounds each op's output.

Float32, bfloat16 and float16 tensors whose last dimension is contiguous take the kernels;
anything else (other dtypes, odd layouts) falls back to `TorchOps`, which this class
extends. Matrix products stay in torch (oneDNN), as for every ops implementation.

Four kernel sets: portable C (any CPU), and on x86-64 the SIMD kernels compiled for AVX2 +
FMA + F16C (8 lanes), AVX-512 F/BW/VL/DQ (16 lanes) and AVX-512 with AVX512_BF16. Which
ones this CPU runs is asked of the CPU (pipeline/ops/cpu_features.py, capped by
RINGLLM_CPU_ISA); the fastest is the default, and the greedy sampler's argmax uses the same
set. `RINGLLM_CPU_KERNELS=avx512bf16|avx512|avx2|generic|torch` picks one for the process
(`torch`: no C kernels, `TorchOps` only); tests run every set the CPU has.

The kernels trust the sizes and pointers they get, so everything they index is checked
here first: index tensors once per step (their maxima against the cache and the position
tables), shapes and dtypes on every call.
"""

from __future__ import annotations

import functools
import itertools
import os
import weakref

import torch

# After torch, always: the extension's libgomp.so.1 then resolves to the copy torch loaded,
# so the kernels and torch's matrix products share one OpenMP thread pool.
from ringllm.pipeline.ops import cpu_kernels as _k
from ringllm.pipeline.ops.cpu_features import cpu_features
from ringllm.pipeline.ops.kv_int8 import has_scales, is_int8, scales_ptr
from ringllm.pipeline.ops.torch_ref import (
    TorchOps,
    _adjacent_heads,
    check_sliding_window,
    check_swap_blocks,
    copy_swapped_scales,
)

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# lora_apply: at most this many tokens go through the C kernel (per token, one dot product
# per rank row); more go through torch's products per slot (`ringllm bench lora`, Zen 3)
LORA_C_MAX_TOKENS = 64
# the KV cache may also be float8 e4m3fn (DT_FP8, csrc/cpu_ops.h) or int8 with its scales
# (DT_I8, kv_int8.py), under any activation dtype
CACHE_DTYPE_CODES = {**_DTYPES, torch.float8_e4m3fn: 3, torch.int8: 4}
ACT_SILU, ACT_GELU_TANH = 0, 1  # gated_act_args.act (csrc/cpu_ops.h)
ENV_KERNELS = "RINGLLM_CPU_KERNELS"
_MAX_GROUP = 64  # ATTN_MAX_ROWS: query heads per KV head the attention kernels take


def kernel_sets() -> tuple[str, ...]:
    """The kernel sets this CPU runs, slowest first: 'generic', then 'avx2', 'avx512' and
    'avx512bf16' as far as the CPU (and RINGLLM_CPU_ISA) allows."""
    return cpu_features().kernel_sets()


def default_kernel_set() -> str | None:
    """The set named by RINGLLM_CPU_KERNELS, else the fastest; None means `TorchOps` only."""
    wanted = os.environ.get(ENV_KERNELS, "").strip().lower()
    if wanted == "torch":
        return None
    if not wanted:
        return kernel_sets()[-1]
    if wanted not in kernel_sets():
        raise ValueError(
            f"{ENV_KERNELS}={wanted!r}: this CPU runs {', '.join(kernel_sets())} (or 'torch')"
        )
    return wanted


@functools.cache
def _argmax_set() -> int | None:
    """The kernel set index the sampler's argmax uses: the process's default set."""
    name = default_kernel_set()
    return None if name is None else _k.KERNEL_SETS.index(name)


def argmax_rows(x: torch.Tensor, kernel_set: str | None = None) -> torch.Tensor:
    """x.argmax(dim=-1) of a float32 [R, V] CPU tensor with contiguous rows, in one vectorized
    pass per row (torch's reduction takes ~4x longer at vocabulary widths); same result,
    ties and NaNs included. `kernel_set` defaults to the process's (torch's argmax when
    that is 'torch'). Anything else goes to torch."""
    index = _argmax_set() if kernel_set is None else _set_index(kernel_set)
    if index is None or not (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.stride(1) == 1
        and x.shape[1] > 0
    ):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _k.argmax(
        index,
        torch.get_num_threads(),
        out.data_ptr(),
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        x.stride(0),
    )
    return out


def draws_on_kernels() -> bool:
    """Whether the draw kernels (`exponential_rows`, `race_rows`, `top_p_rows`) run here:
    the process has C kernels (not RINGLLM_CPU_KERNELS=torch)."""
    return _argmax_set() is not None


def rows_on_kernels(x: torch.Tensor) -> bool:
    """Whether the draw kernels take `x` as it is: float32 [R, V] contiguous CPU rows, in a
    process that has the kernels."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.is_contiguous()
        and draws_on_kernels()
    )


def _rows_ok(x: torch.Tensor) -> bool:  # float32 [R, V] rows, each contiguous
    return x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0


def _per_row_ok(v: torch.Tensor | None, dtype: torch.dtype, rows: int) -> bool:
    return v is None or (v.dtype == dtype and v.shape == (rows,) and v.is_contiguous())


def _draw_set(fn: str, kernel_set: str | None) -> int:
    """The kernel set index a draw kernel runs on: `kernel_set`, else the process's."""
    index = _argmax_set() if kernel_set is None else _set_index(kernel_set)
    if index is None:
        raise ValueError(f"{fn}: no C kernels in this process ({ENV_KERNELS}=torch)")
    return index


def exponential_rows(out: torch.Tensor, keys: torch.Tensor, kernel_set: str | None = None) -> None:
    """Fills the float32 [R, V] CPU tensor `out` (contiguous rows) with Exp(1) draws, row r's
    from the stream keyed by keys[r] (int64 [R]): a SplitMix64 stream, 32 bits a draw, each
    draw a function of its key and column only (csrc/cpu_ops.h draw_bits), on the process's
    kernel set (`draws_on_kernels`) unless `kernel_set` names one."""
    if not (_rows_ok(out) and _per_row_ok(keys, torch.int64, out.shape[0])):
        raise ValueError(
            f"exponential_rows: want float32 [R, V] rows and int64 [R] keys, got "
            f"{out.dtype} {list(out.shape)} and {keys.dtype} {list(keys.shape)}"
        )
    _k.exponentials(
        _draw_set("exponential_rows", kernel_set),
        torch.get_num_threads(),
        out.data_ptr(),
        keys.data_ptr(),
        out.shape[0],
        out.shape[1],
        out.stride(0),
    )


def race_rows(
    logits: torch.Tensor,
    inv_temp: torch.Tensor,
    keys: torch.Tensor,
    kernel_set: str | None = None,
    min_score: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exponential race's token of each row of the float32 [R, V] CPU `logits`
    (contiguous rows): argmax_i p_i / E_i for p = softmax(logits[r] * inv_temp[r]) and E
    the draws `exponential_rows` writes for keys[r], in one pass (its Gumbel-max form; no
    softmax, no draws kept). `min_score` (float32 [R]): only tokens whose logits * inv_temp
    reach it race (the sampler's filters as thresholds). int64 [R]."""
    rows = logits.shape[0] if logits.dim() == 2 else -1
    if not (
        _rows_ok(logits)
        and _per_row_ok(inv_temp, torch.float32, rows)
        and _per_row_ok(keys, torch.int64, rows)
        and _per_row_ok(min_score, torch.float32, rows)
    ):
        raise ValueError(
            f"race_rows: want float32 [R, V] logits, float32 [R] inv_temp (and min_score) and "
            f"int64 [R] keys, got {list(logits.shape)} {logits.dtype}, {list(inv_temp.shape)} "
            f"{inv_temp.dtype}, {list(keys.shape)} {keys.dtype}"
        )
    out = torch.empty(rows, dtype=torch.int64)
    _k.race(
        _draw_set("race_rows", kernel_set),
        torch.get_num_threads(),
        out.data_ptr(),
        logits.data_ptr(),
        inv_temp.data_ptr(),
        keys.data_ptr(),
        rows,
        logits.shape[1],
        logits.stride(0),
        0 if min_score is None else min_score.data_ptr(),
    )
    return out


def top_p_rows(
    logits: torch.Tensor,
    top_p: torch.Tensor,
    floor: torch.Tensor | None = None,
    kernel_set: str | None = None,
) -> torch.Tensor:
    """Each row's top-p threshold on the float32 [R, V] CPU `logits` (contiguous rows), as
    float32 [R]: of the tokens at or above floor[r] (top-k's threshold; None: all), sorted
    descending, a token is kept while those before it hold under top_p[r] of their mass;
    the threshold is the last kept one's logit (its ties kept too). top_p >= 1: the floor.
    A radix selection on the logits' bits in C (csrc/cpu_ops.h top_p_args; the exponentials
    on the process's kernel set unless `kernel_set` names one), no sort."""
    rows = logits.shape[0] if logits.dim() == 2 else -1
    if not (
        _rows_ok(logits)
        and _per_row_ok(top_p, torch.float32, rows)
        and _per_row_ok(floor, torch.float32, rows)
    ):
        raise ValueError(
            f"top_p_rows: want float32 [R, V] logits and float32 [R] top_p / floor, got "
            f"{logits.dtype} {list(logits.shape)}, {top_p.dtype} {list(top_p.shape)}"
        )
    out = torch.empty(rows, dtype=torch.float32)
    _k.top_p(
        _draw_set("top_p_rows", kernel_set),
        torch.get_num_threads(),
        out.data_ptr(),
        logits.data_ptr(),
        top_p.data_ptr(),
        0 if floor is None else floor.data_ptr(),
        rows,
        logits.shape[1],
        logits.stride(0),
    )
    return out


def _set_index(kernel_set: str) -> int:
    if kernel_set not in kernel_sets():
        raise ValueError(f"kernel_set {kernel_set!r}: this CPU runs {', '.join(kernel_sets())}")
    return _k.KERNEL_SETS.index(kernel_set)


class CpuOps(TorchOps):
    name = "cpu"

    def __init__(self, kernel_set: str | None = None, threads: int | None = None) -> None:
        super().__init__()
        kernel_set = kernel_set or kernel_sets()[-1]
        self._set = _set_index(kernel_set)
        self.kernel_set = kernel_set
        self.threads = threads or torch.get_num_threads()
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        # id(key_cache) -> weak references to the (key, value) cache pair _cache_ok passed:
        # a tensor's shape, dtype and layout never change (nothing here resizes a cache),
        # so each layer's pair is checked once, not on every op of every step; weak, so a
        # freed cache (sleep mode) is not kept alive
        self._checked_caches: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        # attention on the AMX tile unit (csrc/attention_tiles.h: query rows and softmax
        # weights rounded to bfloat16), for a bfloat16 cache; set by the model loader only
        # where the matrix products round their activations as much
        # (worker/model_loader.py attention_tiles_here)
        self.attention_tiles = False

    def __repr__(self) -> str:
        tiles = ", attention on tiles" if self.attention_tiles else ""
        return f"CpuOps(kernel_set={self.kernel_set!r}, threads={self.threads}{tiles})"

    # ---- elementwise ------------------------------------------------------------------

    def rms_norm(self, x, weight, eps, residual=None):
        if (
            x.dim() == 2
            and x.is_cpu
            and x.is_contiguous()
            and weight.dtype is x.dtype
            and weight.is_contiguous()
            and weight.dim() == 1
            and weight.shape[0] == x.shape[1]
            and (residual is None or (residual.dtype is x.dtype and residual.shape == x.shape))
            and x.dtype in _DTYPES
        ):
            return self._rms_norm_rows(x, weight, eps, residual)
        dt = _DTYPES.get(x.dtype)
        if (
            dt is None
            or x.device.type != "cpu"
            or x.dim() not in (2, 3)
            or x.stride(-1) != 1
            or weight.dtype != x.dtype
            or weight.shape != (x.shape[-1],)
            or not weight.is_contiguous()
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))
        ):
            return super().rms_norm(x, weight, eps, residual)
        cols = x.shape[-1]
        if x.dim() == 2:
            rows, inner, x_outer, x_inner = x.shape[0], 1, x.stride(0), 0
        else:
            rows, inner = x.shape[0] * x.shape[1], x.shape[1]
            x_outer, x_inner = x.stride(0), x.stride(1)
        out = torch.empty(x.shape, dtype=x.dtype)
        res_in = res_out = None
        if residual is not None:
            res_in = residual.contiguous()
            res_out = torch.empty(x.shape, dtype=x.dtype)
        _k.rms_norm(
            self._set,
            self.threads,
            out.data_ptr(),
            x.data_ptr(),
            x_outer,
            x_inner,
            0 if res_in is None else res_in.data_ptr(),
            0 if res_out is None else res_out.data_ptr(),
            weight.data_ptr(),
            rows,
            inner,
            cols,
            dt,
            eps,
        )
        return out if residual is None else (out, res_out)

    def _rms_norm_rows(self, x, weight, eps, residual):
        """rms_norm of contiguous rows [R, H] (the decoder's every call): the general
        path's checks in one test, its work the same."""
        rows, cols = x.shape
        out = torch.empty((rows, cols), dtype=x.dtype)
        if residual is None:
            res_in = res_out = 0
        else:
            residual = residual.contiguous()
            res_out_t = torch.empty((rows, cols), dtype=x.dtype)
            res_in, res_out = residual.data_ptr(), res_out_t.data_ptr()
        _k.rms_norm(
            self._set, self.threads, out.data_ptr(), x.data_ptr(), cols, 0, res_in, res_out,
            weight.data_ptr(), rows, 1, cols, _DTYPES[x.dtype], eps,
        )  # fmt: skip
        return out if residual is None else (out, res_out_t)

    def rotary_embedding(self, positions, query, key, cos_sin_cache):
        dt = _DTYPES.get(query.dtype)
        head_size = query.shape[-1]
        if (
            dt is None
            or query.device.type != "cpu"
            or key.dtype != query.dtype
            or query.dim() != 3
            or key.dim() != 3
            or query.stride(-1) != 1
            or key.stride(-1) != 1
            or head_size % 2
            or key.shape[-1] != head_size
            or cos_sin_cache.dtype != torch.float32
            or not cos_sin_cache.is_contiguous()
            or cos_sin_cache.shape[-1] != head_size
            or positions.dtype != torch.int64
            or not positions.is_contiguous()
            or positions.shape != (query.shape[0],)
            or key.shape[0] != query.shape[0]
        ):
            return super().rotary_embedding(positions, query, key, cos_sin_cache)
        self._check_positions(positions, cos_sin_cache.shape[0])
        for x in _adjacent_heads(query, key) or (query, key):
            _k.rotary(
                self._set,
                self.threads,
                x.data_ptr(),
                x.stride(0),
                x.stride(1),
                positions.data_ptr(),
                cos_sin_cache.data_ptr(),
                x.shape[0],
                x.shape[1],
                head_size,
                dt,
            )

    def silu_and_mul(self, x):
        return self._gated_act(x, ACT_SILU) if self._gated_ok(x) else super().silu_and_mul(x)

    def gelu_tanh_and_mul(self, x):
        if not self._gated_ok(x):
            return super().gelu_tanh_and_mul(x)
        return self._gated_act(x, ACT_GELU_TANH)

    @staticmethod
    def _gated_ok(x) -> bool:
        return (
            x.dtype in _DTYPES
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.stride(1) == 1
            and x.shape[1] % 2 == 0
        )

    def _gated_act(self, x, act: int):
        rows, inter = x.shape[0], x.shape[1] // 2
        out = torch.empty((rows, inter), dtype=x.dtype)
        _k.gated_act(
            self._set, self.threads, out.data_ptr(), x.data_ptr(), x.stride(0), rows, inter,
            _DTYPES[x.dtype], act,
        )  # fmt: skip
        return out

    # ---- LoRA --------------------------------------------------------------------------

    def lora_apply(self, y, x, a_stack, b_stack, token_slots, parts=None):
        """The C kernel set's per-token shrink and expand (one call, no grouping by slot)
        for a few tokens (decode steps: the torch path's gathers and small products cost
        more than the arithmetic) of one supported dtype; else the torch path, whose
        products per slot run at BLAS speed on a prompt's many rows."""
        if not (
            x.shape[0] <= LORA_C_MAX_TOKENS
            and x.dtype in _DTYPES
            and y.dtype == a_stack.dtype == b_stack.dtype == x.dtype
            and x.device.type == "cpu"
            and x.dim() == y.dim() == 2
            and x.stride(1) == 1
            and y.stride(1) == 1
            and a_stack.is_contiguous()
            and b_stack.is_contiguous()
            and token_slots.dtype == torch.int32
            and token_slots.is_contiguous()
            and a_stack.shape[2] == x.shape[1]
            and b_stack.shape[2] == y.shape[1]
            and a_stack.shape[1] == len(parts or (0,)) * b_stack.shape[1]
            and len(parts or ()) <= 4
            and token_slots.shape[0] == x.shape[0] == y.shape[0]
        ):
            return super().lora_apply(y, x, a_stack, b_stack, token_slots, parts)
        m, n = y.shape
        ends = [int(e) for e in itertools.accumulate(parts or (n,))]
        _k.lora(
            self._set, self.threads, y.data_ptr(), x.data_ptr(), a_stack.data_ptr(),
            b_stack.data_ptr(), token_slots.data_ptr(), m, n, x.shape[1], a_stack.shape[1],
            b_stack.shape[1], x.stride(0), y.stride(0), _DTYPES[x.dtype],
            *ends, *[0] * (4 - len(ends)),
        )  # fmt: skip

    # ---- KV cache -----------------------------------------------------------------------

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        if not (
            self._caches_ok(key_cache, value_cache)
            and key.dtype == value.dtype
            and key.dtype in _DTYPES
            and key.dim() == value.dim() == 3
            and key.shape == value.shape
            and key.shape[1:] == (key_cache.shape[1], key_cache.shape[3])
            and key.stride(-1) == 1
            and value.stride(-1) == 1
            and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous()
            and slot_mapping.shape == (key.shape[0],)
        ):
            return super().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        num_blocks, kv_heads, block_size, head_size = key_cache.shape
        self._check_slots(slot_mapping, num_blocks * block_size)
        _k.cache_write(
            key.data_ptr(),
            value.data_ptr(),
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            slot_mapping.data_ptr(),
            key.shape[0],
            kv_heads,
            head_size,
            block_size,
            num_blocks,
            _DTYPES[key.dtype],
            CACHE_DTYPE_CODES[key_cache.dtype],
            scales_ptr(key_cache),
            scales_ptr(value_cache),
        )

    def swap_blocks(self, src_caches, dst_caches, block_mapping, stream=None):
        # NOTE: one memcpy per (cache, block pair) in C, over the threads: a block is a
        # contiguous run on both sides, so this moves each byte once, where torch's
        # index_select + index_copy_ moves it twice (2-3x slower on 256 blocks of 30 layers).
        caches = [c for pairs in (src_caches, dst_caches) for pair in pairs for c in pair]
        if any(c.device.type != "cpu" for c in caches):
            return super().swap_blocks(src_caches, dst_caches, block_mapping, stream)
        mapping = check_swap_blocks(src_caches, dst_caches, block_mapping)
        if mapping.shape[0] == 0:
            return
        pointers = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
        num_caches = 2 * len(src_caches)
        first = src_caches[0][0]
        _k.swap_blocks(
            self.threads,
            pointers.data_ptr(),
            pointers.data_ptr() + num_caches * pointers.element_size(),
            mapping.data_ptr(),
            num_caches,
            mapping.shape[0],
            first[0].numel() * first.element_size(),
        )
        copy_swapped_scales(src_caches, dst_caches, mapping)

    # ---- attention ----------------------------------------------------------------------

    def paged_attention_decode(
        self, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0
    ):
        check_sliding_window(sliding_window)
        if not self._attention_ok(query, key_cache, value_cache, block_tables, seq_lens):
            return super().paged_attention_decode(
                query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window
            )
        if seq_lens.shape != (query.shape[0],):
            raise ValueError(
                f"decode: {query.shape[0]} query tokens for {seq_lens.shape[0]} requests"
            )
        self._check_tables(block_tables, seq_lens, None, key_cache.shape)
        return self._attention(
            query, key_cache, value_cache, block_tables, None, seq_lens, scale, sliding_window
        )

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
        if not (
            self._attention_ok(query, key_cache, value_cache, block_tables, seq_lens)
            and query_start_loc.dtype == torch.int32
            and query_start_loc.is_contiguous()
            and query_start_loc.shape == (seq_lens.shape[0] + 1,)
        ):
            return super().paged_attention_prefill(
                query,
                key_cache,
                value_cache,
                block_tables,
                query_start_loc,
                seq_lens,
                scale,
                sliding_window,
            )
        self._check_tables(block_tables, seq_lens, query_start_loc, key_cache.shape)
        total = self._per_step(
            "prefill_total", (query_start_loc,), lambda: int(query_start_loc[-1])
        )
        if total != query.shape[0]:
            raise ValueError(
                f"prefill: query_start_loc covers {total} tokens, the query has {query.shape[0]}"
            )
        return self._attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            sliding_window,
        )

    def _attention_ok(self, query, key_cache, value_cache, block_tables, seq_lens) -> bool:
        return (
            self._caches_ok(key_cache, value_cache)
            and query.dtype in _DTYPES
            and query.dim() == 3
            and query.stride(-1) == 1
            and query.shape[2] == key_cache.shape[3]
            and query.shape[1] % key_cache.shape[1] == 0
            # a work item holds one KV head's query heads (of up to 64 rows, see cpu_ops.h)
            and query.shape[1] // key_cache.shape[1] <= _MAX_GROUP
            # the step's tables: every layer passes the same tensors
            and self._per_step(
                "attention_tables_ok",
                (block_tables, seq_lens),
                lambda: (
                    block_tables.dtype == torch.int32
                    and block_tables.dim() == 2
                    and block_tables.stride(1) == 1
                    and block_tables.shape[0] == seq_lens.shape[0]
                    and seq_lens.dtype == torch.int32
                    and seq_lens.is_contiguous()
                ),
            )
        )

    def _caches_ok(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
        """_cache_ok, remembered for the pair (see `_checked_caches`)."""
        seen = self._checked_caches.get(id(key_cache))
        if seen is not None and seen[0]() is key_cache and seen[1]() is value_cache:
            return True
        if not _cache_ok(key_cache, value_cache):
            return False
        self._checked_caches[id(key_cache)] = (weakref.ref(key_cache), weakref.ref(value_cache))
        return True

    def _attention(
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
        num_tokens, num_heads, head_size = query.shape
        out = torch.empty((num_tokens, num_heads, head_size), dtype=query.dtype)
        if num_tokens == 0:
            return out
        _k.attention(
            self._set,
            self.threads,
            out.data_ptr(),
            query.data_ptr(),
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            0 if query_start_loc is None else query_start_loc.data_ptr(),
            seq_lens.data_ptr(),
            seq_lens.shape[0],
            num_heads,
            key_cache.shape[1],
            head_size,
            key_cache.shape[2],
            _DTYPES[query.dtype],
            CACHE_DTYPE_CODES[key_cache.dtype],
            sliding_window,
            scales_ptr(key_cache),
            scales_ptr(value_cache),
            int(self.attention_tiles),
            scale,
        )
        return out

    # ---- bounds, checked once per step -------------------------------------------------

    def fused_step_ok(self, batch, num_blocks: int, block_size: int, max_positions: int):
        """For a caller that runs the attention, rotary and cache kernels of a step (its
        decodes, its prompt chunks or both) from C (models/decode_plan.py): False when the
        step's index tensors are not in the layouts those kernels take (the caller keeps the
        ops, which fall back to torch); ValueError, as the ops raise it, for an index
        outside the cache or the position table. The tables are checked in the decode and
        prefill halves the layer path's `paged_attention` passes."""
        m, r, nd = batch.num_tokens, batch.num_reqs, batch.num_decodes
        seq_lens = batch.seq_lens
        if not (_index_ok(batch.positions, torch.int64, m) and _index_ok(seq_lens, torch.int32, r)):
            return False
        chunks = r - nd
        if chunks and not _index_ok(batch.prefill_query_start_loc, torch.int32, chunks + 1):
            return False
        if batch.group_block_tables is not None:  # KV groups: every group's, one buffer each
            tables, slots = batch.group_block_tables, batch.group_slot_mapping
            if not (
                tables.dtype is torch.int32
                and tables.is_cpu
                and tables.dim() == 3
                and tables.shape[1] == r
                and tables.is_contiguous()
                and slots.dtype is torch.int64
                and slots.is_cpu
                and slots.shape == (tables.shape[0], m)
                and slots.is_contiguous()
            ):
                return False
        for group in batch.group_batches:
            tables = group.block_tables
            if not (
                _index_ok(group.slot_mapping, torch.int64, m)
                and tables.dtype is torch.int32
                and tables.is_cpu
                and tables.dim() == 2
                and tables.shape[0] == r
                and tables.stride(1) == 1
            ):
                return False
        self._check_positions(batch.positions, max_positions)
        shape = (num_blocks, 0, block_size, 0)
        if chunks:
            qsl = batch.prefill_query_start_loc
            total = self._per_step("prefill_total", (qsl,), lambda: int(qsl[-1]))
            if total != m - nd:
                raise ValueError(
                    f"prefill: query_start_loc covers {total} tokens, the query has {m - nd}"
                )
        for group in batch.group_batches:
            self._check_slots(group.slot_mapping, num_blocks * block_size)
            if nd:
                self._check_tables(group.decode_block_tables, batch.decode_seq_lens, None, shape)
            if chunks:
                self._check_tables(group.prefill_block_tables, batch.prefill_seq_lens, qsl, shape)
        return True

    def _check_positions(self, positions, max_positions: int) -> None:
        def check():
            if positions.numel() and (
                int(positions.min()) < 0 or int(positions.max()) >= max_positions
            ):
                raise ValueError(
                    f"rotary: positions {int(positions.min())}..{int(positions.max())} "
                    f"outside the table of {max_positions}"
                )
            return True

        self._per_step("check_positions", (positions,), check)

    def _check_slots(self, slot_mapping, num_slots: int) -> None:
        def check():
            if slot_mapping.numel() and int(slot_mapping.max()) >= num_slots:
                raise ValueError(
                    f"reshape_and_cache: slot {int(slot_mapping.max())} outside the cache "
                    f"({num_slots} slots)"
                )
            return True

        self._per_step("check_slots", (slot_mapping,), check)

    def _check_tables(self, block_tables, seq_lens, query_start_loc, cache_shape) -> None:
        inputs = (block_tables, seq_lens) + (() if query_start_loc is None else (query_start_loc,))

        def check():
            num_blocks, _, block_size, _ = cache_shape
            if seq_lens.numel() == 0:
                return True
            if int(seq_lens.min()) < 1:
                raise ValueError("attention: a request has no cached tokens (seq_len < 1)")
            needed = -(-int(seq_lens.max()) // block_size)
            if needed > block_tables.shape[1]:
                raise ValueError(
                    f"attention: a request of {int(seq_lens.max())} tokens needs {needed} "
                    f"blocks, the block table has {block_tables.shape[1]} columns"
                )
            used = block_tables[:, :needed]
            if int(used.min()) < 0 or int(used.max()) >= num_blocks:
                raise ValueError(
                    f"attention: block ids {int(used.min())}..{int(used.max())} outside the "
                    f"cache of {num_blocks} blocks"
                )
            if query_start_loc is not None:
                q_lens = query_start_loc[1:] - query_start_loc[:-1]
                if int(query_start_loc[0]) != 0 or bool((q_lens < 1).any()):
                    raise ValueError("attention: query_start_loc must start at 0 and increase")
                if bool((q_lens > seq_lens).any()):
                    raise ValueError("attention: a request has more new tokens than seq_len")
            return True

        name = "check_decode_tables" if query_start_loc is None else "check_prefill_tables"
        self._per_step(name, inputs, check)


def _index_ok(t: torch.Tensor, dtype: torch.dtype, length: int) -> bool:
    return t.dtype is dtype and t.is_cpu and t.is_contiguous() and t.shape == (length,)


def _cache_ok(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    return (
        key_cache.device.type == "cpu"
        and key_cache.dim() == 4
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and value_cache.shape == key_cache.shape
        and value_cache.dtype == key_cache.dtype
        and key_cache.dtype in CACHE_DTYPE_CODES
        and (not is_int8(key_cache) or has_scales(key_cache) and has_scales(value_cache))
    )
