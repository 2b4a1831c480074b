"""The model runner: owns the model and its paged KV cache, and runs one step at a time.

A step is a list of `RunnerRequest`s (the tokens each request computes now, how many of
its tokens are already cached, its block ids). The runner lays them out as one flat
`ForwardBatch` (decodes first, see pipeline/models/forward_batch.py), runs the model, and
returns float32 logits for the rows the caller asked for: the last token of a request
(to sample from), every token (for prompt logprobs), or none (a prompt chunk that does
not reach the end of its prompt yet).

KV cache: one (key, value) pair of tensors per layer, each
[num_blocks, num_kv_heads, block_size, head_size], sized from a byte budget (CPU) or from
a fraction of the device memory left after the weights (GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.models.forward_batch import ForwardBatch
from ringllm.pipeline.ops import get_ops
from ringllm.pipeline.worker.model_loader import load_model

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
LOGITS_NONE, LOGITS_LAST, LOGITS_ALL = "none", "last", "all"


@dataclass
class RunnerRequest:
    token_ids: Sequence[int]  # the tokens computed in this step
    num_computed_tokens: int  # tokens of this request already in the KV cache
    block_ids: Sequence[int]  # the request's blocks, in order (enough for the new tokens)
    logits: str = LOGITS_LAST


@dataclass
class StepLogits:
    logits: torch.Tensor  # [N, vocab] float32, rows grouped by request in the caller's order
    row_starts: list[int]  # request i owns rows row_starts[i]:row_starts[i + 1]

    def rows(self, i: int) -> torch.Tensor:
        return self.logits[self.row_starts[i] : self.row_starts[i + 1]]


class ModelRunner:
    def __init__(self, config: EngineConfig, comm=None) -> None:
        self.config = config
        self.device = config.device.resolve()
        if config.device.num_threads:
            torch.set_num_threads(config.device.num_threads)
        self.ops = get_ops(self.device)
        loaded = load_model(config.model, self.device, self.ops, comm=comm)
        self.model = loaded.model
        self.arch = loaded.arch
        self.model_path = loaded.path
        self.dtype = loaded.dtype
        self.max_model_len = loaded.max_model_len
        self.block_size = config.cache.block_size
        if self.device == "cpu":
            _log_cpu_choices(self.ops, self.model, self.dtype)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0

    # ---- KV cache ------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        m = self.model
        per_layer = 2 * m.num_kv_heads * self.block_size * m.head_dim * self.dtype.itemsize
        return per_layer * self.arch.num_hidden_layers

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device == "cuda":
            free, _total = torch.cuda.mem_get_info()
            budget = int(free * cache.gpu_memory_utilization)
        else:
            budget = cache.kv_cache_memory_bytes or CPU_DEFAULT_KV_BYTES
        num_blocks = budget // self.kv_bytes_per_block
        # More blocks than every sequence slot filled twice over buys nothing but memory.
        useful = (
            2 * self.config.scheduler.max_num_seqs * (-(-self.max_model_len // self.block_size))
        )
        num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes: {budget} bytes hold no KV block "
                f"(one block needs {self.kv_bytes_per_block} bytes)"
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        shape = (num_blocks, m.num_kv_heads, self.block_size, m.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.arch.num_hidden_layers)
        ]
        self.num_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_bytes_per_block / 2**20,
        )

    # ---- one step ------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, requests: Sequence[RunnerRequest]) -> StepLogits:
        if not requests:
            raise ValueError("a step needs at least one request")
        if any(len(r.token_ids) == 0 for r in requests):
            raise ValueError("a request in the step has no tokens to compute")
        order = _decodes_first(requests)
        batch, rows = self._build_batch([requests[i] for i in order])
        hidden = self.model.forward(batch, self.kv_caches)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        # Rows come out in batch order; put them back in the caller's order.
        pos_of = np.empty(len(order), dtype=np.int64)
        pos_of[order] = np.arange(len(order))
        batch_starts = np.concatenate([[0], np.cumsum(rows)])
        perm = np.concatenate([np.arange(batch_starts[p], batch_starts[p + 1]) for p in pos_of])
        counts = [rows[p] for p in pos_of]
        if not np.array_equal(perm, np.arange(len(perm))):
            logits = logits[torch.from_numpy(perm).to(logits.device)]
        return StepLogits(
            logits=logits, row_starts=np.concatenate([[0], np.cumsum(counts)]).tolist()
        )

    def _build_batch(self, requests: Sequence[RunnerRequest]) -> tuple[ForwardBatch, list[int]]:
        bs = self.block_size
        num_reqs = len(requests)
        q_lens = np.fromiter((len(r.token_ids) for r in requests), dtype=np.int64, count=num_reqs)
        starts = np.fromiter(
            (r.num_computed_tokens for r in requests), dtype=np.int64, count=num_reqs
        )
        seq_lens = starts + q_lens
        if int(seq_lens.max(initial=0)) > self.max_model_len:
            raise ValueError(
                f"a request reaches {int(seq_lens.max())} tokens, over max_model_len {self.max_model_len}"
            )
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        max_blocks = int(-(-seq_lens.max(initial=1) // bs))
        block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        input_ids = np.empty(num_tokens, dtype=np.int64)
        for i, r in enumerate(requests):
            n = min(len(r.block_ids), max_blocks)
            block_tables[i, :n] = np.asarray(r.block_ids[:n], dtype=np.int32)
            input_ids[query_start_loc[i] : query_start_loc[i + 1]] = r.token_ids
        req_of_token = np.repeat(np.arange(num_reqs), q_lens)
        positions = starts[req_of_token] + (np.arange(num_tokens) - query_start_loc[req_of_token])
        slot_mapping = (
            block_tables[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        )
        logits_indices, rows = _logits_rows(requests, query_start_loc)
        num_decodes = int(np.argmax(q_lens != 1)) if (q_lens != 1).any() else num_reqs
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.from_numpy(input_ids).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            num_decodes=num_decodes,
            logits_indices=torch.from_numpy(logits_indices).to(dev),
        )
        return batch, rows


def _log_cpu_choices(ops, model, dtype) -> None:
    """One line of what was asked of the CPU and chosen (ringllm cpu-info has the rest)."""
    from ringllm.pipeline.models.linear import layout
    from ringllm.pipeline.ops.cpu_features import cpu_features

    cpu = cpu_features()
    layer = getattr(model, "layers", None)
    logger.info(
        "CPU %s: level %s%s, kernels %s, dtype %s, matrices %s, %d threads",
        cpu.model_name,
        cpu.isa,
        f" (capped from {cpu.hardware_isa})" if cpu.capped else "",
        getattr(ops, "kernel_set", ops.name),
        str(dtype).removeprefix("torch."),
        layout(layer[0].qkv) if layer else "-",
        torch.get_num_threads(),
    )


def _decodes_first(requests: Sequence[RunnerRequest]) -> list[int]:
    """Batch order: one-token requests first (stable), then the chunks."""
    decodes = [i for i, r in enumerate(requests) if len(r.token_ids) == 1]
    others = [i for i, r in enumerate(requests) if len(r.token_ids) != 1]
    return decodes + others


def _logits_rows(
    requests: Sequence[RunnerRequest], query_start_loc: np.ndarray
) -> tuple[np.ndarray, list[int]]:
    parts, rows = [], []
    for i, r in enumerate(requests):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if r.logits == LOGITS_LAST:
            parts.append(np.array([end - 1]))
        elif r.logits == LOGITS_ALL:
            parts.append(np.arange(start, end))
        elif r.logits == LOGITS_NONE:
            parts.append(np.zeros(0, dtype=np.int64))
        else:
            raise ValueError(f"logits: {r.logits!r} is not one of none, last, all")
        rows.append(len(parts[-1]))
    indices = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    return indices, rows
