"""The disk KV tier's store: exact round trips, a restart in a new process, and every file
it must not trust (another fingerprint, truncated, a flipped byte, a torn write) ignored;
directories it cannot use refused at open with the path and the numbers."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from ringllm.pipeline.ops import kv_int8
from ringllm.pipeline.worker import kv_disk
from ringllm.pipeline.worker.kv_disk import DiskKVStore
from ringllm.pipeline.worker.kv_disk_file import HEADER_BYTES, TABLE_DTYPE

SHAPE = (2, 4, 8)  # num_kv_heads, block_size, head_size
LAYERS = 3
NUM_BLOCKS = 10
MAX_BYTES = 64 * 4096
FINGERPRINT = {"model": "/models/a", "config_sha256": "ab12", "tp_size": 1, "tp_rank": 0}
# chained-hash-like 128-bit values, the top bit set in some
HASHES = [(0x9E3779B97F4A7C15F39CC0605CEDC834 * (i + 1)) % (1 << 128) for i in range(8)]
BITS = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float8_e4m3fn: torch.int8,
    torch.int8: torch.int8,
}


def make_caches(dtype, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random bit patterns (NaNs and denormals too): a round trip must keep every bit."""
    gen = torch.Generator().manual_seed(seed)
    bits = BITS[dtype]
    info = torch.iinfo(bits)

    def one():
        raw = torch.randint(info.min, info.max, (NUM_BLOCKS, *SHAPE), generator=gen, dtype=bits)
        if dtype is torch.int8:  # the int8 KV cache, its scales behind its values
            cache = kv_int8.new_cache(raw.shape, dtype, "cpu")
            cache.copy_(raw)
            kv_int8.kv_scales(cache).uniform_(0.0, 1.0, generator=gen)
            return cache
        return raw.view(dtype)

    return [one() for _ in range(LAYERS)], [one() for _ in range(LAYERS)]


def empty_caches(dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    zeros = [kv_int8.new_cache((NUM_BLOCKS, *SHAPE), dtype, "cpu") for _ in range(2 * LAYERS)]
    return zeros[:LAYERS], zeros[LAYERS:]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def same_scales(a: torch.Tensor, a_blocks, b: torch.Tensor, b_blocks) -> bool:
    """An int8 cache's blocks' scales (other caches have none: True)."""
    if a.dtype is not torch.int8:
        return True
    return torch.equal(kv_int8.kv_scales(a)[a_blocks], kv_int8.kv_scales(b)[b_blocks])


def open_store(directory, dtype=torch.bfloat16, **kwargs) -> DiskKVStore:
    args = dict(fingerprint=FINGERPRINT, block_shape=SHAPE, num_layers=LAYERS, dtype=dtype)
    args |= dict(max_bytes=MAX_BYTES) | kwargs
    return DiskKVStore.open(directory, **args)


def assert_loaded(store, slots, hashes, caches, src_blocks) -> None:
    """The slots read back equal blocks `src_blocks` of `caches`, bit for bit."""
    keys, values = empty_caches(caches[0][0].dtype)
    dst_blocks = list(range(len(slots)))
    assert store.read(slots, hashes, keys, values, dst_blocks).tolist() == [True] * len(slots)
    for layer in range(LAYERS):
        assert same_bits(keys[layer][dst_blocks], caches[0][layer][src_blocks])
        assert same_bits(values[layer][dst_blocks], caches[1][layer][src_blocks])


def child_code(body: str) -> str:
    """A child's script: the prelude (its args, `open_store`), then `body`."""
    return textwrap.dedent(CHILD_PRELUDE) + textwrap.dedent(body)


def run_child(body: str, args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", child_code(body), args],
        capture_output=True,
        text=True,
        timeout=120,
    )


CHILD_PRELUDE = """
    import json, os, sys, torch
    from ringllm.pipeline.worker.kv_disk import DiskKVStore
    args = json.loads(sys.argv[1])
    def open_store(**kw):
        return DiskKVStore.open(args["dir"], args["fingerprint"], tuple(args["shape"]),
                                args["layers"], torch.bfloat16, args["max_bytes"], **kw)
"""


def child_args(directory, **more) -> str:
    args = dict(dir=str(directory), fingerprint=FINGERPRINT, shape=SHAPE)
    return json.dumps(args | dict(layers=LAYERS, max_bytes=MAX_BYTES) | more)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8]
)
def test_round_trip_is_exact(tmp_path, dtype):
    keys, values = make_caches(dtype, seed=1)
    with open_store(tmp_path, dtype) as store:
        slots, src = [5, 0, 3, 9, 1], [7, 0, 2, 9, 4]
        store.write(slots, HASHES[:5], keys, values, src)
        assert store.valid_entries() == dict(zip(HASHES[:5], slots, strict=True))
        got_keys, got_values = empty_caches(dtype)
        dst = [2, 8, 0, 5, 6]
        assert store.read(slots, HASHES[:5], got_keys, got_values, dst).all()
        for layer in range(LAYERS):
            assert same_bits(got_keys[layer][dst], keys[layer][src])
            assert same_bits(got_values[layer][dst], values[layer][src])
            assert same_scales(got_keys[layer], dst, keys[layer], src)
            assert same_scales(got_values[layer], dst, values[layer], src)
            untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
            assert not got_keys[layer][untouched].any() and not got_values[layer][untouched].any()
            if dtype is torch.int8:  # the scales of blocks no slot was read into: still 0
                assert not kv_int8.kv_scales(got_keys[layer])[untouched].any()


def test_restart_in_a_new_process_keeps_entries_and_data(tmp_path):
    """A writer that dies without flush or close (os._exit) loses nothing it wrote."""
    keys, values = make_caches(torch.bfloat16, seed=2)
    torch.save((keys, values), tmp_path / "caches.pt")
    child = run_child(
        """
        keys, values = torch.load(args["caches"])
        store = open_store()
        store.write([4, 2, 6], args["hashes"], keys, values, [1, 3, 5])
        os._exit(0)
        """,
        child_args(tmp_path / "kv", caches=str(tmp_path / "caches.pt"), hashes=HASHES[:3]),
    )
    assert child.returncode == 0, child.stderr
    with open_store(tmp_path / "kv") as store:
        assert store.valid_entries() == {HASHES[0]: 4, HASHES[1]: 2, HASHES[2]: 6}
        assert_loaded(store, [4, 2, 6], HASHES[:3], (keys, values), [1, 3, 5])


def test_a_new_process_reads_what_this_one_wrote(tmp_path):
    keys, values = make_caches(torch.bfloat16, seed=3)
    with open_store(tmp_path / "kv") as store:
        store.write([1, 7], HASHES[:2], keys, values, [8, 2])
        store.flush()
    child = run_child(
        """
        store = open_store()
        keys = [torch.zeros(4, *args["shape"], dtype=torch.bfloat16) for _ in range(args["layers"])]
        values = [torch.zeros_like(k) for k in keys]
        loaded = store.read([1, 7], args["hashes"], keys, values, [0, 3])
        torch.save((keys, values), args["out"])
        print(json.dumps({"entries": list(store.valid_entries().items()), "loaded": loaded.tolist()}))
        """,
        child_args(tmp_path / "kv", hashes=HASHES[:2], out=str(tmp_path / "out.pt")),
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)
    assert report == {"entries": [[HASHES[0], 1], [HASHES[1], 7]], "loaded": [True, True]}
    got_keys, got_values = torch.load(tmp_path / "out.pt")
    for layer in range(LAYERS):
        assert same_bits(got_keys[layer][[0, 3]], keys[layer][[8, 2]])
        assert same_bits(got_values[layer][[0, 3]], values[layer][[8, 2]])


def fill(directory, dtype=torch.bfloat16, **kwargs):
    keys, values = make_caches(dtype, seed=4)
    with open_store(directory, dtype, **kwargs) as store:
        store.write([0, 1, 2], HASHES[:3], keys, values, [0, 1, 2])
        return store.path, store.layout, (keys, values)


OTHER_FILES = {
    "model": dict(fingerprint=FINGERPRINT | {"model": "/models/b"}),
    "config.json": dict(fingerprint=FINGERPRINT | {"config_sha256": "ab13"}),
    "dtype": dict(dtype=torch.float32),
    "block size": dict(block_shape=(2, 8, 8)),
    "layers": dict(num_layers=LAYERS + 1),
    "size cap": dict(max_bytes=MAX_BYTES * 2),
}


@pytest.mark.parametrize("change", list(OTHER_FILES))
def test_a_file_for_anything_else_is_discarded(tmp_path, caplog, change):
    path, _, _ = fill(tmp_path)
    with caplog.at_level(logging.WARNING), open_store(tmp_path, **OTHER_FILES[change]) as store:
        assert store.valid_entries() == {}
        assert os.path.getsize(path) == store.layout.file_bytes
    assert f"discarding {path}" in caplog.text


def test_another_rank_does_not_load_a_renamed_file(tmp_path, caplog):
    path, _, _ = fill(tmp_path)
    os.rename(path, tmp_path / "ringllm-kv-rank1.bin")
    with caplog.at_level(logging.WARNING), open_store(tmp_path, rank=1) as store:
        assert store.path.name == "ringllm-kv-rank1.bin"
        assert store.valid_entries() == {}
    assert "another model, dtype, block size, KV layout or rank" in caplog.text


def test_the_fingerprint_is_canonical(tmp_path):
    fill(tmp_path)
    reordered = dict(reversed(list(FINGERPRINT.items())))
    with open_store(tmp_path, fingerprint=reordered) as store:
        assert store.valid_entries() == dict(zip(HASHES[:3], [0, 1, 2], strict=True))
    with pytest.raises(ValueError, match="fingerprint must be JSON data"):
        open_store(tmp_path, fingerprint={"model": object()})


@pytest.mark.parametrize("size", ["one byte short", "header only", "empty"])
def test_a_truncated_file_is_discarded(tmp_path, size):
    path, layout, _ = fill(tmp_path)
    keep = {"one byte short": layout.file_bytes - 1, "header only": HEADER_BYTES, "empty": 0}
    os.truncate(path, keep[size])
    with open_store(tmp_path) as store:
        assert store.valid_entries() == {}
        assert os.path.getsize(path) == layout.file_bytes


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_flipped_data_byte_drops_only_that_slot(tmp_path, caplog, where):
    path, layout, src = fill(tmp_path)
    offset = {"first": 0, "last": layout.slot_data_bytes - 1}[where]
    flip_byte(path, layout.data_offset + 1 * layout.slot_bytes + offset)
    with caplog.at_level(logging.WARNING), open_store(tmp_path) as store:
        assert store.valid_entries() == {HASHES[0]: 0, HASHES[2]: 2}
        keys, values = empty_caches(torch.bfloat16)
        assert not store.read([1], [HASHES[1]], keys, values, [0]).any()
        assert_loaded(store, [0, 2], [HASHES[0], HASHES[2]], src, [0, 2])
    assert "slot 1 fails its checksum" in caplog.text


def test_without_the_scan_a_read_still_refuses_a_damaged_slot(tmp_path):
    path, layout, src = fill(tmp_path)
    flip_byte(path, layout.data_offset + 2 * layout.slot_bytes + 17)
    with open_store(tmp_path, verify_at_open=False) as store:
        assert len(store.valid_entries()) == 3  # the table alone cannot know
        keys, values = empty_caches(torch.bfloat16)
        assert store.read([2, 0], [HASHES[2], HASHES[0]], keys, values, [3, 4]).tolist() == [
            False,
            True,
        ]
        assert not keys[0][3].any()  # a refused slot leaves its block untouched
        assert HASHES[2] not in store.valid_entries()  # and is marked invalid


@pytest.mark.parametrize("field", ["hash_lo", "hash_hi", "seq", "checksum", "state"])
def test_a_flipped_table_byte_drops_only_that_slot(tmp_path, field):
    path, layout, _ = fill(tmp_path)
    flip_byte(path, layout.table_offset + 1 * TABLE_DTYPE.itemsize + TABLE_DTYPE.fields[field][1])
    with open_store(tmp_path) as store:
        assert store.valid_entries() == {HASHES[0]: 0, HASHES[2]: 2}


@pytest.mark.parametrize("offset", [0, 12, 30, 56, 2000, HEADER_BYTES - 1])
def test_a_flipped_header_byte_discards_the_file(tmp_path, caplog, offset):
    path, _, _ = fill(tmp_path)
    flip_byte(path, offset)
    with caplog.at_level(logging.WARNING), open_store(tmp_path) as store:
        assert store.valid_entries() == {}
    assert "discarding" in caplog.text


@pytest.mark.parametrize("killed_in", ["_seal", "_mark_valid"])
def test_a_torn_write_is_never_loaded(tmp_path, killed_in):
    """The writer dies after the data (_seal: before the table entry; _mark_valid: with
    hash and checksum written, before VALID): neither the new block nor the one it was
    overwriting (slot 1) loads; the slot written before (slot 0) does."""
    keys, values = make_caches(torch.bfloat16, seed=5)
    torch.save((keys, values), tmp_path / "caches.pt")
    child = run_child(
        """
        keys, values = torch.load(args["caches"])
        store = open_store()
        store.write([0, 1], args["hashes"][:2], keys, values, [0, 1])
        setattr(DiskKVStore, args["killed_in"], lambda *a: os._exit(7))
        store.write([2, 1], args["hashes"][2:4], keys, values, [2, 3])
        """,
        child_args(
            tmp_path / "kv",
            caches=str(tmp_path / "caches.pt"),
            hashes=HASHES[:4],
            killed_in=killed_in,
        ),
    )
    assert child.returncode == 7, child.stderr
    with open_store(tmp_path / "kv") as store:
        assert store.valid_entries() == {HASHES[0]: 0}
        keys_out, values_out = empty_caches(torch.bfloat16)
        for slot, block_hash in ((2, HASHES[2]), (1, HASHES[3]), (1, HASHES[1])):
            assert not store.read([slot], [block_hash], keys_out, values_out, [0]).any()
        assert_loaded(store, [0], [HASHES[0]], (keys, values), [0])


def test_a_wrong_expected_hash_is_not_loaded(tmp_path):
    fill(tmp_path)
    wrong = [HASHES[0] ^ 1, HASHES[1] ^ (1 << 100), HASHES[5]]  # low half, high half, another
    with open_store(tmp_path) as store:
        keys, values = empty_caches(torch.bfloat16)
        assert not store.read([0, 1, 2], wrong, keys, values, [0, 1, 2]).any()
        assert not any(k.any() for k in keys + values)
        # NOTE: the slots keep the blocks they hold (the caller's index was stale, not the slot)
        assert store.valid_entries() == dict(zip(HASHES[:3], [0, 1, 2], strict=True))


def test_invalidate_and_overwrite_survive_a_reopen_in_write_order(tmp_path):
    keys, values = make_caches(torch.bfloat16, seed=6)
    with open_store(tmp_path) as store:
        store.write([0, 1, 2], HASHES[:3], keys, values, [0, 1, 2])
        store.invalidate([1])
        store.write([0], [HASHES[4]], keys, values, [4])  # slot 0 now the newest
        store.write([3], [HASHES[2]], keys, values, [2])  # the same block again, newer
        # oldest write first; of two slots with one hash the newest names it
        assert list(store.valid_entries().items()) == [(HASHES[4], 0), (HASHES[2], 3)]
    with open_store(tmp_path) as store:
        # the older slot of the two was marked empty at open
        assert list(store.valid_entries().items()) == [(HASHES[4], 0), (HASHES[2], 3)]
        assert_loaded(store, [0, 3], [HASHES[4], HASHES[2]], (keys, values), [4, 2])
        store.write([2], [HASHES[6]], keys, values, [6])  # sequence numbers go on after a reopen
        assert list(store.valid_entries())[-1] == HASHES[6]


@pytest.mark.parametrize("max_bytes", [3 * 4096, 8 * 4096 + 1, MAX_BYTES, 10**6, 2**22 - 1])
def test_the_file_is_the_whole_slots_that_fit_the_cap(tmp_path, max_bytes):
    with open_store(tmp_path, max_bytes=max_bytes) as store:
        layout = store.layout
        table_bytes = layout.data_offset - HEADER_BYTES
        size = os.path.getsize(store.path)
        assert size == HEADER_BYTES + table_bytes + layout.num_slots * layout.slot_bytes
        assert size <= max_bytes
        assert layout.slot_bytes == 4096  # 2 * 3 layers * 64 elements * 2 bytes, one page
        n = layout.num_slots + 1  # one more slot (and its table entry) would not fit
        assert HEADER_BYTES + -(-n * TABLE_DTYPE.itemsize // 4096) * 4096 + n * 4096 > max_bytes
        assert os.stat(store.path).st_blocks * 512 >= size  # allocated, not sparse


def test_a_cap_under_one_block_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"max_bytes=8191 .* holds no block"):
        open_store(tmp_path, max_bytes=8191)


def test_a_missing_directory_is_created(tmp_path):
    with open_store(tmp_path / "a" / "b") as store:
        assert store.path.parent.is_dir()


def test_a_file_where_the_directory_should_be_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=f"{tmp_path / 'f'} is not a directory"):
        open_store(tmp_path / "f")
    with pytest.raises(ValueError, match=f"{tmp_path / 'f' / 'kv'}: cannot create it"):
        open_store(tmp_path / "f" / "kv")


def test_a_read_only_directory_is_refused(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o500)
    try:
        probe = directory / "probe"
        try:
            probe.write_text("")
        except PermissionError:
            pass
        else:
            pytest.skip(
                "this process writes into a 0o500 directory (root): see the bind mount test"
            )
        with pytest.raises(ValueError, match=f"{directory}.*cannot open it for writing"):
            open_store(directory)
    finally:
        directory.chmod(0o700)


def test_a_read_only_mount_is_refused(tmp_path):
    """Root writes anywhere chmod allows; a read-only bind mount (in a private user and mount
    namespace: `unshare -rm`) stops root too."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) for a read-only bind mount")
    directory = tmp_path / "ro"
    directory.mkdir()
    body = """
        try:
            open_store()
        except ValueError as e:
            print(e)
            sys.exit(0)
        sys.exit(3)
        """
    ro = f"mount --bind {directory} {directory} && mount -o remount,bind,ro {directory}"
    script = f'{ro} || exit 77; exec "$0" -c "$1" "$2"'
    args = [sys.executable, child_code(body), child_args(directory)]
    child = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, *args], capture_output=True, text=True, timeout=120
    )
    if child.returncode == 77 or child.stderr.startswith("unshare:"):
        pytest.skip(f"no read-only bind mount here: {child.stderr.strip()[:200]}")
    assert child.returncode == 0, child.stdout + child.stderr
    expected = (
        f"{directory}/ringllm-kv-rank0.bin: cannot open it for writing (Read-only file system)"
    )
    assert expected in child.stdout


def test_a_cap_over_the_free_space_is_refused(tmp_path):
    stat = os.statvfs(tmp_path)
    free = stat.f_bavail * stat.f_frsize
    with pytest.raises(ValueError, match=r"needs \d+ bytes .* has \d+ bytes .* free") as e:
        open_store(tmp_path, max_bytes=free + (1 << 40))
    assert str(tmp_path) in str(e.value)


def test_a_full_disk_at_allocation_is_refused(tmp_path, monkeypatch):
    """Space can go between the check and the allocation (or a quota): ENOSPC -> ValueError."""

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(kv_disk.os, "posix_fallocate", no_space)
    with pytest.raises(ValueError, match=r"ringllm-kv-rank0.bin needs \d+ bytes"):
        open_store(tmp_path)
    assert os.path.getsize(tmp_path / "ringllm-kv-rank0.bin") == 0


def test_a_file_held_by_another_store_is_refused(tmp_path):
    with open_store(tmp_path):
        with pytest.raises(ValueError, match="held by another process"):
            open_store(tmp_path)
    open_store(tmp_path).close()  # the lock goes with the first one


def test_bad_batches_are_refused(tmp_path):
    keys, values = make_caches(torch.bfloat16, seed=7)
    with open_store(tmp_path) as store:
        with pytest.raises(ValueError, match="name one slot twice"):
            store.write([1, 1], HASHES[:2], keys, values, [0, 1])
        with pytest.raises(ValueError, match="outside"):
            store.write([store.num_slots], HASHES[:1], keys, values, [0])
        with pytest.raises(ValueError, match="128-bit"):
            store.write([0], [1 << 128], keys, values, [0])
        with pytest.raises(ValueError, match="caches' \\[0, 10\\)"):
            store.write([0], HASHES[:1], keys, values, [NUM_BLOCKS])
        with pytest.raises(ValueError, match="the store takes cpu torch.bfloat16"):
            store.write([0], HASHES[:1], [k.float() for k in keys], values, [0])
        with pytest.raises(ValueError, match="2 key_caches, the store has 3 layers"):
            store.read([0], HASHES[:1], keys[:2], values, [0])
        assert store.valid_entries() == {}
        assert store.read([], [], keys, values, []).shape == (0,)
    with pytest.raises(ValueError, match="is closed"):
        store.write([0], HASHES[:1], keys, values, [0])


def test_table_entries_are_32_bytes():
    assert TABLE_DTYPE.itemsize == 32
    assert np.dtype(TABLE_DTYPE).fields["state"][1] == 28
