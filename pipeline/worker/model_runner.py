"""The model runner: owns the model and its paged KV cache, and runs one step at a time.

A step is a list of `RunnerRequest`s (the tokens each request computes now, how many of
its tokens are already cached, its block ids). The runner lays them out as one flat
`ForwardBatch` (decodes first, see pipeline/models/forward_batch.py), runs the model, and
returns float32 logits for the rows the caller asked for: the last token of a request
(to sample from), every token (for prompt logprobs), or none (a prompt chunk that does
not reach the end of its prompt yet).

KV cache: one (key, value) pair of tensors per layer, each
[num_blocks, num_kv_heads, block_size, head_size], sized from a byte budget (CPU) or from
a fraction of the device memory left after the weights (GPU). With KV groups (a model
with sliding-window layers under an engine: pipeline/core/kv_groups.py) one pair per
slot, the layers of a slot sharing it, each with its group's block table.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ringllm.pipeline.child_process import tune_malloc
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.core.kv_groups import engine_kv_groups, single_group
from ringllm.pipeline.core.scheduler_output import NewRequestData
from ringllm.pipeline.messages import SLEEP_LEVELS, wake_bits, wake_tags
from ringllm.pipeline.models.forward_batch import ForwardBatch
from ringllm.pipeline.ops import get_ops, kv_int8
from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.worker.input_batch import InputBatch, StepInputs
from ringllm.pipeline.worker.model_loader import load_model
from ringllm.pipeline.worker.sleep import OffloadedWeights, release_memory

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
LOGITS_NONE, LOGITS_LAST, LOGITS_ALL = "none", "last", "all"


@dataclass
class RunnerRequest:
    token_ids: Sequence[int]  # the tokens computed in this step
    num_computed_tokens: int  # tokens of this request already in the KV cache
    block_ids: Sequence[int]  # the request's blocks, in order (enough for the new tokens)
    logits: str = LOGITS_LAST
    lora_id: int = 0  # the LoRA adapter it runs with (add_lora); 0: the base model


@dataclass
class StepLogits:
    logits: torch.Tensor  # [N, vocab] float32, rows grouped by request in the caller's order
    row_starts: list[int]  # request i owns rows row_starts[i]:row_starts[i + 1]

    def rows(self, i: int) -> torch.Tensor:
        return self.logits[self.row_starts[i] : self.row_starts[i + 1]]


class ModelRunner:
    def __init__(self, config: EngineConfig, comm=None, stage=None, hybrid_kv=False) -> None:
        """`comm`: the tensor-parallel group; `stage`: one pipeline stage of the model
        (models/stages.py; None: the whole model)."""
        self.config = config
        self.stage = stage
        # a step's large tensors stay in the heap, not faulted in afresh every step
        tune_malloc()
        self.device = config.device.resolve()
        if config.device.num_threads:
            torch.set_num_threads(config.device.num_threads)
        self.ops = get_ops(self.device)
        self.comm = comm
        loaded = load_model(config.model, self.device, self.ops, comm=comm, stage=stage)
        self.model = loaded.model
        self.arch = loaded.arch
        self.model_path = loaded.path
        self.dtype = loaded.dtype
        self.max_model_len = loaded.max_model_len
        self.block_size = config.cache.block_size
        self.kv_dtype = kv_cache_dtype(
            config.cache.kv_cache_dtype, self.dtype, self.device, loaded.kv_dtype
        )
        # the KV layout, kept apart from the model (sleep level 2 drops the model, and
        # wake_up(["kv_cache"]) may come before the weights)
        self._kv_heads, self._head_dim = self.model.num_kv_heads, self.model.head_dim
        self.num_layers = self.model.num_local_layers  # a pipeline stage's own
        # which layers share a block table and a KV tensor; `hybrid_kv` (an engine's
        # worker): as the engine core's groups; else every layer keeps every block
        self.kv_groups = single_group(self.num_layers)
        if hybrid_kv:
            groups = engine_kv_groups(type(self.model).layer_windows(self.arch), config)
            if groups.slides:
                self.kv_groups = groups
        # each local layer's KV tensor and group (a pipeline stage's layers are the model's
        # from its first on; the groups are the whole model's, as the core's)
        first = self.model.stage.start_layer if self.kv_groups.slides else 0
        local = range(first, first + self.num_layers)
        self._layer_slots = [self.kv_groups.slot_of_layer[layer] for layer in local]
        self._layer_groups = (
            tuple(self.kv_groups.group_of_layer[layer] for layer in local)
            if self.kv_groups.slides
            else None
        )
        if self.device == "cpu":
            _log_cpu_choices(self.ops, self.model, self.dtype)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self._staging = _Staging(self.device)
        self._offloaded: OffloadedWeights | None = None
        # LoRA adapters (models/lora.py): their slots outlive a model dropped by sleep
        self.lora = None
        if config.lora.enable_lora:
            lora = config.lora
            self.lora = self.model.enable_lora(
                lora.max_loras, lora.max_lora_rank, lora.max_adapters
            )

    # ---- LoRA adapters -------------------------------------------------------------

    def add_lora(self, lora_id: int, path: str, name: str = "") -> None:
        """Reads the PEFT adapter at `path` (this rank's shard) under `lora_id`; LoraError
        (a ValueError) says why one does not fit the model. Needs the weights awake."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (enable_lora=True, --enable-lora)")
        if self.model is None:
            raise RuntimeError("the model is asleep (level 2); wake it before loading adapters")
        self.lora.add(lora_id, self.model.read_lora(path, name))

    def remove_lora(self, lora_id: int) -> bool:
        """Drops adapter `lora_id`; False if it was not loaded."""
        return self.lora is not None and self.lora.remove(lora_id)

    # ---- KV cache ------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(  # the KV tensors this stage's layers write
            self.num_kv_tensors, self._kv_heads, self.block_size, self._head_dim, self.kv_dtype
        )

    @property
    def num_kv_tensors(self) -> int:
        """KV tensor pairs this runner holds (one per layer, or per slot with groups)."""
        return len(set(self._layer_slots))

    @property
    def kv_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each KV tensor pair once, by slot (what a block copy moves: the tiers')."""
        first = {slot: i for i, slot in reversed(list(enumerate(self._layer_slots)))}
        return [self.kv_caches[first[slot]] for slot in sorted(first)] if self.kv_caches else []

    def determine_num_blocks(self, extra_bytes_per_block: int = 0) -> int:
        """Blocks the KV budget holds; `extra_bytes_per_block`: what else each block costs
        (a draft model's own KV cache over the same block ids)."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device == "cuda":
            free, _total = torch.cuda.mem_get_info()
            budget = int(free * cache.gpu_memory_utilization)
        else:
            budget = cache.kv_cache_memory_bytes or CPU_DEFAULT_KV_BYTES
        per_block = self.kv_bytes_per_block + extra_bytes_per_block
        num_blocks = budget // per_block
        # More blocks than every sequence slot filled twice over buys nothing but memory.
        useful = (
            2 * self.config.scheduler.max_num_seqs * (-(-self.max_model_len // self.block_size))
        )
        num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes: {budget} bytes hold no KV block "
                f"(one block needs {per_block} bytes)"
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        used = sorted(set(self._layer_slots))
        pairs = allocate_kv_cache(
            len(used),
            (num_blocks, self._kv_heads, self.block_size, self._head_dim),
            self.kv_dtype,
            self.device,
        )
        tensors = dict(zip(used, pairs, strict=True))
        self.kv_caches = [tensors[slot] for slot in self._layer_slots]
        self.num_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks of %d tokens, %s (%.1f MiB)",
            num_blocks,
            self.block_size,
            str(self.kv_dtype).removeprefix("torch."),
            num_blocks * self.kv_bytes_per_block / 2**20,
        )

    # ---- sleep mode (pipeline/worker/sleep.py) ----------------------------------------

    @property
    def sleep_level(self) -> int:
        """0: weights and KV cache in place; 2: the weights dropped; 1: otherwise (weights
        offloaded, or woken up in part: `wake_up(tags)`)."""
        if self.model is None:
            return 2
        return 1 if self._offloaded is not None or not self.kv_caches else 0

    def sleep(self, level: int) -> None:
        """Frees the KV cache and offloads (1) or drops (2) the weights; weights dropped
        already stay dropped (a shallower level never brings them back)."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level: {level} is not one of {SLEEP_LEVELS}")
        if level == 1 and self.model is not None and self._offloaded is None:
            # First, and alone: an offload that fails (a full disk) leaves the weights and
            # the KV cache in place, so the engine stays awake and serving.
            self._offloaded = OffloadedWeights(self.model)
        self.kv_caches = []
        if level == 2 or self.model is None:
            if self._offloaded is not None:
                self._offloaded.close()
                self._offloaded = None
            self.model = None
        release_memory(self.device)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Brings back the `tags` (WAKE_TAGS: "weights", "kv_cache"; default both): the
        weights copied back or loaded again, the KV cache with the same number of blocks.
        What is back already is left alone."""
        tags = _wake_tags(tags)
        if "weights" in tags:
            if self._offloaded is not None:
                self._offloaded.restore()
                self._offloaded = None
            if self.model is None:
                self.model = load_model(
                    self.config.model, self.device, self.ops, comm=self.comm, stage=self.stage
                ).model
                if self.lora is not None:  # the same slots on the layers read anew
                    self.model.lora = self.lora
                    self.model.attach_lora()
        if "kv_cache" in tags and not self.kv_caches and self.num_blocks:
            self.initialize_kv_cache(self.num_blocks)

    # ---- one step ------------------------------------------------------------------

    last_hidden: torch.Tensor | None = None  # the last step's final hidden states, if it pooled

    @torch.inference_mode()
    def run(
        self, step: StepInputs, encoder_cache=None, input_batch=None, intermediate=None
    ) -> torch.Tensor:
        """The model over one step's inputs: float32 logits [N, vocab] of the step's
        `logits_indices` rows, in batch order (the worker's InputBatch builds `step`).
        `encoder_cache` (a model that takes images, worker/encoder_cache.py): the input
        rows of image positions are the images' features, from `input_batch`'s rows.
        A pipeline stage: a later one takes the previous stage's `intermediate`, and one
        that is not the last returns its own IntermediateTensors instead of logits."""
        if self.sleep_level:
            raise RuntimeError(f"the model is asleep (level {self.sleep_level}); wake it first")
        batch = self._forward_batch(step)
        if intermediate is not None:
            out = self.model.forward(batch, self.kv_caches, intermediate=intermediate)
        else:
            embeds = None
            if encoder_cache is not None:
                embeds = encoder_cache.inputs_embeds(self.model, input_batch, step, batch.input_ids)
            if embeds is None:
                out = self.model.forward(batch, self.kv_caches)
            else:
                out = self.model.forward(batch, self.kv_caches, inputs_embeds=embeds)
        if self.stage is not None and not self.stage.is_last:
            return out
        # a pooling request's vector is made of these (worker/pooler.py): kept for the step
        self.last_hidden = out if step.pools is not None and step.pools.any() else None
        return self.model.compute_logits(out[batch.logits_indices])

    @torch.inference_mode()
    def execute(self, requests: Sequence[RunnerRequest]) -> StepLogits:
        """The same for requests described one by one (tests, numerics checks): rows come
        back grouped by request in the caller's order."""
        if not requests:
            raise ValueError("a step needs at least one request")
        if any(len(r.token_ids) == 0 for r in requests):
            raise ValueError("a request in the step has no tokens to compute")
        step = _step_of(requests, self.block_size, self.max_model_len)
        logits = self.run(step)
        counts = np.diff(step.logit_starts)  # batch order
        in_caller_order = np.empty_like(counts)
        in_caller_order[step.order] = counts
        batch_pos = np.empty_like(step.order)
        batch_pos[step.order] = np.arange(len(step.order))
        # each caller request's rows, taken from its batch position, in caller order
        firsts = step.logit_starts[batch_pos]
        perm = np.repeat(
            firsts - np.concatenate([[0], np.cumsum(in_caller_order)[:-1]]), in_caller_order
        )
        perm += np.arange(int(counts.sum()))
        if not np.array_equal(perm, np.arange(len(perm))):
            logits = logits[torch.from_numpy(perm).to(logits.device)]
        return StepLogits(logits, np.concatenate([[0], np.cumsum(in_caller_order)]).tolist())

    def _forward_batch(self, step: StepInputs) -> ForwardBatch:
        """The step's arrays as tensors: views of the numpy arrays on the CPU; on a GPU one
        copy each through pinned host buffers kept across steps (non-blocking)."""
        put = self._staging.put
        slot_mapping = put("slot_mapping", step.slot_mapping)
        block_tables = put("block_tables", step.block_tables)
        groups = {}
        if block_tables.dim() == 3:  # KV groups: [G, R, max_blocks], [G, T]
            groups = dict(
                layer_groups=self._layer_groups,
                group_block_tables=block_tables,
                group_slot_mapping=slot_mapping,
            )
            block_tables, slot_mapping = block_tables[0], slot_mapping[0]
        return ForwardBatch(
            input_ids=put("input_ids", step.input_ids),
            positions=put("positions", step.positions),
            slot_mapping=slot_mapping,
            query_start_loc=put("query_start_loc", step.query_start_loc),
            seq_lens=put("seq_lens", step.seq_lens),
            block_tables=block_tables,
            num_decodes=step.num_decodes,
            logits_indices=put("logits_indices", step.logits_indices),
            lora_slots=self._lora_slots(step),
            **groups,
        )

    def _lora_slots(self, step: StepInputs) -> torch.Tensor | None:
        """Each token's adapter slot (models/lora.py), None when no request has one."""
        if self.lora is None or step.lora_ids is None or not step.lora_ids.any():
            return None
        counts = np.diff(step.query_start_loc)
        return self.lora.token_slots(step.lora_ids, counts).to(self.device)


_KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,  # with a float32 scale per (block, KV head): ops/kv_int8.py
}


def kv_cache_dtype(
    name: str, model_dtype: torch.dtype, device: str, auto: torch.dtype | None = None
) -> torch.dtype:
    """The KV cache's element type for `--kv-cache-dtype name` (config.KV_CACHE_DTYPES):
    auto is `auto` where the loader chose one (an int8 model's float32 activations keep the
    checkpoint's 16-bit cache on a CPU that computes in it), else the activations' dtype.
    fp8 is float8 e4m3fn at unit scale (vLLM's default without calibrated scales): keys and
    values are written rounded to it, saturating at +-448, and read back as the activations'
    dtype, by the CPU kernel sets and the CUDA kernels (which take the activations' own type,
    fp8 or int8, not another 16-bit type).
    int8 keeps a float32 scale per (block, KV head) behind the values (ops/kv_int8.py)."""
    if name == "auto":
        return model_dtype if auto is None else auto
    if name not in _KV_DTYPES:
        raise ValueError(f"kv_cache_dtype: {name!r} is not one of auto, {', '.join(_KV_DTYPES)}")
    dtype = _KV_DTYPES[name]
    if device != "cpu" and dtype not in (model_dtype, torch.float8_e4m3fn, torch.int8):
        raise ValueError(
            f"kv_cache_dtype: {name} under {str(model_dtype).removeprefix('torch.')} "
            f"activations runs on the CPU only; on {device} use auto, fp8 or int8"
        )
    return dtype


def kv_bytes_per_block(
    num_layers: int, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one KV block takes over all layers (keys and values; an int8 cache's scales
    included)."""
    return 2 * kv_int8.block_bytes(kv_heads, block_size, head_dim, dtype) * num_layers


def allocate_kv_cache(num_layers: int, shape: tuple, dtype: torch.dtype, device: str):
    """One zeroed (key, value) pair of [num_blocks, kv_heads, block_size, head_dim] per
    layer (int8 ones with their scales behind them: kv_int8.new_cache)."""
    return [
        (kv_int8.new_cache(shape, dtype, device), kv_int8.new_cache(shape, dtype, device))
        for _ in range(num_layers)
    ]


class _Staging:
    """Host arrays -> device tensors. CPU: `torch.from_numpy` (no copy). GPU: each name has
    a pinned host buffer, grown when a step needs more, that the array is copied into, then
    one non-blocking host-to-device copy; no allocation of pinned memory per step.

    NOTE: a buffer is rewritten by the next step's `put` while nothing waits for this
    step's copy out of it; that is safe because every step ends by reading its sampled
    tokens back to the host, which waits for the whole stream, copies included."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._pinned: dict[str, torch.Tensor] = {}

    def put(self, name: str, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device == "cpu":
            return host
        buffer = self._pinned.get(name)
        if buffer is None or buffer.numel() < host.numel() or buffer.dtype != host.dtype:
            buffer = torch.empty(max(host.numel(), 1) * 2, dtype=host.dtype, pin_memory=True)
            self._pinned[name] = buffer
        staged = buffer[: host.numel()].view(host.shape)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)


def _step_of(requests: Sequence[RunnerRequest], block_size: int, max_model_len: int) -> StepInputs:
    """StepInputs of requests given one by one, through a scratch InputBatch."""
    batch = InputBatch(block_size, max_model_len)
    ids = []
    for i, r in enumerate(requests):
        rid = str(i)
        known = [0] * r.num_computed_tokens + list(r.token_ids)
        params = SamplingParams(lora_id=r.lora_id)
        batch.add(
            NewRequestData(
                rid, known, len(known), params, (), list(r.block_ids), r.num_computed_tokens
            )
        )
        if r.logits == LOGITS_ALL:
            batch.prompt_logprobs[batch.row_of[rid]] = 0
            batch.num_prompt_tokens[batch.row_of[rid]] = len(known)
        elif r.logits == LOGITS_NONE:
            batch.num_tokens[batch.row_of[rid]] += 1  # the step stops short of the end
        elif r.logits != LOGITS_LAST:
            raise ValueError(f"logits: {r.logits!r} is not one of none, last, all")
        ids.append(rid)
    counts = np.fromiter((len(r.token_ids) for r in requests), np.int64, len(requests))
    return batch.prepare(ids, counts)


def _wake_tags(tags: Sequence[str] | None) -> set[str]:
    return set(wake_tags(wake_bits(tags)))  # checked once, where the wire codes them


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
