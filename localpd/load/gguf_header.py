"""A GGUF file's header read straight from a memory map: metadata as plain Python values, and each tensor's type,
shape and place in the file as a numpy view (no copy, nothing read until used).

Numeric arrays (a vocabulary's scores and token types) are read whole with numpy; strings are decoded one after
another in one pass. Results are those of the gguf package's GGUFReader (`field.contents()`, `tensor.data`).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

# ggml type -> (id, elements per block, bytes per block), as ggml numbers them
GGML_TYPES = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "Q8_1": (9, 32, 40), "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "Q8_K": (15, 256, 292),
    "IQ2_XXS": (16, 256, 66), "IQ2_XS": (17, 256, 74), "IQ3_XXS": (18, 256, 98), "IQ1_S": (19, 256, 50),
    "IQ4_NL": (20, 32, 18), "IQ3_S": (21, 256, 110), "IQ2_S": (22, 256, 82), "IQ4_XS": (23, 256, 136),
    "I8": (24, 1, 1), "I16": (25, 1, 2), "I32": (26, 1, 4), "I64": (27, 1, 8), "F64": (28, 1, 8),
    "IQ1_M": (29, 256, 56), "BF16": (30, 1, 2), "TQ1_0": (34, 256, 54), "TQ2_0": (35, 256, 66),
    "MXFP4": (39, 32, 17), "NVFP4": (40, 64, 36), "Q1_0": (41, 128, 18),
}
GGMLType = IntEnum("GGMLType", {name: v[0] for name, v in GGML_TYPES.items()})  # equal to gguf's own enum
BLOCK = {GGMLType[name]: (block, size) for name, (_, block, size) in GGML_TYPES.items()}
ELEMENT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}  # stored as plain elements; other types are read as bytes

# metadata value type -> struct format (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32


class HeaderError(ValueError):
    """The header cannot be read: not GGUF, an unsupported version, or corrupt or truncated."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLType
    shape: tuple[int, ...]  # ggml's ne order: the fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # read-only view of the map: elements for F32/F16/..., else [..., bytes per row] uint8


class Cursor:
    """Little-endian reads from a buffer, moving forward; reads past its end raise HeaderError."""

    def __init__(self, buf, offset: int = 0):
        self.buf, self.offset, self.size = buf, offset, len(buf)

    def take(self, fmt: str) -> tuple:
        s = struct.calcsize("<" + fmt)
        if self.offset + s > self.size:
            raise HeaderError(f"the header runs past the end of the file (byte {self.offset + s})")
        values = struct.unpack_from("<" + fmt, self.buf, self.offset)
        self.offset += s
        return values

    def one(self, fmt: str):
        return self.take(fmt)[0]

    def string(self) -> str:
        n = self.one("Q")
        if self.offset + n > self.size:
            raise HeaderError(f"a string of {n} bytes runs past the end of the file (byte {self.offset})")
        text = str(self.buf[self.offset:self.offset + n], "utf-8")
        self.offset += n
        return text

    def strings(self, count: int) -> list[str]:
        buf, off, size, unpack = self.buf, self.offset, self.size, struct.Struct("<Q").unpack_from
        out = []
        for _ in range(count):
            if off + 8 > size:
                raise HeaderError("a string array runs past the end of the file")
            (n,) = unpack(buf, off)
            off += 8
            if off + n > size:
                raise HeaderError(f"a string of {n} bytes runs past the end of the file (byte {off})")
            out.append(str(buf[off:off + n], "utf-8"))
            off += n
        self.offset = off
        return out

    def value(self, kind: int) -> Any:
        if kind in SCALARS:
            return self.one(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise HeaderError(f"unknown metadata value type {kind}")
        item, count = self.take("IQ")
        if item == STRING:
            return self.strings(count)
        if item in SCALARS:
            dtype = np.dtype("<" + SCALARS[item])
            if self.offset + count * dtype.itemsize > self.size:
                raise HeaderError(f"an array of {count} values runs past the end of the file")
            values = np.frombuffer(self.buf, dtype, count, self.offset)
            self.offset += count * dtype.itemsize
            return values.tolist()
        return [self.value(item) for _ in range(count)]  # arrays of arrays


def read_header(path) -> tuple[dict[str, Any], list[TensorInfo], mmap.mmap]:
    """(metadata, tensors, the file's read-only map, which the tensors' data view) of a GGUF file; raises
    HeaderError for what cannot be read as one."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise HeaderError("the file is empty") from None
    r = Cursor(buf)
    if len(buf) < 8 or buf[:4] != b"GGUF":
        raise HeaderError("bad magic")
    version = r.one("4xI")
    if version & 0xFFFF == 0:
        raise HeaderError("the file is big-endian, which is not supported")
    if version not in VERSIONS:
        raise HeaderError(f"GGUF version {version} is not supported (only {', '.join(map(str, VERSIONS))})")
    n_tensors, n_kv = r.take("QQ")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        if key in metadata:
            raise HeaderError(f"duplicate key {key}")
        metadata[key] = r.value(r.one("I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = r.take(f"{r.one('I')}Q")
        infos.append((name, dims, *r.take("IQ")))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise HeaderError(f"invalid alignment {align!r}: must be a power of two")
    start = -(-r.offset // align) * align
    whole = np.frombuffer(buf, np.uint8)
    tensors, names = [], set()
    for name, dims, kind, offset in infos:
        if name in names:
            raise HeaderError(f"duplicate tensor {name}")
        names.add(name)
        try:
            ggml_type = GGMLType(kind)
        except ValueError:
            raise HeaderError(f"tensor {name} has type id {kind}, which is not a ggml type localpd knows "
                              f"(known: {', '.join(GGML_TYPES)})") from None
        block, size = BLOCK[ggml_type]
        if dims and dims[0] % block:
            raise HeaderError(f"tensor {name} ({ggml_type.name}) has rows of {dims[0]} values, not whole blocks of "
                              f"{block}: its byte size does not match its type and shape")
        n = math.prod(dims)
        n_bytes = n * size // block
        begin = start + offset
        shape = tuple(reversed(dims))
        data = whole[begin:begin + n_bytes]
        if data.size == n_bytes:  # else the file is truncated (the caller says so): left as the bytes there are
            if ggml_type.name in ELEMENT_DTYPES:
                data = data.view(ELEMENT_DTYPES[ggml_type.name]).reshape(shape)
            else:
                data = data.reshape(shape[:-1] + (shape[-1] // block * size,) if shape else shape)
        tensors.append(TensorInfo(name, ggml_type, dims, n, n_bytes, begin, data))
    check_overlaps(tensors)
    return metadata, tensors, buf


def check_overlaps(tensors: list[TensorInfo]) -> None:
    """Each tensor's bytes (as its type and shape size them) end before the next tensor's begin."""
    placed = sorted(tensors, key=lambda t: t.data_offset)
    for a, b in zip(placed, placed[1:]):
        if a.data_offset + a.n_bytes > b.data_offset:
            raise HeaderError(f"tensor {a.name} ({a.tensor_type.name}, shape {list(a.shape)}) needs {a.n_bytes} bytes, "
                              f"which run into tensor {b.name}: its byte size does not match its type and shape")
