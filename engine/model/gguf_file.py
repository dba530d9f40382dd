"""A reader of GGUF files (llama.cpp's format, versions 2 and 3): the metadata and each tensor's
name, type, shape and raw bytes, straight out of a memory map.

``gguf.GGUFReader`` builds a numpy view for every part of every field, a million of them for a
50,000-token vocabulary (several seconds); this one decodes the header with ``struct`` and keeps
only the arrays asked for. Dequantization stays with ``gguf.quants``.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Scalar value types: GGUF's type number -> struct format (little-endian).
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands, or is cut short."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # row-major (numpy order): GGUF's dimensions reversed
    data: np.ndarray  # uint8, [*shape[:-1], bytes of one row]: what gguf.quants decodes


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as exc:
            raise GGUFFormatError(f"GGUF file ends inside its header at byte {self.pos}") from exc
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        end = self.pos + size
        if end > len(self.buf):
            raise GGUFFormatError(f"GGUF file ends inside a string at byte {self.pos}")
        text = bytes(self.buf[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, kind: int, keep: bool) -> Any:
        """One value of type ``kind``; an array is decoded only when ``keep`` (else skipped)."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown GGUF value type {kind}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item in _SCALARS:
            fmt = _SCALARS[item]
            width = struct.calcsize(fmt)
            end = self.pos + width * count
            if end > len(self.buf):
                raise GGUFFormatError(f"GGUF file ends inside an array at byte {self.pos}")
            values = (
                list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos)) if keep else []
            )
            self.pos = end
            return values
        read: Callable[[], Any] = self.string if item == _STRING else lambda: self.value(item, keep)
        values = [read() for _ in range(count)]
        return values if keep else []


class GGUFFile:
    """The metadata (``fields``: scalars and strings, plus the arrays named in ``arrays``) and
    the tensors of a GGUF file. Tensor data are views of the file's memory map."""

    def __init__(self, path: str | Path, arrays: Collection[str] = ()) -> None:
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file
                raise GGUFFormatError(f"{path} is empty") from exc
        cur = _Cursor(memoryview(self._map))
        if bytes(cur.buf[:4]) != _MAGIC:
            raise GGUFFormatError(f"{path} is not a GGUF file (no GGUF magic)")
        cur.pos = 4
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {self.version} is not supported (2 and 3 are)")
        n_tensors, n_fields = cur.unpack("<Q"), cur.unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            name = cur.string()
            kind = cur.unpack("<I")
            keep = name in arrays
            value = cur.value(kind, keep)
            if kind != _ARRAY or keep:
                self.fields[name] = value
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
            kind, offset = cur.unpack("<I"), cur.unpack("<Q")
            infos.append((name, dims, kind, offset))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-cur.pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _tensor(self, start: int, name: str, dims: list[int], kind: int, offset: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(kind)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as exc:
            raise GGUFFormatError(f"tensor {name!r} has unknown type {kind}") from exc
        shape = tuple(reversed(dims)) or (1,)
        if shape[-1] % block:
            raise GGUFFormatError(f"tensor {name!r}: {shape[-1]} is not a multiple of {block}")
        row_bytes = shape[-1] // block * type_size
        size = math.prod(shape[:-1]) * row_bytes
        if start + offset + size > len(self._map):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
        data = np.frombuffer(self._map, dtype=np.uint8, count=size, offset=start + offset)
        return GGUFTensor(name, qtype, shape, data.reshape(*shape[:-1], row_bytes))
