"""The ops interface: the hot operations the models call, with three implementations.

`TorchOps` (pipeline/ops/torch_ref.py) runs anywhere and *defines the numerics*;
`CpuOps` (pipeline/ops/cpu.py) implements the same calls with C kernels on the CPU, and
`ringllm.cuda.ops.CudaOps` with CuPy RawKernels on a GPU. Model code
calls only this interface, so a kernel can replace a reference op without the model
noticing. Matrix products are not here: they stay in torch (cuBLAS / CPU BLAS).

Shapes use one flat token dimension T (the requests of a step concatenated, never padded):

    query            [T, num_heads, head_size]
    key, value       [T, num_kv_heads, head_size]
    positions        [T] int64              position of each token in its request
    slot_mapping     [T] int64              block_id * block_size + offset; -1 = do not write
    query_start_loc  [R + 1] int32          request r owns tokens query_start_loc[r]:[r+1]
    seq_lens         [R] int32              tokens in the cache for request r after this step
                                            (already cached prefix + this step's tokens)
    block_tables     [R, max_blocks] int32  block ids of request r, in order

KV-cache layout, per layer (one tensor for keys, one for values):

    key_cache[num_blocks, num_kv_heads, block_size, head_size]

    block b ─┬─ head 0: token 0 [head_size] | token 1 | ... | token block_size-1
             ├─ head 1: ...
             └─ ...

A (block, head) pair is one contiguous run of block_size * head_size elements, which is
what the decode kernel reads per step; token t of a request lives in block
block_tables[r][t // block_size] at offset t % block_size.

Query token i of request r sits at absolute position seq_lens[r] - query_len[r] + i and
attends (causally) to every cached token at a position <= its own; in a sliding-window
layer (`sliding_window` W > 0) only to the last W of those, its own included.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Ops(Protocol):
    name: str

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm over the last dim, statistics in float32.

        Without `residual`: returns norm(x) * weight.
        With `residual`: h = x + residual (in x's dtype); returns (norm(h) * weight, h).
        """
        ...

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> None:
        """Rotates query [T, Hq, D] and key [T, Hk, D] in place, GPT-NeoX style (halves).

        cos_sin_cache [max_positions, D] float32: cos in [:, :D/2], sin in [:, D/2:]
        (see pipeline/ops/rope.py, which also applies llama3 / linear scaling).
        """
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:]  ([T, I])."""
        ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2 * I] -> gelu(x[:, :I], approximate="tanh") * x[:, I:]  ([T, I]): GeGLU."""
        ...

    def moe_experts(
        self,
        h: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        activation: str = "silu",
    ) -> torch.Tensor:
        """Optional (TorchOps and CudaOps have it): a sparse MLP's experts after routing.

        h [T, H]; weights [T, k] in h's dtype and experts [T, k] int64 (each token's k
        experts, as MoeWeights.route gives them); w_gate_up [E, 2I, H] (each expert's gate
        rows, then its up rows) and w_down [E, H, I], dense, contiguous, in h's dtype.
        Returns out [T, H]:

            out[t] = sum over slots s of  weights[t, s] * w_down[e] . (act(g) * u),
                     e = experts[t, s],  g, u = the halves of w_gate_up[e] . h[t]

        act SiLU ("silu") or GELU with the tanh approximation ("gelu_tanh"); products in h's
        dtype (float32 accumulation), each result rounded as torch rounds a `linear`. T = 0
        gives [0, H]. A model calls it only where `fused_moe_experts` is true (CudaOps): on
        the CPU the C sparse MLP or the torch loop of models/moe.py run instead.
        """
        ...

    def lora_apply(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a_stack: torch.Tensor,
        b_stack: torch.Tensor,
        token_slots: torch.Tensor,
        parts: tuple[int, ...] | None = None,
    ) -> None:
        """Adds each token's LoRA adapter delta to y, in place (models/lora.py):

            u = a_stack[s] . x[t]                             [P * R]    s = token_slots[t]
            y[t, j] += u[p*R : (p+1)*R] . b_stack[s, :, j]    for j in part p; s < 0: untouched

        x [T, in] and y [T, out] in the activations' dtype (y may be a column slice of a
        wider output); y's columns are P consecutive `parts` (their sizes, summing to out;
        None: one part), e.g. q | k | v of a fused projection, each with its own adapter
        matrices. a_stack [S, P * R, in] (part p's A in rows p*R .. p*R + R) and b_stack
        [S, R, out] (each part's B transposed, in its columns) in x's dtype: slot s's
        adapter, ranks padded with zeros up to R, its scaling folded into b_stack;
        token_slots [T] int32. Both products accumulate in
        float32 and the delta is added to y in float32, rounded once to y's dtype.
        """
        ...

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Writes each token's key/value [T, Hk, D] into its cache slot (slot -1: skipped)."""
        ...

    def paged_attention_decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int = 0,
    ) -> torch.Tensor:
        """One query token per request: query [R, Hq, D] -> out [R, Hq, D].

        Request r attends to its seq_lens[r] cached tokens (its own new token included,
        which reshape_and_cache wrote first); with sliding_window W > 0, to the last W of
        them only (a sliding-window layer). GQA: query head h reads KV head
        h // (Hq // Hk).
        """
        ...

    def paged_attention_prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int = 0,
    ) -> torch.Tensor:
        """A chunk of new tokens per request, after a cached prefix: query [T, Hq, D] -> [T, Hq, D].

        Causal: query token i of request r (absolute position p = seq_lens[r] - q_len + i)
        attends to the cached tokens at positions 0..p, or with sliding_window W > 0 at
        positions max(0, p - W + 1)..p (transformers' and llama.cpp's window: W keys,
        its own included).
        """
        ...

    def copy_blocks(
        self,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        block_mapping: torch.Tensor,
    ) -> None:
        """For every layer, copies block src to block dst for each row (src, dst) of block_mapping [N, 2]."""
        ...

    def swap_blocks(
        self,
        src_caches: list[tuple[torch.Tensor, torch.Tensor]],
        dst_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_mapping: torch.Tensor,
        stream: object | None = None,
    ) -> None:
        """Copies whole blocks between two KV-cache tiers, all layers' keys and values at once.

        src_caches, dst_caches: one (key_cache, value_cache) pair per layer, as many layers on
        each side; every cache contiguous, of one dtype and one [num_kv_heads, block_size,
        head_size] per block, with each side's own number of blocks (e.g. 1,000 on the device,
        4,000 in host memory). block_mapping: int64 [N, 2], rows (src block, dst block), on the
        CPU (one on a device is read back first); no dst block twice. For every layer and row,
        dst_caches[l][i][dst] = src_caches[l][i][src], bit for bit. N = 0 copies nothing.
        A cache may not be on both sides (copy_blocks copies within one).

        The sides may lie on different devices: a CUDA device and pinned host memory (either
        way), two CPU pools, or one device. Everything is checked before any byte moves;
        a bad call raises ValueError naming what is wrong.

        stream: on CUDA, the stream the copy runs on (a torch.cuda.Stream or a CuPy stream;
        None: the current one), so it can overlap a step; the call returns once the copy is
        queued, and the caller orders it with an event and keeps both sides alive until it
        is done. Where there are no streams (the CPU) the copy is done when the call returns.
        """
        ...
