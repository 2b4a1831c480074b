"""TensorSlab in real shared memory and real processes: round trips, stale refs, pages."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ringllm.ipc.errors import IpcError
from ringllm.ipc.shm import cleanup_stale
from ringllm.ipc.tensor_slab import (
    SlabLayoutError,
    StaleTensorRefError,
    TensorRef,
    TensorSlab,
    TensorSlabFullError,
    TensorSlabPeer,
    TensorTooLargeError,
)

PAGE_BYTES = 4096
SLAB_BYTES = 1024 * PAGE_BYTES

# A peer process: attaches the slab named in argv, then answers one JSON line per ref
# read from stdin (the four ints of TensorRef.to_ints()).
_PEER_SCRIPT = """
import hashlib, json, sys
from ringllm.ipc.tensor_slab import TensorRef, TensorSlab
peer = TensorSlab.attach(sys.argv[1])
print(json.dumps({"has_put": hasattr(peer, "put"), "has_free": hasattr(peer, "free")}), flush=True)
for line in sys.stdin:
    ref = TensorRef.from_ints([int(word) for word in line.split()])
    try:
        view = peer.get(ref)
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        continue
    answer = {
        "sha256": hashlib.sha256(view.tobytes()).hexdigest(),
        "shape": list(view.shape),
        "dtype": str(view.dtype),
        "writeable": bool(view.flags.writeable),
        "first": view.reshape(-1)[:1].tolist(),
    }
    print(json.dumps(answer), flush=True)
peer.close()
"""

_OWNER_SCRIPT = """
import sys, time
import numpy as np
from ringllm.ipc.tensor_slab import TensorSlab
slab = TensorSlab.create(1 << 16, num_slots=4, page_bytes=4096)
ref = slab.put(np.arange(100, dtype=np.float32), tag=7)
print(slab.name, *ref.to_ints(), flush=True)
for _ in range(1200):
    time.sleep(0.05)
"""


class Peer:
    """A peer process attached to a slab, asked for refs one line at a time."""

    def __init__(self, name: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _PEER_SCRIPT, name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.hello = self._answer()

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        assert line, self.process.stderr.read()
        return json.loads(line)

    def get(self, ref: TensorRef) -> dict:
        self.process.stdin.write(" ".join(str(n) for n in ref.to_ints()) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.process.stdin.close()
        assert self.process.wait(30) == 0, self.process.stderr.read()


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((3, 224, 224), dtype=np.float32),
        rng.standard_normal((2, 3, 5, 7)).astype(np.float16),
        _bfloat16_bits(rng.standard_normal((1, 3, 8, 8))),
        rng.integers(0, 256, (336, 336, 3), dtype=np.uint8),
        rng.integers(-(1 << 62), 1 << 62, (17,), dtype=np.int64),
        np.array(3.5, dtype=np.float32),  # 0-D
        np.zeros((0, 4), dtype=np.float32),  # empty: no pages
    ]


def _shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


@pytest.fixture
def slab():
    with TensorSlab.create(SLAB_BYTES, num_slots=16, page_bytes=PAGE_BYTES) as slab:
        yield slab


def test_every_dtype_and_shape_round_trips_in_this_process(slab):
    for tag, array in enumerate(_arrays()):
        ref = slab.put(array, tag=tag)
        view = slab.get(ref)
        assert view.dtype == array.dtype and view.shape == array.shape
        np.testing.assert_array_equal(view, array)
        assert not view.flags.writeable
        assert TensorRef.from_ints(np.array(ref.to_ints(), dtype=np.int64)) == ref
    # bfloat16 bits come back as the values they encode
    values = np.array([1.0, -2.5, 2.0**127, -(2.0**-126)], dtype=np.float32)
    view = slab.get(slab.put(_bfloat16_bits(values), tag=99))
    np.testing.assert_array_equal((view.astype(np.uint32) << 16).view(np.float32), values)


def test_a_strided_array_is_copied_in_dense(slab):
    base = np.arange(64, dtype=np.int64).reshape(8, 8)
    np.testing.assert_array_equal(slab.get(slab.put(base[:, ::2], tag=1)), base[:, ::2])


def test_a_peer_process_reads_every_tensor_zero_copy_read_only(slab):
    refs = [(array, slab.put(array, tag=tag)) for tag, array in enumerate(_arrays())]
    peer = Peer(slab.name)
    try:
        assert peer.hello == {"has_put": False, "has_free": False}
        for array, ref in refs:
            answer = peer.get(ref)
            assert answer["sha256"] == _sha256(array)
            assert answer["shape"] == list(array.shape)
            assert answer["dtype"] == str(array.dtype)
            assert answer["writeable"] is False
    finally:
        peer.close()


def test_a_peer_cannot_put_or_free():
    with TensorSlab.create(PAGE_BYTES, page_bytes=PAGE_BYTES) as owner:
        with TensorSlab.attach(owner.name) as peer:
            assert isinstance(peer, TensorSlabPeer) and not isinstance(peer, TensorSlab)
            for verb in ("put", "free", "free_tag"):
                assert not hasattr(peer, verb)


def test_a_freed_and_reused_slot_refuses_the_old_ref_in_a_peer(slab):
    old = slab.put(np.full(1000, 1.0, dtype=np.float32), tag=1)
    peer = Peer(slab.name)
    try:
        assert peer.get(old)["first"] == [1.0]
        slab.free(old)
        answer = peer.get(old)  # freed, not yet reused
        assert answer["error"] == "StaleTensorRefError"
        new = slab.put(np.full(1000, 2.0, dtype=np.float32), tag=2)
        assert (new.slot, new.generation) == (old.slot, old.generation + 1)
        answer = peer.get(old)  # reused by another request: still refused
        assert answer["error"] == "StaleTensorRefError" and "stale" in answer["message"]
        assert peer.get(new)["first"] == [2.0]
    finally:
        peer.close()
    with pytest.raises(StaleTensorRefError, match="no longer holds generation"):
        slab.get(old)
    with pytest.raises(StaleTensorRefError, match="not live"):
        slab.free(old)  # a double free must not free the new tenant


def test_a_forged_ref_is_refused(slab):
    ref = slab.put(np.ones(4, dtype=np.float32), tag=5)
    for forged in (
        TensorRef(ref.slot, ref.generation, ref.tag + 1, ref.nbytes),
        TensorRef(999, 1, 5, 16),
        TensorRef(ref.slot, 0, 5, 16),
    ):
        with pytest.raises(StaleTensorRefError):
            slab.get(forged)


def test_freed_pages_coalesce_for_a_big_put():
    slab = TensorSlab.create(64 * PAGE_BYTES, num_slots=32, page_bytes=PAGE_BYTES)
    page = np.ones(PAGE_BYTES, dtype=np.uint8)
    refs = [slab.put(page * i, tag=i) for i in range(16)]  # pages 0..15 of 64
    filler = slab.put(np.zeros(48 * PAGE_BYTES, dtype=np.uint8), tag=100)  # pages 16..63
    for ref in refs[1::2]:
        slab.free(ref)  # every other page: 8 free pages, no two adjacent
    assert slab.free_bytes == 8 * PAGE_BYTES and slab.largest_free_run_bytes() == PAGE_BYTES
    two_pages = np.zeros(2 * PAGE_BYTES, dtype=np.uint8)
    with pytest.raises(TensorSlabFullError, match="no 2 contiguous free pages"):
        slab.put(two_pages, tag=200)
    for ref in refs[2:8:2]:
        slab.free(ref)  # pages 1..7 are now one run of 7
    big = np.arange(7 * PAGE_BYTES, dtype=np.uint8)
    ref = slab.put(big, tag=201)
    assert slab.get(ref).ctypes.data == slab.get(refs[0]).ctypes.data + PAGE_BYTES  # first fit
    np.testing.assert_array_equal(slab.get(ref), big)
    np.testing.assert_array_equal(slab.get(refs[0]), page * 0)
    np.testing.assert_array_equal(slab.get(refs[8]), page * 8)
    assert slab.get(filler).sum() == 0
    slab.close()


def test_full_and_oversized_puts_raise_and_change_nothing():
    with TensorSlab.create(4 * PAGE_BYTES, num_slots=2, page_bytes=PAGE_BYTES) as slab:
        kept = slab.put(np.arange(PAGE_BYTES, dtype=np.uint8), tag=1)
        before = (slab.free_bytes, slab.num_free_slots, slab.largest_free_run_bytes())
        with pytest.raises(TensorTooLargeError, match=r"5 \* 4096|20480 bytes") as too_large:
            slab.put(np.zeros(5 * PAGE_BYTES, dtype=np.uint8), tag=2)
        assert isinstance(too_large.value, ValueError) and isinstance(too_large.value, IpcError)
        assert (too_large.value.capacity_bytes, too_large.value.nbytes) == (16384, 20480)
        assert "16384 bytes" in str(too_large.value)
        with pytest.raises(TensorSlabFullError, match="16384 bytes") as full:
            slab.put(np.zeros(4 * PAGE_BYTES, dtype=np.uint8), tag=3)  # fits an empty slab
        assert full.value.nbytes == 4 * PAGE_BYTES
        with pytest.raises(ValueError, match="dtype float64"):
            slab.put(np.zeros(4), tag=4)
        with pytest.raises(ValueError, match="5 dimensions"):
            slab.put(np.zeros((1,) * 5, dtype=np.float32), tag=4)
        with pytest.raises(ValueError, match="int64"):
            slab.put(np.zeros(4, dtype=np.float32), tag=1 << 63)
        assert (slab.free_bytes, slab.num_free_slots, slab.largest_free_run_bytes()) == before
        slab.put(np.zeros(8, dtype=np.float32), tag=5)
        assert not slab.can_put(1)  # both slots in use
        with pytest.raises(TensorSlabFullError, match="all 2 slots in use"):
            slab.put(np.zeros(8, dtype=np.float32), tag=6)
        np.testing.assert_array_equal(slab.get(kept), np.arange(PAGE_BYTES, dtype=np.uint8))


def test_free_tag_frees_only_that_tag(slab):
    mine = [slab.put(np.full(10, i, dtype=np.int64), tag=42) for i in range(3)]
    other = slab.put(np.full(10, 9, dtype=np.int64), tag=43)
    assert slab.free_tag(42) == 3
    assert slab.free_tag(42) == 0
    for ref in mine:
        with pytest.raises(StaleTensorRefError):
            slab.get(ref)
    np.testing.assert_array_equal(slab.get(other), np.full(10, 9))
    assert slab.num_free_slots == 15 and slab.free_bytes == SLAB_BYTES - PAGE_BYTES


def test_close_unlinks_and_a_peer_keeps_its_views():
    owner = TensorSlab.create(PAGE_BYTES, page_bytes=PAGE_BYTES)
    ref = owner.put(np.arange(10, dtype=np.float32), tag=1)
    peer = TensorSlab.attach(owner.name)
    view = peer.get(ref)
    owner.close()
    assert not _shm_exists(owner.name)
    np.testing.assert_array_equal(view, np.arange(10))  # the mapping outlives the name
    del view  # (a view alive when its SharedMemory is collected warns at collection)
    peer.close()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TensorSlab.attach(owner.name)


def test_attach_refuses_a_segment_that_is_not_a_slab():
    from ringllm.ipc.shm import Segment

    with Segment.create("not-a-slab", 4096) as segment:
        with pytest.raises(SlabLayoutError, match="not a tensor slab"):
            TensorSlab.attach(segment.name)


def test_a_killed_owner_leaves_a_segment_that_cleanup_stale_removes():
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    words = owner.stdout.readline().split()
    assert words, owner.stderr.read()
    name, ref = words[0], TensorRef.from_ints(words[1:])
    with TensorSlab.attach(name) as peer:
        np.testing.assert_array_equal(peer.get(ref), np.arange(100))
    owner.kill()  # SIGKILL: nothing runs in the owner
    owner.wait(30)
    assert _shm_exists(name)
    assert name in cleanup_stale()
    assert not _shm_exists(name)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="capacity_bytes"):
        TensorSlab.create(0)
    with pytest.raises(ValueError, match="page_bytes"):
        TensorSlab.create(4096, page_bytes=100)
    with pytest.raises(ValueError, match="num_slots"):
        TensorSlab.create(4096, num_slots=0)
    with pytest.raises(ValueError, match="4 ints"):
        TensorRef.from_ints([1, 2, 3])
