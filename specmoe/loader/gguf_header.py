"""A lazy reader of a GGUF file: metadata values decoded when asked for, tensor infos, and each
tensor's data as a view of one read-only memory map of the file.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array when it
opens a file; a tokenizer of 151,936 tokens and as many merges makes that seconds of work on
every load. This reader walks the header once with `struct` (an array of strings is skipped
length by length without decoding), keeps where each value starts, and decodes only the keys
it is asked for. The layout is the GGUF specification's (ggml `docs/gguf.md`, versions 2 and
3, little-endian): magic, version, tensor count, metadata count, the metadata key/value
pairs, the tensor infos (name, dims, type, offset), then the tensor data at
`general.alignment` (32 by default). Types, block sizes and the byte shape of quantised rows
come from the `gguf` package, as do `dequantize` and the writer; only the header walk is ours.

The data views follow `gguf.GGUFReader`: F16/F32/F64/I8/I16/I32/I64 tensors are typed arrays of
the reversed GGUF dims; every other type is uint8 rows of its blocks, [..., row bytes].
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version, tensor count, metadata count
DEFAULT_ALIGNMENT = 32

_T = GGUFValueType
_SCALARS = {_T.UINT8: "B", _T.INT8: "b", _T.UINT16: "H", _T.INT16: "h", _T.UINT32: "I",
            _T.INT32: "i", _T.FLOAT32: "f", _T.BOOL: "?", _T.UINT64: "Q", _T.INT64: "q",
            _T.FLOAT64: "d"}
_TYPED = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class Field:
    """One metadata key: `types` is [type] or [ARRAY, element type] (as `gguf.ReaderField`),
    `count` the array's length (1 for a scalar); the value is decoded by `contents()`."""

    name: str
    types: list
    count: int
    offset: int  # of the value (an array: of its first element)
    header: "GGUFHeader"

    def contents(self) -> Any:
        """The value: int, float, bool, str, or a list of them for an array."""
        kind = self.types[-1]
        if self.types[0] is not _T.ARRAY:
            return self.header.value_at(kind, self.offset)[0]
        if kind in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[kind])
            return np.frombuffer(self.header.buffer, dtype, self.count, self.offset).tolist()
        out, at = [], self.offset
        for _ in range(self.count):
            value, at = self.header.value_at(kind, at)
            out.append(value)
        return out


class TensorInfo(NamedTuple):
    """A tensor of the file, with the attributes of `gguf.ReaderTensor` the loader reads."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGUF dims, innermost first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFHeader:
    """The metadata and tensors of a GGUF file (module docstring).

    Attributes:
        fields: key -> `Field`, in file order.
        tensors: every tensor, in file order.
        mapping: the read-only `mmap.mmap` the data views read (for `madvise`).

    Raises:
        ValueError: not a GGUF file, an unsupported version or a big-endian file, a header
            that runs past the end of the file, an unknown value or tensor type, a
            duplicated tensor name, or tensor data past the end of the file.
        OSError: the file cannot be opened or mapped.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER_BYTES:
                raise ValueError(f"{self.path} is not a GGUF file ({size} bytes, shorter than "
                                 f"the {HEADER_BYTES}-byte preamble)")
            self.mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.buffer = memoryview(self.mapping)
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path}: truncated or corrupt GGUF header ({exc})") from exc

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)

    def value_at(self, kind: GGUFValueType, at: int) -> tuple[Any, int]:
        """(value of type `kind` at byte `at`, the byte after it)."""
        if kind is _T.STRING:
            (length,) = struct.unpack_from("<Q", self.buffer, at)
            end = at + 8 + length
            if end > len(self.buffer):
                raise ValueError(f"{self.path}: a string runs past the end of the file")
            return str(self.buffer[at + 8:end], "utf-8"), end
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, self.buffer, at)[0], at + struct.calcsize(fmt)

    def _skip(self, kind: GGUFValueType, count: int, at: int) -> int:
        """The byte after `count` values of type `kind` from `at`."""
        if kind in _SCALARS:
            return at + count * struct.calcsize("<" + _SCALARS[kind])
        if kind is not _T.STRING:
            raise ValueError(f"{self.path}: unsupported metadata array of {kind.name}")
        for _ in range(count):
            at += 8 + struct.unpack_from("<Q", self.buffer, at)[0]
        return at

    def _parse(self) -> None:
        if bytes(self.buffer[:4]) != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (starts with "
                             f"{bytes(self.buffer[:4])!r}, expected {MAGIC!r})")
        version, num_tensors, num_fields = struct.unpack_from("<IQQ", self.buffer, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3; "
                             "a big-endian file reads as a huge version)")
        at = HEADER_BYTES
        self.fields: dict[str, Field] = {}
        for _ in range(num_fields):
            name, at = self.value_at(_T.STRING, at)
            at = self._read_field(name, at)
        infos = []
        for _ in range(num_tensors):
            name, at = self.value_at(_T.STRING, at)
            (n_dims,) = struct.unpack_from("<I", self.buffer, at)
            dims = np.frombuffer(self.buffer, "<u8", n_dims, at + 4).copy()
            raw_type, offset = struct.unpack_from("<IQ", self.buffer, at + 4 + 8 * n_dims)
            infos.append((name, dims, raw_type, offset))
            at += 4 + 8 * n_dims + 12
        field = self.fields.get("general.alignment")
        alignment = field.contents() if field is not None else DEFAULT_ALIGNMENT
        start = at + (-at) % alignment
        self.tensors = [self._tensor(name, dims, raw_type, start + offset)
                        for name, dims, raw_type, offset in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{self.path}: a tensor name appears twice")

    def _read_field(self, name: str, at: int) -> int:
        (raw,) = struct.unpack_from("<I", self.buffer, at)
        kind = _value_type(raw, self.path, name)
        at += 4
        if kind is not _T.ARRAY:
            self.fields[name] = Field(name, [kind], 1, at, self)
            return self._skip(kind, 1, at)
        raw_item, count = struct.unpack_from("<IQ", self.buffer, at)
        item = _value_type(raw_item, self.path, name)
        self.fields[name] = Field(name, [kind, item], count, at + 12, self)
        return self._skip(item, count, at + 12)

    def _tensor(self, name: str, dims: np.ndarray, raw_type: int, offset: int) -> TensorInfo:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown type {raw_type}") from None
        n_elements = int(np.prod(dims))
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elements * type_size // block
        if offset + n_bytes > len(self.buffer):
            raise ValueError(f"{self.path}: tensor {name!r} ({n_bytes} bytes at {offset}) runs "
                             f"past the end of the file ({len(self.buffer)} bytes)")
        np_dims = tuple(int(d) for d in reversed(dims.tolist()))
        if ggml_type in _TYPED:
            data = np.frombuffer(self.buffer, _TYPED[ggml_type], n_elements, offset)
        else:
            data = np.frombuffer(self.buffer, np.uint8, n_bytes, offset)
            np_dims = quant_shape_to_byte_shape(np_dims, ggml_type)
        return TensorInfo(name, ggml_type, dims, n_elements, n_bytes, offset,
                          data.reshape(np_dims))


def _value_type(raw: int, path: Path, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ValueError(f"{path}: metadata {key!r} has unknown value type {raw}") from None
