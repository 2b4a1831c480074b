"""RecordPacker (_packer.c): rows of Python values -> record bytes, against numpy's own
conversion as the oracle, and every kind of bad value as a clear error."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ringllm.ipc._packer import Packer
from ringllm.ipc.packer import RecordPacker

# Every code the packer knows, an array field, a bytes field, and padding (aligned dtype).
RECORD = np.dtype(
    [
        ("i8", "i1"),
        ("u8", "u1"),
        ("i16", "<i2"),
        ("u16", "<u2"),
        ("i32", "<i4"),
        ("u32", "<u4"),
        ("i64", "<i8"),
        ("u64", "<u8"),
        ("f32", "<f4"),
        ("f64", "<f8"),
        ("flag", "?"),
        ("ids", "<i4", 5),
        ("name", "S6"),
    ],
    align=True,
)
LIMITS = {"i1": 2**7, "u1": 0, "i2": 2**15, "u2": 0, "i4": 2**31, "u4": 0, "i8": 2**63, "u8": 0}


def _row(k: int) -> tuple:
    return (
        -128 + k,
        255 - k,
        -(2**15) + k,
        2**16 - 1 - k,
        -(2**31) + k,
        2**32 - 1 - k,
        -(2**63) + k,
        2**64 - 1 - k,
        1.5 / (k + 1),
        math.pi * k,
        k % 2 == 1,
        [k, k + 1, -k, 7, 2**31 - 1],
        b"ab" * (k % 4),
    )


def test_packed_bytes_equal_numpys_conversion_including_padding():
    rows = [_row(k) for k in range(6)]
    packer = RecordPacker(RECORD)
    assert RECORD.itemsize > sum(RECORD[name].itemsize for name in RECORD.names)  # has padding
    packed = packer.pack(rows)
    expected = np.zeros(len(rows), RECORD)  # field by field: the padding stays zero
    for index, name in enumerate(RECORD.names):  # (np.array(rows) leaves it uninitialized)
        expected[name] = [row[index] for row in rows]
    assert packed == expected.tobytes()
    assert packer.pack(tuple(list(row) for row in rows)) == packed  # lists and tuples alike
    assert packer.pack([]) == b""
    assert np.frombuffer(packed, RECORD)["u64"][0] == 2**64 - 1


def test_short_arrays_and_bytes_are_zero_filled():
    row = list(_row(1))
    row[-2], row[-1] = [9, 8], b""
    packed = np.frombuffer(RecordPacker(RECORD).pack([row]), RECORD)
    assert packed["ids"][0].tolist() == [9, 8, 0, 0, 0]
    assert packed["name"][0] == b""


def test_numpy_scalars_and_ints_for_floats_are_accepted():
    row = list(_row(2))
    row[4], row[8], row[9] = np.int64(-5), 3, np.float32(0.25)
    row[-2] = np.arange(5, dtype=np.int32)
    packed = np.frombuffer(RecordPacker(RECORD).pack([row]), RECORD)
    assert packed["i32"][0] == -5 and packed["f32"][0] == 3.0 and packed["f64"][0] == 0.25
    assert packed["ids"][0].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("index", [0, 1, 2, 3, 4, 5, 6, 7])
def test_integers_out_of_range_raise_overflow_naming_row_and_field(index):
    packer = RecordPacker(RECORD)
    name = RECORD.names[index]
    kind = RECORD[name].str[1:]
    low = -LIMITS[kind] if LIMITS[kind] else 0
    high = (LIMITS[kind] if LIMITS[kind] else 2 ** (8 * RECORD[name].itemsize)) - 1
    for bad in (low - 1, high + 1):
        row = list(_row(0))
        row[index] = bad
        with pytest.raises(OverflowError, match=rf"row 1, field '{name}'"):
            packer.pack([_row(0), row])
    row = list(_row(0))
    row[index] = high  # the limits themselves fit
    assert np.frombuffer(packer.pack([row]), RECORD)[name][0] == high


def test_bad_values_are_clear_errors():
    packer = RecordPacker(RECORD)

    def pack_with(index: int, value):
        row = list(_row(0))
        row[index] = value
        return packer.pack([row])

    with pytest.raises(TypeError, match=r"row 0, field 'i32' \(i\): needs an integer"):
        pack_with(4, 1.0)  # as struct: no silent truncation of a float
    with pytest.raises(TypeError, match="needs an integer"):
        pack_with(4, "7")
    with pytest.raises(TypeError, match=r"field 'f64' \(d\): needs a number"):
        pack_with(9, "x")
    with pytest.raises(OverflowError, match="too large for float32"):
        pack_with(8, 1e39)
    assert np.isinf(np.frombuffer(pack_with(8, math.inf), RECORD)["f32"][0])  # inf is a value
    with pytest.raises(ValueError, match="field 'ids': 6 values, the field holds 5"):
        pack_with(11, range(6))
    with pytest.raises(TypeError, match="field 'ids'.*needs a sequence"):
        pack_with(11, 5)
    with pytest.raises(ValueError, match="field 'name': 7 bytes, the field holds 6"):
        pack_with(12, b"x" * 7)
    with pytest.raises(TypeError, match="field 'name'.*needs bytes"):
        pack_with(12, "text")
    with pytest.raises(ValueError, match="row 0 has 12 values, the record has 13 fields"):
        packer.pack([_row(0)[:-1]])
    with pytest.raises(TypeError, match="row 1 is not a tuple or list"):
        packer.pack([_row(0), 5])
    with pytest.raises(TypeError, match="sequence of rows"):
        packer.pack(5)


def test_layouts_that_cannot_be_packed_are_refused():
    with pytest.raises(ValueError, match="cannot be packed"):
        RecordPacker(np.dtype([("x", ">i4")]))  # big-endian
    with pytest.raises(ValueError, match="cannot be packed"):
        RecordPacker(np.dtype([("x", "<f2")]))
    with pytest.raises(ValueError, match="structured dtype"):
        RecordPacker(np.dtype("<i4"))
    with pytest.raises(ValueError, match="does not fit a 4-byte record"):
        Packer(4, [(2, "i", 1, "x")])
    with pytest.raises(ValueError, match="does not fit"):
        Packer(8, [(0, "z", 1, "x")])
    with pytest.raises(ValueError, match="itemsize must be >= 1"):
        Packer(0, [])
