"""A GGUF file's header, read fast: metadata values, the tensor table, the data mapped.

gguf's own `GGUFReader` builds Python objects for every element of every array (a
150,000-token vocabulary is a few seconds of it); an engine process that only needs the
hyper-parameters and the tensor table would pay that at every start. `GGUFFile` reads the
header with numpy: scalars and numeric arrays at once, string arrays (vocabulary, merges)
as one pass over their lengths, and maps the tensor data read-only (np.memmap): a tensor
is read from disk only when its bytes are touched.

    header   "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata key (u64 length + UTF-8) | value type u32 | value   (array: type u32, count u64, items)
    tensors  name | n_dims u32 | dims u64 x n_dims (fastest first) | type u32 | offset u64
    data     at the next multiple of general.alignment (32 by default), tensors at their offsets

Anything malformed (a bad magic, a length past the end, an unknown type, a tensor outside the
file) is a `GGUFFormatError` naming the file and what is wrong.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

_SCALARS = {  # GGUF value type -> numpy dtype
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_DENSE_DTYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.BF16: np.uint16,  # bit patterns; torch views them as bfloat16
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF ringllm can run (or convert), with what is wrong in it."""


class _Malformed(Exception):
    """What is wrong in a header (GGUFFile's constructor names the file around it)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: fastest dimension first
    data: np.ndarray  # a view of the mapping: [rows, row_bytes] uint8 for blocks, else dense
    n_bytes: int
    offset: int  # of its first byte in the file


class GGUFFile:
    """`fields`: metadata key -> value (str, int, float, bool, list); `tensors` in file order."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise GGUFFormatError(f"{self.path}: cannot map the file ({exc})") from None
        self._pos = 0
        try:
            self._read_header()
        except (_Malformed, struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
            raise GGUFFormatError(
                f"{self.path} ({self._map.size} bytes) is not a readable GGUF file: {exc}. "
                "The file is truncated or corrupt; fetch it again."
            ) from None

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    # ---- parsing -----------------------------------------------------------------------

    def _read_header(self) -> None:
        if self._bytes(4) != b"GGUF":
            raise _Malformed("not a GGUF file (no GGUF magic at the start)")
        version = self._unpack("<I")
        if version not in (2, 3):
            raise _Malformed(f"GGUF version {version}; ringllm reads 2 and 3")
        num_tensors, num_fields = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, object] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    def _tensor_info(self) -> tuple:
        name = self._string()
        num_dims = self._unpack("<I")
        shape = tuple(int(d) for d in self._array(np.uint64, num_dims))
        raw_type = self._unpack("<I")
        try:
            tensor_type = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise _Malformed(f"tensor {name!r} has unknown type {raw_type}") from None
        return name, tensor_type, shape, self._unpack("<Q")

    def _tensor(self, data_start: int, name, tensor_type, shape, offset) -> GGUFTensor:
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
        if shape[0] % block_size:
            raise _Malformed(
                f"tensor {name!r} rows of {shape[0]} are not whole "
                f"{tensor_type.name} blocks of {block_size}"
            )
        num_rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        row_bytes = shape[0] // block_size * block_bytes
        start, n_bytes = data_start + offset, num_rows * row_bytes
        if start + n_bytes > self._map.size:
            raise _Malformed(
                f"tensor {name!r} ends at byte {start + n_bytes}, past the end "
                f"of the {self._map.size}-byte file (truncated?)"
            )
        raw = self._map[start : start + n_bytes]
        if tensor_type in _DENSE_DTYPES:
            data = raw.view(_DENSE_DTYPES[tensor_type]).reshape(tuple(reversed(shape)))
        else:
            data = raw.reshape(num_rows, row_bytes)
        return GGUFTensor(name, tensor_type, shape, data, n_bytes, start)

    def _value(self, value_type: int):
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type == _STRING:
                return [self._string() for _ in range(count)]
            if item_type not in _SCALARS:
                raise _Malformed(f"an array of value type {item_type}")
            return self._array(_SCALARS[item_type], count).tolist()
        if value_type not in _SCALARS:
            raise _Malformed(f"unknown metadata value type {value_type}")
        return self._array(_SCALARS[value_type], 1)[0].item()

    def _array(self, dtype, count: int) -> np.ndarray:
        size = np.dtype(dtype).itemsize * int(count)
        return np.frombuffer(self._bytes(size), dtype=np.dtype(dtype).newbyteorder("<"))

    def _string(self) -> str:
        return self._bytes(self._unpack("<Q")).decode("utf-8")

    def _unpack(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self._bytes(size))[0]

    def _bytes(self, size: int) -> bytes:
        end = self._pos + int(size)
        if end > self._map.size:
            raise _Malformed(
                f"the header runs past the end of the {self._map.size}-byte file (truncated?)"
            )
        out = self._map[self._pos : end].tobytes()
        self._pos = end
        return out
