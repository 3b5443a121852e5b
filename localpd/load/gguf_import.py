"""A GGUF matrix's blocks -> localpd's weight, in C (kernels/gguf_import.c) straight from the file's mapped bytes.

The same fields as the torch import (quant.weights.from_gguf, which stays the reference and the path where this one
does not run) bit for bit, without its copies: the file's bytes are read where they are mapped, every row is written
once, in the order asked (a llama GGUF's q/k rows back in HF's order, loader.unpermute_qk's), into tensors the caller
may place (an arena's, so that a fused matrix's parts lie side by side). An 8B Q4_K_M file's matrices took 18.5 s
that way in torch on two cores (docs/PERF.md, "Start-up").
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np
import torch

from localpd.kernels import cpu
from localpd.load.gguf import BLOCKS
from localpd.quant.codebook import IQ4Weight, MXFP4Weight
from localpd.quant.int4k import Int4KWeight
from localpd.quant.int5 import Int5KWeight, Int5Weight
from localpd.quant.int6k import Int2KWeight, Int3KWeight, Int6KWeight
from localpd.quant.weights import Int4Weight, Int8Weight

SOURCE = Path(cpu.__file__).with_name("gguf_import.c")
I8, U8, F16, I32 = torch.int8, torch.uint8, torch.float16, torch.int32


def _packed(n, k):
    return I32, (n, k // 8)


def _plane(n, k):
    return U8, (n, k // 8)


def _per(dtype, cols):
    return lambda n, k: (dtype, (n, k // cols))


# type -> (its code in gguf_import.c, the weight, its fields' (dtype, shape) from (N, K) in the dataclass's order)
TYPES = {
    "Q8_0": (0, Int8Weight, [lambda n, k: (I8, (n, k)), _per(F16, 32)]),
    "Q4_0": (1, Int4Weight, [_packed, _per(F16, 32), _per(F16, 32)]),
    "Q4_1": (2, Int4Weight, [_packed, _per(F16, 32), _per(F16, 32)]),
    "Q5_0": (3, Int5Weight, [_packed, _plane, _per(F16, 32), _per(F16, 32)]),
    "Q5_1": (4, Int5Weight, [_packed, _plane, _per(F16, 32), _per(F16, 32)]),
    "Q4_K": (5, Int4KWeight, [_packed, _per(F16, 256), _per(F16, 256), _per(U8, 16)]),
    "Q5_K": (6, Int5KWeight, [_packed, _plane, _per(F16, 256), _per(F16, 256), _per(U8, 16)]),
    "Q6_K": (7, Int6KWeight, [_packed, _per(U8, 4), _per(F16, 256), _per(I8, 16)]),
    "Q3_K": (8, Int3KWeight, [_packed, _per(F16, 256), _per(I8, 16)]),
    "IQ4_NL": (9, IQ4Weight, [_per(U8, 2), _per(F16, 32)]),
    "IQ4_XS": (10, IQ4Weight, [_per(U8, 2), _per(F16, 32)]),
    "MXFP4": (11, MXFP4Weight, [_per(U8, 2), _per(F16, 32)]),
    "Q2_K": (12, Int2KWeight, [_packed, _per(F16, 256), _per(F16, 256), _per(I8, 16), _per(I8, 16)]),
}


def field_specs(type_name: str, shape: tuple[int, int]) -> list[tuple[torch.dtype, tuple[int, ...]]] | None:
    """The (dtype, shape) of each field the import of a `type_name` matrix of `shape` makes; None: no C import."""
    if type_name not in TYPES or shape[1] % BLOCKS[type_name][0]:
        return None
    return [spec(*shape) for spec in TYPES[type_name][2]]


@functools.cache
def library() -> ctypes.CDLL | None:
    """gguf_import.c built for this processor (with cpu.py's compiler, flags and cache), or None where the CPU
    kernels are off or cannot be built: the torch import runs instead."""
    if cpu.library() is None:
        return None
    try:
        lib = ctypes.CDLL(str(cpu.build(source=SOURCE)))
    except (RuntimeError, OSError):
        return None
    lib.lpd_import.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_void_p]
    lib.lpd_import.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the C import runs (LOCALPD_C_IMPORT=0 keeps the torch one)."""
    return os.environ.get("LOCALPD_C_IMPORT", "1") != "0" and library() is not None


def import_matrix(type_name: str, data: np.ndarray, shape: tuple[int, int], order: torch.Tensor | None = None,
                  out: list[torch.Tensor] | None = None):
    """The weight of a GGUF matrix of `type_name` and `shape` (N rows, K columns) from its stored blocks `data` (the
    file's mapped bytes: nothing is copied first), its row r being the file's row order[r]; its fields written into
    `out` (contiguous tensors of field_specs' dtypes and shapes: placement.py's) or new tensors. None where there is
    no C import for it (the type, the library, bytes that do not fit the shape, a scale float16 cannot hold):
    quant.weights.from_gguf then imports it, or names the error."""
    specs = field_specs(type_name, shape)
    if specs is None or not available():
        return None
    n, k = shape
    block, size = BLOCKS[type_name]
    if data.nbytes != n * (k // block) * size or not data.flags.c_contiguous:
        return None
    if order is not None:
        order = order.to(torch.int64).contiguous()
        if order.shape != (n,) or n and not (0 <= int(order.min()) and int(order.max()) < n):
            return None
    fields = out or [torch.empty(s, dtype=dtype) for dtype, s in specs]
    if [(f.dtype, tuple(f.shape)) for f in fields] != specs or not all(f.is_contiguous() for f in fields):
        return None
    out = (ctypes.c_void_p * len(fields))(*[f.data_ptr() for f in fields])
    if library().lpd_import(TYPES[type_name][0], data.ctypes.data, n, k, None if order is None else order.data_ptr(), out):
        return None
    return TYPES[type_name][1](*fields)
