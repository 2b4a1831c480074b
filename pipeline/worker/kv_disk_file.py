"""The disk KV tier's file: its layout, header, fingerprint and allocation (the store that
reads and writes slots is pipeline/worker/kv_disk.py, whose docstring draws the file)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAGIC = b"RLLMKVD\0"
VERSION = 1
PAGE_BYTES = 4096
HEADER_BYTES = PAGE_BYTES
FILE_NAME = "ringllm-kv-rank{rank}.bin"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8)
SCALE_BYTES = 4  # an int8 cache's float32 scale per (block, KV head): pipeline/ops/kv_int8.py
PREFETCH_BYTES = 64 << 20  # how far the scan at open reads ahead

_HEADER = struct.Struct("<8sII32sQQQQ")
TABLE_DTYPE = np.dtype(
    [
        ("hash_lo", "<u8"),
        ("hash_hi", "<u8"),
        ("seq", "<u8"),
        ("checksum", "<u4"),
        ("state", "<u4"),
    ]
)
SIGNED_BYTES = 24  # hash_lo, hash_hi, seq: the entry bytes the checksum covers
EMPTY, WRITING, VALID = 0, 0x54495257, 0x444C4156  # b"WRIT", b"VALD": no stray byte reads valid
MASK64 = (1 << 64) - 1


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _cache_block_elems(block_shape, dtype: torch.dtype) -> int:
    """Elements of one layer's keys (or values) of one block in a slot; an int8 cache's
    are followed by the block's scales, as bytes (SCALE_BYTES per KV head)."""
    heads, block_size, head_size = block_shape
    scales = SCALE_BYTES * heads if dtype is torch.int8 else 0
    return int(heads * block_size * head_size) + scales


@dataclass(frozen=True)
class DiskLayout:
    """Where everything lies in the file, from the block shape and the size cap."""

    num_layers: int
    block_shape: tuple[int, int, int]  # num_kv_heads, block_size, head_size
    dtype: torch.dtype
    num_slots: int
    slot_bytes: int  # the stride: the data rounded up to a page

    @property
    def elems_per_cache_block(self) -> int:  # one layer's keys (or values) of one block
        return _cache_block_elems(self.block_shape, self.dtype)

    @property
    def slot_data_bytes(self) -> int:
        return 2 * self.num_layers * self.elems_per_cache_block * self.dtype.itemsize

    @property
    def table_offset(self) -> int:
        return HEADER_BYTES

    @property
    def data_offset(self) -> int:
        return HEADER_BYTES + _table_bytes(self.num_slots)

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.num_slots * self.slot_bytes

    @classmethod
    def plan(cls, num_layers, block_shape, dtype, max_bytes: int) -> DiskLayout:
        """The most whole slots that fit `max_bytes` with the header and the table."""
        data_bytes = 2 * num_layers * _cache_block_elems(block_shape, dtype) * dtype.itemsize
        slot_bytes = _round_up(data_bytes, PAGE_BYTES)
        num_slots = max(0, (max_bytes - HEADER_BYTES) // (slot_bytes + TABLE_DTYPE.itemsize))
        while (
            num_slots
            and HEADER_BYTES + _table_bytes(num_slots) + num_slots * slot_bytes > max_bytes
        ):
            num_slots -= 1
        if num_slots == 0:
            need = HEADER_BYTES + _table_bytes(1) + slot_bytes
            raise ValueError(
                f"max_bytes={max_bytes} of the disk KV tier holds no block: one block of "
                f"{num_layers} layers {tuple(block_shape)} {dtype} takes {need} bytes with "
                "the file's header and table; raise the size cap"
            )
        return cls(num_layers, tuple(block_shape), dtype, num_slots, slot_bytes)


def _table_bytes(num_slots: int) -> int:
    return _round_up(num_slots * TABLE_DTYPE.itemsize, PAGE_BYTES)


def fingerprint_digest(fingerprint: dict, layout: DiskLayout, rank: int) -> bytes:
    """BLAKE2b-256 of canonical JSON: sorted keys, no spaces; dtypes and paths as strings."""
    store = {
        "version": VERSION,
        "rank": rank,
        "num_layers": layout.num_layers,
        "block_shape": list(layout.block_shape),
        "dtype": str(layout.dtype),
        "order": "slot,layer,key|value,head,token,dim",
    }
    try:
        text = json.dumps(
            {"caller": fingerprint, "store": store},
            sort_keys=True,
            separators=(",", ":"),
            default=_canonical,
        )
    except TypeError as e:
        raise ValueError(f"the disk KV tier's fingerprint must be JSON data: {e}") from None
    return hashlib.blake2b(text.encode(), digest_size=32).digest()


def _canonical(value):
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} {value!r} has no canonical form")


def _header_bytes(layout: DiskLayout, digest: bytes) -> bytes:
    fields = (MAGIC, VERSION, HEADER_BYTES, digest, layout.num_slots, layout.slot_bytes)
    page = bytearray(HEADER_BYTES)
    _HEADER.pack_into(page, 0, *fields, layout.table_offset, layout.data_offset)
    struct.pack_into("<I", page, HEADER_BYTES - 4, zlib.crc32(page[: HEADER_BYTES - 4]))
    return bytes(page)


def why_not_reusable(fd: int, layout: DiskLayout, digest: bytes) -> str | None:
    """None if the file is this open's; else why not, for the warning."""
    size = os.fstat(fd).st_size
    if size < HEADER_BYTES:
        return f"truncated ({size} bytes, not even a header)"
    page = os.pread(fd, HEADER_BYTES, 0)
    if struct.unpack_from("<I", page, HEADER_BYTES - 4)[0] != zlib.crc32(page[: HEADER_BYTES - 4]):
        return "its header fails its checksum (damaged)"
    magic, version, _, old_digest, num_slots, slot_bytes, _, _ = _HEADER.unpack_from(page)
    if magic != MAGIC:
        return "not a ringllm KV file"
    if version != VERSION:
        return f"layout version {version}, this build writes {VERSION}"
    if old_digest != digest:
        return "written for another model, dtype, block size, KV layout or rank"
    if (num_slots, slot_bytes) != (layout.num_slots, layout.slot_bytes):
        return f"{num_slots} slots of {slot_bytes} bytes, the size cap now gives {layout.num_slots}"
    if page != _header_bytes(layout, digest):
        return "its header differs from this build's"
    if size != layout.file_bytes:
        return f"{size} bytes, its header says {layout.file_bytes} (truncated or torn)"
    return None


def check_block_shape(block_shape, num_layers: int, dtype: torch.dtype, rank: int) -> None:
    if len(block_shape) != 3 or any(int(n) < 1 for n in block_shape) or num_layers < 1:
        raise ValueError(
            f"block_shape {block_shape} must be (num_kv_heads, block_size, head_size) >= 1 "
            f"and num_layers ({num_layers}) >= 1"
        )
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype}: the disk KV tier stores {SUPPORTED_DTYPES}")
    if rank < 0:
        raise ValueError(f"rank {rank} must be >= 0")


def open_directory(directory: Path) -> int:
    """The directory (created with its parents if missing), opened: its fd.

    Refused, as ssh refuses a key folder, when another user could replace the tier's file
    in it: owned by someone other than this process's user or root, or writable by group
    or others without the sticky bit (which keeps others from renaming or removing a file
    they do not own, as in /tmp).
    """
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"disk KV tier directory {directory} is not a directory")
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"disk KV tier directory {directory}: cannot create it: {e}") from None
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"disk KV tier directory {directory}: cannot open it: {e}") from None
    info = os.fstat(fd)
    why = None
    if info.st_uid not in (os.geteuid(), 0):
        why = f"is owned by uid {info.st_uid}, not this process's ({os.geteuid()}) or root"
    elif info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        why = f"is writable by others (mode {stat.S_IMODE(info.st_mode):o}, no sticky bit)"
    if why is not None:
        os.close(fd)
        raise ValueError(
            f"disk KV tier directory {directory} {why}: another user could replace the "
            "tier's file there; give a --kv-offload-dir of this user's that only it can write"
        )
    return fd


def open_locked(dir_fd: int, path: Path) -> int:
    """The tier's file `path` (in the directory `dir_fd`), opened without following a link,
    and refused unless it is a regular file of this user's with no other name: a link or a
    file planted there by someone else would have the tier truncate what it points to."""
    try:
        fd = os.open(
            path.name,
            os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dir_fd,
        )
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(
                f"disk KV tier file {path} is a symbolic link: refused (the tier would "
                "overwrite what it points to); remove it or give another --kv-offload-dir"
            ) from None
        raise ValueError(
            f"disk KV tier file {path}: cannot open it for writing ({e.strerror}); "
            "give a writable --kv-offload-dir"
        ) from None
    info = os.fstat(fd)
    why = None
    if not stat.S_ISREG(info.st_mode):
        why = "is not a regular file"
    elif info.st_uid != os.geteuid():
        why = f"is owned by uid {info.st_uid}, not this process's ({os.geteuid()})"
    elif info.st_nlink != 1:
        why = f"has {info.st_nlink} names (a hard link to another file)"
    if why is not None:
        os.close(fd)
        raise ValueError(
            f"disk KV tier file {path} {why}: refused (the tier would overwrite it); "
            "remove it or give another --kv-offload-dir"
        )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(
            f"disk KV tier file {path} is held by another process: give each engine "
            "(data-parallel rank) its own --kv-offload-dir or rank"
        ) from None
    return fd


def create_file(fd: int, dir_fd: int, path: Path, layout: DiskLayout, digest: bytes) -> None:
    """An empty file: truncated, allocated (zeros: every slot EMPTY), then its header."""
    fs = os.statvfs(fd)
    free = fs.f_bavail * fs.f_frsize + os.fstat(fd).st_blocks * 512
    if layout.file_bytes > free:
        raise ValueError(_no_room(path, layout.file_bytes, free))
    os.ftruncate(fd, 0)
    try:
        allocate_file(fd, path, layout.file_bytes)
    except ValueError:
        os.ftruncate(fd, 0)  # give back what was allocated
        raise
    os.pwrite(fd, _header_bytes(layout, digest), 0)
    os.fsync(fd)
    os.fsync(dir_fd)


def allocate_file(fd: int, path: Path, file_bytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, file_bytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            fs = os.statvfs(fd)
            raise ValueError(_no_room(path, file_bytes, fs.f_bavail * fs.f_frsize)) from None
        raise ValueError(
            f"disk KV tier file {path}: cannot allocate {file_bytes} bytes: {e}"
        ) from None


def _no_room(path: Path, file_bytes: int, free_bytes: int) -> str:
    return (
        f"disk KV tier file {path} needs {file_bytes} bytes ({file_bytes / 2**30:.2f} GiB) and "
        f"its file system has {free_bytes} bytes ({free_bytes / 2**30:.2f} GiB) free: lower "
        "the tier's size cap or free space"
    )
