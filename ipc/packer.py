"""`RecordPacker`: rows of Python values -> the bytes of records of a numpy dtype, in C.

The writer of a batch has its records as Python values (a request's sampling fields and
token ids); the ring wants the bytes of the record dtype. `struct.Struct.pack` does one
record per call and builds an argument tuple of every value on the way (~0.5 us for a
52-value request); `RecordPacker.pack(rows)` packs the whole batch in one call
(`_packer.c`), ~4x faster, into one bytes object for `RingWriter.write_bytes`.

A row is a tuple or list with one value per field, in the dtype's field order. A field
with a shape takes a sequence of at most that many numbers (the rest zeroed); an `S`
field takes bytes. Values are checked the way struct checks them; a bad one raises
TypeError / OverflowError / ValueError naming the row and the field.
"""

from __future__ import annotations

import numpy as np

from ringllm.ipc._packer import Packer

# numpy (kind, itemsize) -> the struct module's code (records.py's struct_of uses it too)
STRUCT_CODES = {
    ("i", 1): "b",
    ("u", 1): "B",
    ("i", 2): "h",
    ("u", 2): "H",
    ("i", 4): "i",
    ("u", 4): "I",
    ("i", 8): "q",
    ("u", 8): "Q",
    ("b", 1): "B",
    ("f", 4): "f",
    ("f", 8): "d",
}


class RecordPacker:
    """Packs rows into records of `dtype` (little-endian fields; no nested structs)."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype.fields is None:
            raise ValueError(f"RecordPacker needs a structured dtype, got {self.dtype}")
        fields = []
        for name in self.dtype.names:
            field_type, offset = self.dtype.fields[name][:2]
            base = field_type.base
            count = int(np.prod(field_type.shape)) if field_type.shape else 1
            if base.kind == "S":
                code, count = "s", base.itemsize
            elif (base.kind, base.itemsize) in STRUCT_CODES and base.byteorder in "<=|":
                code = STRUCT_CODES[base.kind, base.itemsize]
            else:
                raise ValueError(
                    f"record field {name!r} of type {field_type} cannot be packed "
                    "(little-endian integers, float32/64 and bytes only)"
                )
            fields.append((offset, code, count, name))
        self._packer = Packer(self.dtype.itemsize, fields)
        self.pack = self._packer.pack  # pack(rows) -> bytes; bound once: no lookup per call
