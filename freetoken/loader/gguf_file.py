"""A GGUF file's header, metadata and tensor infos, read over its memory map without an object
per value.

Why not `gguf.GGUFReader`: it builds numpy views for every piece of every metadata value, so a
vocabulary of 49152 tokens (plus as many merges) becomes ~200k small arrays, a ~165 MiB transient
and two seconds on SmolLM2. Here a string array is one bytes blob plus an offsets array
(StringArray), a numeric array one numpy array, a scalar a Python value, and the tensor infos are
the same fields GGUFReader's ReaderTensor has (without `field`). The gguf package still supplies
the type tables and stays the reference: tests/model/test_gguf_file.py checks that both readers
give the same metadata and tensors.

Not here: what the metadata means (loader/gguf.py reads the model's config and weights,
tokenizer/gguf_vocab.py the vocabulary).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {  # GGUFValueType -> numpy type (the byte order is the file's, set per read)
    GGUFValueType.UINT8: "u1", GGUFValueType.INT8: "i1", GGUFValueType.UINT16: "u2",
    GGUFValueType.INT16: "i2", GGUFValueType.UINT32: "u4", GGUFValueType.INT32: "i4",
    GGUFValueType.FLOAT32: "f4", GGUFValueType.UINT64: "u8", GGUFValueType.INT64: "i8",
    GGUFValueType.FLOAT64: "f8", GGUFValueType.BOOL: "?",
}
# Tensor types whose data GGUFReader views as typed elements; every other type is raw bytes.
_ELEMENT_TYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class StringArray(Sequence[str]):
    """A GGUF array of strings kept as the file's bytes: item i is blob[starts[i]:ends[i]],
    decoded (UTF-8) only when asked for."""

    def __init__(self, blob: bytes, starts: np.ndarray, ends: np.ndarray):
        self.blob, self.starts, self.ends = blob, starts, ends

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.blob[self.starts[i]:self.ends[i]].decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        blob = self.blob
        for start, end in zip(self.starts.tolist(), self.ends.tolist()):
            yield blob[start:end].decode("utf-8")

    def tolist(self) -> list[str]:
        return list(self)


class GGUFTensor(NamedTuple):
    """One tensor's info, as gguf's ReaderTensor has it: shape in GGUF order (ne0, the row
    length, first), data_offset from the file's start, data a view into the map."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # uint64
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """A GGUF (versions 2 and 3, little- or big-endian) mapped read-only: `fields` (key -> value:
    int / float / bool / str, StringArray, a numpy array for a numeric array), `types` (key ->
    its GGUFValueTypes as GGUFReader's field.types lists them: (ARRAY, item type) for an
    array), `tensors` (GGUFTensor), `data` (the whole file, np.memmap) and `path`."""

    def __init__(self, path: str | Path):
        self.path = os.path.abspath(path)
        self.data = np.memmap(self.path, mode="r")
        self._buf = memoryview(self.data)
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (bad magic)")
        version = int.from_bytes(self._buf[4:8], "little")
        self._order = "<"
        if version & 0xFFFF == 0:  # a big-endian file
            self._order = ">"
            version = int.from_bytes(self._buf[4:8], "big")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2, 3)")
        self.version = version
        self._offset = 8
        tensor_count, kv_count = self._unpack("QQ")
        self.fields: dict[str, Any] = {}
        self.types: dict[str, tuple[GGUFValueType, ...]] = {}
        for _ in range(kv_count):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"{self.path}: duplicate metadata key {key!r}")
            types: list[GGUFValueType] = []
            self.fields[key] = self._value(self._unpack("I")[0], types)
            self.types[key] = tuple(types)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        self.alignment = self._alignment()
        self.data_offset = -(-self._offset // self.alignment) * self.alignment
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{self.path}: duplicate tensor names")

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def _unpack(self, fmt: str) -> tuple:
        s = struct.Struct(self._order + fmt)
        values = s.unpack_from(self._buf, self._offset)
        self._offset += s.size
        return values

    def _string(self) -> str:
        (n,) = self._unpack("Q")
        start = self._offset
        self._offset += n
        return bytes(self._buf[start:self._offset]).decode("utf-8")

    def _value(self, kind: int, types: list[GGUFValueType]) -> Any:
        """The value at the cursor; appends its type(s) to `types` (an array's first item's)."""
        kind = GGUFValueType(kind)
        types.append(kind)
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind in _SCALARS:
            return self._array(_SCALARS[kind], 1)[0].item()
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        item_kind, n = self._unpack("IQ")
        item_kind = GGUFValueType(item_kind)
        if item_kind in _SCALARS:
            types.append(item_kind)
            array = self._array(_SCALARS[item_kind], n)
            return array.astype(array.dtype.newbyteorder("="))  # a copy, in this machine's order
        if item_kind == GGUFValueType.STRING:
            types.append(item_kind)
            return self._strings(n)
        # An array of arrays: flattened into one list, as GGUFReader's contents() gives it.
        items = (self._value(item_kind, types if i == 0 else []) for i in range(n))
        return [v for item in items for v in (item if isinstance(item, list) else item.tolist())]

    def _array(self, dtype: str, n: int) -> np.ndarray:
        array = np.frombuffer(self._buf, np.dtype(self._order + dtype), n, self._offset)
        self._offset += array.nbytes
        return array

    def _strings(self, n: int) -> StringArray:
        """n length-prefixed strings: one pass over the lengths, then one copy of their bytes."""
        start = self._offset
        starts = np.empty(n, np.int64)
        ends = np.empty(n, np.int64)
        length = struct.Struct(self._order + "Q")
        buf, offset = self._buf, start
        for i in range(n):
            (size,) = length.unpack_from(buf, offset)
            starts[i] = offset + 8 - start
            offset += 8 + size
            ends[i] = offset - start
        self._offset = offset
        return StringArray(bytes(buf[start:offset]), starts, ends)

    def _tensor_info(self) -> tuple[str, np.ndarray, int, int]:
        name = self._string()
        (n_dims,) = self._unpack("I")
        dims = self._array("u8", n_dims).astype(np.uint64)
        kind, offset = self._unpack("IQ")
        return name, dims, kind, offset

    def _alignment(self) -> int:
        if "general.alignment" not in self.fields:
            return GGUF_DEFAULT_ALIGNMENT
        alignment = self.fields["general.alignment"]
        if self.types["general.alignment"] != (GGUFValueType.UINT32,):
            raise ValueError(f"{self.path}: general.alignment is not a UINT32")
        if alignment == 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment} is not a power of two")
        return alignment

    def _tensor(self, name: str, dims: np.ndarray, kind: int, offset: int) -> GGUFTensor:
        ggml_type = GGMLQuantizationType(kind)
        n_elements = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elements * type_size // block_size
        start = self.data_offset + offset
        shape = tuple(reversed(dims.tolist()))
        if ggml_type in _ELEMENT_TYPES:
            dtype = np.dtype(_ELEMENT_TYPES[ggml_type]).newbyteorder(self._order)
            count = n_elements
        else:
            dtype, count = np.dtype(np.uint8), n_bytes
            shape = quant_shape_to_byte_shape(shape, ggml_type)
        data = np.frombuffer(self.data, dtype, count, start).reshape(shape)
        return GGUFTensor(name, ggml_type, dims, n_elements, n_bytes, start, data)
