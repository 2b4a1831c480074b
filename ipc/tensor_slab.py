"""`TensorSlab`: tensors in a shared-memory segment of their own, passed by reference.

A front end (the *owner*) creates the slab, copies each tensor in once (`put`) and sends
the returned `TensorRef` (four int64s, small enough for any ring record) to its peers (the
engine core, the TP ranks), which attach the slab by name and `get` a zero-copy, read-only
numpy view. Nothing is pickled; a tensor crosses no ring.

    +0                 header (one 64-byte line, HEADER_DTYPE, written before the name
                       is handed to anyone):
                       magic | version | capacity_bytes | num_slots | page_bytes |
                       data_offset | slot_dtype_hash | 0
    +64                slot table: num_slots x SLOT_DTYPE (72 bytes each)
                         seal = state (u32, low half) | generation (u32, high half)
                         dtype_code | ndim | shape[4] | offset | nbytes | tag
    +data_offset       data area (64-byte aligned): capacity_bytes / page_bytes pages
                       | page 0 | page 1 | ... | page n-1 |
                         a tensor takes ceil(nbytes / page_bytes) contiguous pages

Invariants:
  - One writer: only the owner allocates, fills, publishes and frees; the free-page
    bitmap and the free-slot list live in the owner's memory, the slot table is what
    peers read. A peer has no `put` or `free` (`TensorSlab.attach` returns a
    `TensorSlabPeer`); the mapping is writable only because POSIX shared memory is mapped
    read-write by `Segment`, and peers' views are marked read-only.
  - A slot's `seal` word is published last, with a release store (`_atomics.store_u64`,
    as ring.py publishes `tail`): data first, then the slot fields, then the seal. `get`
    loads the seal with an acquire load, copies the slot fields, fences and loads the
    seal again (a seqlock read): a slot freed or reused while it was being read is seen.
  - Every `put` into a slot bumps its generation (1..2**32-1, 0 never valid), and a ref
    carries the generation it was made with: a ref whose slot was freed, or freed and
    reused by another request, is refused (`StaleTensorRefError`), never read.

NOTE: `get` returns a view, not a copy. The generation check guards the moment of the
`get`; after it the owner must not free a tensor that a peer still reads (the protocol
above this module frees a request's tensors when the request ends: `free_tag`). A
generation would need 2**32 reuses of one slot while a ref is held to come round again.

uint16 arrays are taken as bfloat16 bit patterns (numpy has no bfloat16; a reader turns
the view into one with `torch.from_numpy(view).view(torch.bfloat16)`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ringllm.ipc import _atomics
from ringllm.ipc.errors import IpcError
from ringllm.ipc.shm import Segment

MAGIC = int.from_bytes(b"RLTSLAB1", "little")
LAYOUT_VERSION = 1
HEADER_BYTES = 64
DATA_ALIGN_BYTES = 64
DEFAULT_PAGE_BYTES = 64 * 1024
DEFAULT_NUM_SLOTS = 256
MAX_NUM_SLOTS = 1 << 16
MAX_NDIM = 4

STATE_FREE = 0
STATE_READY = 1
_GENERATION_MOD = 1 << 32

HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u8"),
        ("version", "<u8"),
        ("capacity_bytes", "<u8"),
        ("num_slots", "<u8"),
        ("page_bytes", "<u8"),
        ("data_offset", "<u8"),
        ("slot_dtype_hash", "<u8"),
        ("reserved", "<u8"),
    ]
)
# `state` and `generation` together are the 8-byte `seal` word (little-endian: state low).
SLOT_DTYPE = np.dtype(
    [
        ("state", "<u4"),
        ("generation", "<u4"),
        ("dtype_code", "<u4"),
        ("ndim", "<u4"),
        ("shape", "<i8", (MAX_NDIM,)),
        ("offset", "<i8"),
        ("nbytes", "<i8"),
        ("tag", "<i8"),
    ]
)

# dtype code in the slot table <-> numpy dtype; uint16 stands for bfloat16 bits.
DTYPE_BY_CODE = {
    1: np.dtype("<f4"),
    2: np.dtype("<f2"),
    3: np.dtype("<u2"),
    4: np.dtype("u1"),
    5: np.dtype("<i8"),
}
CODE_BY_DTYPE = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}


class StaleTensorRefError(IpcError):
    """A ref whose slot was freed (and maybe reused) since it was made, or never valid."""


class TensorSlabFullError(IpcError):
    """No free slot or no run of free pages large enough right now; retry after frees."""

    def __init__(self, message: str, capacity_bytes: int, nbytes: int) -> None:
        super().__init__(message)
        self.capacity_bytes = capacity_bytes
        self.nbytes = nbytes


class TensorTooLargeError(IpcError, ValueError):
    """The tensor is larger than the whole slab: it can never fit."""

    def __init__(self, message: str, capacity_bytes: int, nbytes: int) -> None:
        super().__init__(message)
        self.capacity_bytes = capacity_bytes
        self.nbytes = nbytes


class SlabLayoutError(IpcError):
    """A segment does not hold a tensor slab of this ringllm version."""


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Names one tensor in one slab: what a record carries (`to_ints`, NUM_INTS int64s)."""

    NUM_INTS: ClassVar[int] = 4

    slot: int
    generation: int
    tag: int
    nbytes: int

    def to_ints(self) -> tuple[int, int, int, int]:
        return (self.slot, self.generation, self.tag, self.nbytes)

    @classmethod
    def from_ints(cls, ints: Sequence[int] | np.ndarray) -> TensorRef:
        if len(ints) != cls.NUM_INTS:
            raise ValueError(f"a TensorRef is {cls.NUM_INTS} ints, got {len(ints)}")
        slot, generation, tag, nbytes = (int(value) for value in ints)
        return cls(slot, generation, tag, nbytes)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _slot_dtype_hash() -> int:
    text = f"{SLOT_DTYPE.descr!r}|{SLOT_DTYPE.itemsize}|{sorted(DTYPE_BY_CODE.items())!r}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _seal(state: int, generation: int) -> int:
    return (generation << 32) | state


@dataclass(frozen=True)
class SlabLayout:
    """Offsets of a slab: the header, `num_slots` slot headers, `num_pages` pages."""

    num_slots: int
    num_pages: int
    page_bytes: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_slots <= MAX_NUM_SLOTS:
            raise ValueError(f"num_slots must be in [1, {MAX_NUM_SLOTS}], got {self.num_slots}")
        if self.page_bytes < DATA_ALIGN_BYTES or self.page_bytes % DATA_ALIGN_BYTES:
            raise ValueError(
                f"page_bytes must be a positive multiple of {DATA_ALIGN_BYTES} bytes, "
                f"got {self.page_bytes}"
            )
        if self.num_pages < 1:
            raise ValueError(f"a slab needs at least one page, got num_pages={self.num_pages}")

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def data_offset(self) -> int:
        return _round_up(HEADER_BYTES + self.num_slots * SLOT_DTYPE.itemsize, DATA_ALIGN_BYTES)

    @property
    def segment_bytes(self) -> int:
        return self.data_offset + self.capacity_bytes

    def seal_offset(self, slot: int) -> int:
        return HEADER_BYTES + slot * SLOT_DTYPE.itemsize

    def header_values(self) -> tuple[int, ...]:
        return (
            MAGIC,
            LAYOUT_VERSION,
            self.capacity_bytes,
            self.num_slots,
            self.page_bytes,
            self.data_offset,
            _slot_dtype_hash(),
            0,
        )

    @classmethod
    def read(cls, buf: memoryview, name: str) -> SlabLayout:
        """The layout a peer's header describes; SlabLayoutError unless it is this version's."""
        if len(buf) < HEADER_BYTES:
            raise SlabLayoutError(f"segment {name!r} is {len(buf)} bytes: not a tensor slab")
        header = np.frombuffer(buf, HEADER_DTYPE, count=1)[0]
        if int(header["magic"]) != MAGIC:
            raise SlabLayoutError(
                f"segment {name!r} has magic {int(header['magic']):#x}, not a tensor slab "
                f"({MAGIC:#x})"
            )
        for field, want in (("version", LAYOUT_VERSION), ("slot_dtype_hash", _slot_dtype_hash())):
            if int(header[field]) != want:
                raise SlabLayoutError(
                    f"tensor slab {name!r}: header {field} is {int(header[field])}, expected "
                    f"{want}; the owner and its peers must run the same ringllm version"
                )
        page_bytes = int(header["page_bytes"])
        layout = cls(
            int(header["num_slots"]), int(header["capacity_bytes"]) // page_bytes, page_bytes
        )
        if layout.data_offset != int(header["data_offset"]) or layout.segment_bytes > len(buf):
            raise SlabLayoutError(
                f"tensor slab {name!r}: header says {layout.segment_bytes} bytes from "
                f"data offset {int(header['data_offset'])}, segment is {len(buf)} bytes"
            )
        return layout


class TensorSlabPeer:
    """A mapped slab that reads tensors by ref: what a peer gets from `TensorSlab.attach`."""

    def __init__(self, segment: Segment, layout: SlabLayout) -> None:
        self.segment = segment
        self.layout = layout
        self._buf = segment.buf
        self._slots = np.frombuffer(
            segment.buf, SLOT_DTYPE, count=layout.num_slots, offset=HEADER_BYTES
        )

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def capacity_bytes(self) -> int:
        return self.layout.capacity_bytes

    def get(self, ref: TensorRef) -> np.ndarray:
        """A read-only zero-copy view of the tensor `ref` names; StaleTensorRefError if gone."""
        if not 0 <= ref.slot < self.layout.num_slots or not 0 < ref.generation < _GENERATION_MOD:
            raise StaleTensorRefError(
                f"tensor slab {self.name!r}: {ref} is not a ref of this slab (slot must be in "
                f"[0, {self.layout.num_slots}), generation in [1, 2**32))"
            )
        seal_offset = self.layout.seal_offset(ref.slot)
        want = _seal(STATE_READY, ref.generation)
        seal = _atomics.load_u64(self._buf, seal_offset)  # acquire: the fields after it
        fields = self._slots[ref.slot].copy()
        _atomics.fence()  # the copy above completes before the seal is read again
        if seal != want or _atomics.load_u64(self._buf, seal_offset) != want:
            raise StaleTensorRefError(
                f"tensor slab {self.name!r}: slot {ref.slot} no longer holds generation "
                f"{ref.generation} (it was freed, or reused for another tensor); the ref "
                "is stale"
            )
        if int(fields["tag"]) != ref.tag or int(fields["nbytes"]) != ref.nbytes:
            raise StaleTensorRefError(
                f"tensor slab {self.name!r}: slot {ref.slot} holds tag {int(fields['tag'])} "
                f"of {int(fields['nbytes'])} bytes, the ref says tag {ref.tag} of "
                f"{ref.nbytes} bytes: a ref of another slab?"
            )
        return self._view(fields)

    def _view(self, fields: np.void) -> np.ndarray:
        dtype = DTYPE_BY_CODE.get(int(fields["dtype_code"]))
        ndim, offset, nbytes = int(fields["ndim"]), int(fields["offset"]), int(fields["nbytes"])
        shape = tuple(int(n) for n in fields["shape"][:ndim])
        if (
            dtype is None
            or ndim > MAX_NDIM
            or not 0 <= offset <= offset + nbytes <= self.capacity_bytes
        ):
            raise SlabLayoutError(f"tensor slab {self.name!r}: slot fields corrupt: {fields}")
        count = nbytes // dtype.itemsize
        view = np.frombuffer(self._buf, dtype, count=count, offset=self.layout.data_offset + offset)
        view = view.reshape(shape)
        view.flags.writeable = False
        return view

    def close(self) -> None:
        """Unmap (views still held keep the mapping alive until they go); never unlinks."""
        self._slots = None  # type: ignore[assignment]
        self._buf = None  # type: ignore[assignment]
        self.segment.close()

    def __enter__(self) -> TensorSlabPeer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class TensorSlab(TensorSlabPeer):
    """The owner's slab: `create`, `put`, `free`, `free_tag`, `get`, `close` (unlinks)."""

    def __init__(self, segment: Segment, layout: SlabLayout) -> None:
        super().__init__(segment, layout)
        self._page_is_free = np.ones(layout.num_pages, dtype=bool)
        self._free_slots = list(range(layout.num_slots - 1, -1, -1))  # pop() takes slot 0 first
        self._refs_by_slot: dict[int, TensorRef] = {}
        self._slots_by_tag: dict[int, set[int]] = {}

    @classmethod
    def create(
        cls,
        capacity_bytes: int,
        num_slots: int = DEFAULT_NUM_SLOTS,
        page_bytes: int = DEFAULT_PAGE_BYTES,
        kind: str = "tensors",
    ) -> TensorSlab:
        """A new slab of `capacity_bytes` (rounded up to whole pages), owned by this process."""
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1 byte, got {capacity_bytes}")
        layout = SlabLayout(num_slots, -(-capacity_bytes // page_bytes), page_bytes)
        segment = Segment.create(kind, layout.segment_bytes)
        header = np.frombuffer(segment.buf, HEADER_DTYPE, count=1)
        header[0] = layout.header_values()
        del header  # no export of the buffer may outlive close()
        return cls(segment, layout)

    @classmethod
    def attach(cls, name: str) -> TensorSlabPeer:
        """Map the slab a peer owns, to read from it (the result has no `put`)."""
        segment = Segment.attach(name)
        try:
            layout = SlabLayout.read(segment.buf, name)
        except BaseException:
            segment.close()
            raise
        return TensorSlabPeer(segment, layout)

    # -- accounting --------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_bytes(self) -> int:
        return int(self._page_is_free.sum()) * self.layout.page_bytes

    def largest_free_run_bytes(self) -> int:
        _, lengths = _free_runs(self._page_is_free)
        return int(lengths.max(initial=0)) * self.layout.page_bytes

    def can_put(self, nbytes: int) -> bool:
        num_pages = self._num_pages(nbytes)
        return bool(self._free_slots) and (
            num_pages == 0 or _first_fit(self._page_is_free, num_pages) >= 0
        )

    # -- the owner's operations --------------------------------------------------------
    def put(self, array: np.ndarray, tag: int) -> TensorRef:
        """Copy `array` in and publish it; TensorSlabFullError / TensorTooLargeError change nothing."""
        tag = int(tag)
        code = self._check_array(array, tag)
        num_pages = self._num_pages(array.nbytes)
        first_page = self._allocate_pages(array.nbytes, num_pages)
        slot = self._free_slots.pop()
        offset = first_page * self.layout.page_bytes
        generation = int(self._slots[slot]["generation"]) % (_GENERATION_MOD - 1) + 1
        if array.nbytes:
            self._page_is_free[first_page : first_page + num_pages] = False
            count = array.nbytes // array.itemsize
            start = self.layout.data_offset + offset
            destination = np.frombuffer(self._buf, array.dtype, count=count, offset=start)
            np.copyto(destination.reshape(array.shape), array)
        fields = self._slots[slot]
        fields["dtype_code"], fields["ndim"] = code, array.ndim
        fields["shape"] = tuple(array.shape) + (0,) * (MAX_NDIM - array.ndim)
        fields["offset"], fields["nbytes"], fields["tag"] = offset, array.nbytes, tag
        # Release store: the data and the fields above are visible before the seal says READY.
        _atomics.store_u64(self._buf, self.layout.seal_offset(slot), _seal(STATE_READY, generation))
        ref = TensorRef(slot, generation, tag, array.nbytes)
        self._refs_by_slot[slot] = ref
        self._slots_by_tag.setdefault(tag, set()).add(slot)
        return ref

    def free(self, ref: TensorRef) -> None:
        """Give the tensor's slot and pages back; its refs are refused from now on."""
        if self._refs_by_slot.get(ref.slot) != ref:
            raise StaleTensorRefError(
                f"tensor slab {self.name!r}: {ref} is not live (freed already, or not of this "
                "slab); nothing was freed"
            )
        # The seal goes first: a peer's get refuses the ref before its pages can be reused.
        _atomics.store_u64(
            self._buf, self.layout.seal_offset(ref.slot), _seal(STATE_FREE, ref.generation)
        )
        del self._refs_by_slot[ref.slot]
        tag_slots = self._slots_by_tag[ref.tag]
        tag_slots.discard(ref.slot)
        if not tag_slots:
            del self._slots_by_tag[ref.tag]
        num_pages = self._num_pages(ref.nbytes)
        first_page = int(self._slots[ref.slot]["offset"]) // self.layout.page_bytes
        self._page_is_free[first_page : first_page + num_pages] = True
        self._free_slots.append(ref.slot)

    def free_tag(self, tag: int) -> int:
        """Free every tensor put with `tag` (one request's); return how many."""
        slots = sorted(self._slots_by_tag.get(tag, ()))
        for slot in slots:
            self.free(self._refs_by_slot[slot])
        return len(slots)

    def close(self) -> None:
        """Unmap and unlink: peers' existing mappings stay valid, no new peer can attach."""
        self._refs_by_slot.clear()
        self._slots_by_tag.clear()
        super().close()

    def __enter__(self) -> TensorSlab:
        return self

    # -- helpers -----------------------------------------------------------------------
    def _num_pages(self, nbytes: int) -> int:
        return -(-nbytes // self.layout.page_bytes)

    def _check_array(self, array: np.ndarray, tag: int) -> int:
        if not -(1 << 63) <= tag < 1 << 63:
            raise ValueError(f"tag must fit an int64, got {tag}")
        code = CODE_BY_DTYPE.get(array.dtype)
        if code is None:
            names = ", ".join(str(dtype) for dtype in DTYPE_BY_CODE.values())
            raise ValueError(
                f"tensor dtype {array.dtype} cannot go into a tensor slab; use one of {names} "
                "(little-endian; uint16 carries bfloat16 bits)"
            )
        if array.ndim > MAX_NDIM:
            raise ValueError(f"tensor has {array.ndim} dimensions, a slab holds at most {MAX_NDIM}")
        return code

    def _allocate_pages(self, nbytes: int, num_pages: int) -> int:
        """The first page of a free run of `num_pages` (0 for an empty tensor), or raise."""
        capacity = self.capacity_bytes
        if nbytes > capacity:
            raise TensorTooLargeError(
                f"tensor of {nbytes} bytes is larger than tensor slab {self.name!r} "
                f"({capacity} bytes): make the slab larger or the image smaller",
                capacity,
                nbytes,
            )
        if not self._free_slots:
            raise TensorSlabFullError(
                f"tensor slab {self.name!r} has all {self.layout.num_slots} slots in use "
                f"(asked for {nbytes} bytes of {capacity}); free tensors or make more slots",
                capacity,
                nbytes,
            )
        first_page = _first_fit(self._page_is_free, num_pages) if num_pages else 0
        if first_page < 0:
            raise TensorSlabFullError(
                f"tensor slab {self.name!r} ({capacity} bytes) has no {num_pages} contiguous "
                f"free pages for {nbytes} bytes ({self.free_bytes} bytes free, largest run "
                f"{self.largest_free_run_bytes()} bytes); retry after frees",
                capacity,
                nbytes,
            )
        return first_page


def _free_runs(page_is_free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start page, length) of every run of free pages, in page order."""
    padded = np.concatenate(([False], page_is_free, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    starts, ends = edges[0::2], edges[1::2]
    return starts, ends - starts


def _first_fit(page_is_free: np.ndarray, num_pages: int) -> int:
    """The first page of the lowest free run of at least `num_pages` pages, or -1."""
    starts, lengths = _free_runs(page_is_free)
    fits = np.flatnonzero(lengths >= num_pages)
    return int(starts[fits[0]]) if fits.size else -1
