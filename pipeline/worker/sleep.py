"""Sleep mode: a worker gives back the memory of its weights and KV cache, and takes it again.

    level 1   weights OFFLOADED: on a GPU, to host memory; on the CPU, to an unlinked
              temporary file (the OS may keep its pages cached, but they are no longer this
              process's: they can be reclaimed). Waking copies them back: no checkpoint read.
    level 2   weights DROPPED (the whole model object): waking builds and loads it again
              from the model folder, as at start.

Both free the KV cache (its contents are lost: the engine core resets the prefix cache and
recomputes the requests it had running). Waking re-allocates the same number of blocks, so
the scheduler's view of the pool never changes. `wake_up(tags)` brings back one part at a
time (vLLM's tags: "weights", then "kv_cache"), so the peak memory of waking is the larger
of the two, not their sum; the engine serves again once both are back.

What counts as a weight: every tensor the model holds (as an attribute of the model, or of an
object in a list the model holds, e.g. its layers), in whichever layout models/linear.py
chose: plain, oneDNN-packed (kept dense while asleep, packed again on wake) or the C kernels'
16-bit panels. One tensor held in two places (a tied embedding and head) is offloaded once
and comes back as one tensor again.

NOTE: freed tensors return to the allocator, which keeps small-chunk heaps; `release_memory`
asks glibc to give the free pages back (`malloc_trim`), so the process's RSS falls.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ringllm.pipeline.child_process import give_back_free_heap
from ringllm.pipeline.models.linear import PackedWeight16, pack_onednn
from ringllm.pipeline.ops.quant import QuantMatrix

logger = logging.getLogger(__name__)

ENV_SLEEP_DIR = "RINGLLM_SLEEP_DIR"  # where level 1 puts CPU weights (default: the temp dir)
_MAX_DEPTH = 6


@dataclass
class _Slot:
    holder: Any  # an object (attribute `key`) or a list (index `key`)
    key: str | int

    def get(self):
        return (
            self.holder[self.key]
            if isinstance(self.holder, list)
            else getattr(self.holder, self.key)
        )

    def set(self, value) -> None:
        if isinstance(self.holder, list):
            self.holder[self.key] = value
        else:
            setattr(self.holder, self.key, value)


def weight_slots(model) -> list[_Slot]:
    """Every place the model holds a tensor (or a 16-bit panel weight)."""
    slots: list[_Slot] = []
    _collect(model, slots, 0, set())
    return slots


def _collect(obj, slots: list[_Slot], depth: int, seen: set[int]) -> None:
    if id(obj) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(obj))
    if isinstance(obj, list):
        items = list(enumerate(obj))
    elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        items = list(vars(obj).items())
    else:
        return
    for key, value in items:
        if isinstance(value, (torch.Tensor, PackedWeight16, QuantMatrix)):
            slots.append(_Slot(obj, key))
        elif isinstance(value, list) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        ):
            _collect(value, slots, depth + 1, seen)


# ---- one tensor's way out and back -------------------------------------------------------


@dataclass
class _Stored:
    """One offloaded tensor: where its bytes are, and how to rebuild what the model held."""

    kind: str  # "plain" | "onednn" | "panels" | "quant"
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: torch.device
    offset: int = 0  # in the CPU file
    nbytes: int = 0
    host: torch.Tensor | None = None  # a GPU tensor's host copy
    panel: PackedWeight16 | QuantMatrix | None = None  # a packed weight's metadata (no bytes)


def _dense(value) -> tuple[str, torch.Tensor]:
    if isinstance(value, PackedWeight16):
        return "panels", value.panels
    if isinstance(value, QuantMatrix):
        return "quant", value.data
    if value.is_mkldnn:
        return "onednn", value.to_dense()
    return "plain", value


def _rebuild(stored: _Stored, tensor: torch.Tensor):
    if stored.kind == "panels":
        return dataclasses.replace(stored.panel, panels=tensor)
    if stored.kind == "quant":
        return dataclasses.replace(stored.panel, data=tensor)
    if stored.kind == "onednn":
        return pack_onednn(tensor)
    return tensor


class SleepError(RuntimeError):
    """A level-1 sleep that could not store the weights; the model is as it was."""


class OffloadedWeights:
    """Level 1: the model's tensors out of the model (to host memory or a file), and back.
    Raises SleepError (the model untouched, nothing left open) when the file cannot take
    them."""

    def __init__(self, model) -> None:
        self.slots = weight_slots(model)
        self._file = None
        self._stored: dict[int, _Stored] = {}
        self._slot_ids: list[int] = []
        try:
            self._store_all()
        except BaseException as exc:
            self.close()  # the model still holds every tensor: nothing to put back
            if isinstance(exc, OSError):
                where = os.environ.get(ENV_SLEEP_DIR) or tempfile.gettempdir()
                raise SleepError(
                    f"the weights could not be offloaded to {where} "
                    f"({exc.strerror or exc}); the engine stays awake: free space there, "
                    f"set {ENV_SLEEP_DIR} to a folder with room for them, or sleep at level 2"
                ) from None
            raise
        for slot in self.slots:
            slot.set(None)

    def _store_all(self) -> None:
        offset = 0
        for slot in self.slots:
            value = slot.get()
            key = id(value)
            self._slot_ids.append(key)
            if key in self._stored:
                continue  # held twice (a tied head): stored once
            kind, tensor = _dense(value)
            stored = _Stored(kind, tensor.dtype, tuple(tensor.shape), tensor.device)
            if kind == "panels":
                stored.panel = dataclasses.replace(value, panels=torch.empty(0, dtype=torch.int16))
            elif kind == "quant":  # the metadata without its bytes (the check runs on wake)
                stored.panel = copy.copy(value)
                object.__setattr__(stored.panel, "data", torch.empty(0, dtype=torch.uint8))
            if tensor.device.type == "cpu":
                stored.offset, stored.nbytes = offset, _write(self._open_file(), tensor)
                offset += stored.nbytes
            else:
                stored.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                stored.host.copy_(tensor)
            self._stored[key] = stored
        if self._file is not None:
            self._file.flush()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes or s.host.nbytes for s in self._stored.values())

    def _open_file(self):
        if self._file is None:
            # Unlinked at once: nothing is left on disk whatever becomes of this process.
            self._file = tempfile.TemporaryFile(dir=os.environ.get(ENV_SLEEP_DIR) or None)
        return self._file

    def restore(self) -> None:
        rebuilt: dict[int, Any] = {}
        for key, stored in self._stored.items():
            if stored.host is not None:
                tensor = stored.host.to(stored.device)
            else:
                tensor = _read(self._file, stored)
            rebuilt[key] = _rebuild(stored, tensor)
        for slot, key in zip(self.slots, self._slot_ids, strict=True):
            slot.set(rebuilt[key])
        self.close()

    def close(self) -> None:
        self._stored.clear()
        if self._file is not None:
            self._file.close()
            self._file = None


def _write(file, tensor: torch.Tensor) -> int:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()  # 0-d too
    file.write(data)  # NOTE: not ndarray.tofile: its OSError drops the errno (a full disk)
    return data.nbytes


def _read(file, stored: _Stored) -> torch.Tensor:
    file.seek(stored.offset)
    data = np.fromfile(file, np.uint8, stored.nbytes)
    if data.nbytes != stored.nbytes:
        raise OSError(f"sleep file: read {data.nbytes} bytes of a weight's {stored.nbytes}")
    return torch.from_numpy(data).view(stored.dtype).reshape(stored.shape)


def release_memory(device: str) -> None:
    """Freed tensors' memory back to the OS (CPU: glibc's heaps; GPU: torch's cache)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        return
    give_back_free_heap()


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set size, from /proc (0 where there is none)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
