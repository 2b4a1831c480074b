"""The worker's KV tiers: the bytes behind the engine core's accounting (core/kv_tiers.py).

    host tier   one (key, value) pair of [num_host_blocks, kv_heads, block_size, head_size]
                tensors per layer, the device cache's layout; in pinned memory when the
                device is a GPU (its copies then run on a stream of their own), plain
                memory on a CPU (a pool apart from the device cache, so the accounting
                is real); sized by --swap-space (GiB per worker)
    disk tier   pipeline/worker/kv_disk.py's store under --kv-offload-dir (one file per
                rank), capped at --kv-offload-max-gib

`apply(transfers)` makes one step's copies, in the order core/kv_tiers.py gives, before
the step's forward pass: host -> disk, device -> host, host -> device, disk -> device.
Each is one batched call per direction (ops.swap_blocks: a block-copy kernel on CUDA,
memcpy on the CPU; the disk store copies per layer), never a loop over tokens.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

from ringllm.pipeline.ops import kv_int8

logger = logging.getLogger(__name__)

GIB = 1 << 30


class KVLoadError(RuntimeError):
    """A disk block that did not verify when loaded (its step fails; see core/kv_tiers.py)."""


class WorkerKVTiers:
    def __init__(self, runner, config, rank: int = 0) -> None:
        cache = config.cache
        self.device = runner.device
        self.ops = runner.ops
        per_block = runner.kv_bytes_per_block
        self.num_host_blocks = int(cache.swap_space * GIB) // per_block
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.disk = None
        if not self.num_host_blocks:
            return
        shape = (self.num_host_blocks, runner._kv_heads, runner.block_size, runner._head_dim)
        pin = self.device == "cuda"
        # NOTE: torch.empty: pages are committed as blocks are first written, so an idle
        # host tier costs address space, not memory (on a CPU; pinned memory is committed)
        host = functools.partial(kv_int8.new_cache, zero=False, pin_memory=pin)
        self.host_caches = [
            (host(shape, runner.kv_dtype, "cpu"), host(shape, runner.kv_dtype, "cpu"))
            for _ in range(runner.num_kv_tensors)  # a layer's, or a slot's (KV groups)
        ]
        self._stream = torch.cuda.Stream() if pin else None
        self._stage: list[tuple[torch.Tensor, torch.Tensor]] = []
        if cache.kv_offload_dir:
            self.disk = _open_disk(runner, config, rank, shape[1:])
        logger.info(
            "KV host tier: %d blocks (%.1f GiB)%s",
            self.num_host_blocks,
            self.num_host_blocks * per_block / GIB,
            f"; disk tier: {self.disk.num_slots} slots under {cache.kv_offload_dir}"
            if self.disk is not None
            else "",
        )

    def close(self) -> None:
        """The disk tier's pages to disk (a restart finds them), then its file closed."""
        if self.disk is not None:
            self.disk.flush()
            self.disk.close()
            self.disk = None

    @property
    def num_disk_slots(self) -> int:
        return self.disk.num_slots if self.disk is not None else 0

    def disk_entries(self) -> dict[int, int]:
        """What the disk tier holds that verifies (block hash -> slot): a restarted engine's
        index starts from it."""
        return dict(self.disk.valid_entries()) if self.disk is not None else {}

    def apply(self, transfers, device_caches) -> None:
        """One step's copies (core/kv_tiers.py KVTransfers), in their order."""
        if transfers.to_disk:
            host, slots, hashes = zip(*transfers.to_disk, strict=True)
            self.disk.write(slots, hashes, *self._split(self.host_caches), host)
        if transfers.to_host:
            self._swap(device_caches, self.host_caches, transfers.to_host)
        if transfers.to_device:
            self._swap(self.host_caches, device_caches, transfers.to_device)
        if transfers.from_disk:
            self._from_disk(transfers.from_disk, device_caches)

    def _swap(self, src, dst, pairs) -> None:
        mapping = torch.tensor(pairs, dtype=torch.int64)
        if self._stream is None:
            self.ops.swap_blocks(src, dst, mapping)
            return
        # Its own stream, ordered after what the step queued so far and before the
        # forward that reads or overwrites these blocks.
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        self.ops.swap_blocks(src, dst, mapping, stream=self._stream)
        current.wait_stream(self._stream)

    def _from_disk(self, entries, device_caches) -> None:
        slots, blocks, hashes = zip(*entries, strict=True)
        if self.device == "cpu":
            loaded = self.disk.read(slots, hashes, *self._split(device_caches), blocks)
        else:  # through pinned staging blocks of this worker's own, then one device copy
            stage = self._stage_caches(len(blocks))
            rows = list(range(len(blocks)))
            loaded = self.disk.read(slots, hashes, *self._split(stage), rows)
            self._swap(stage, device_caches, list(zip(rows, blocks, strict=True)))
        if not all(loaded):
            bad = [hex(h) for h, ok in zip(hashes, loaded, strict=True) if not ok]
            raise KVLoadError(f"disk KV blocks did not verify when loaded: {', '.join(bad)}")

    def _stage_caches(self, count: int):
        """Pinned blocks (per layer) for `count` disk loads, kept and grown by doubling."""
        have = self._stage[0][0].shape[0] if self._stage else 0
        if count > have:
            k = self.host_caches[0][0]
            shape = (max(count, 2 * have), *k.shape[1:])
            self._stage = [
                (
                    torch.empty(shape, dtype=k.dtype, pin_memory=True),
                    torch.empty(shape, dtype=k.dtype, pin_memory=True),
                )
                for _ in self.host_caches
            ]
        return self._stage

    @staticmethod
    def _split(caches):
        return [k for k, _ in caches], [v for _, v in caches]


def _open_disk(runner, config, rank: int, block_shape):
    from ringllm.pipeline.worker.kv_disk import DiskKVStore

    cache = config.cache
    model = Path(runner.model_path)
    config_json = model / "config.json"
    digest = hashlib.blake2b(config_json.read_bytes() if config_json.is_file() else b"")
    for weights in sorted(model.glob("*.safetensors")) + sorted(model.glob("*.gguf")):
        stat = weights.stat()  # other weights under the same config.json: another model
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    fingerprint = {
        "model": str(model.resolve()),
        "config": digest.hexdigest(),
        "dtype": str(runner.kv_dtype),
        "block_size": cache.block_size,
        "layout": [runner.num_kv_tensors, *block_shape],
        "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "rank": rank,
    }
    groups = runner.kv_groups
    if groups.slides:  # a slot is one block of a group: its KV tensors
        fingerprint["kv_groups"] = [groups.windows, groups.group_of_layer, groups.slot_of_layer]
    return DiskKVStore.open(
        cache.kv_offload_dir,
        fingerprint,
        tuple(block_shape),
        runner.num_kv_tensors,
        runner.kv_dtype,
        int(cache.kv_offload_max_gib * GIB),
        rank=rank,
    )
