"""Reading GGUF files (metadata, tensor blocks) and dequantizing their block formats in torch. No pickle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from localpd.errors import LocalpdError
from localpd.load.gguf_header import HeaderError, read_header

# type name -> (elements per block, bytes per block)
BLOCKS = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
SUPPORTED = ", ".join(BLOCKS)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32, reading little-endian halves."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: the k low nibbles, then the k high nibbles (ggml's order within a 32-block)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).float() - 8.0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins per block."""
    s = s.int()
    lo, hi = s[:, 0:4], s[:, 4:8]
    sc = torch.cat([lo & 63, (s[:, 8:12] & 0x0F) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([hi & 63, (s[:, 8:12] >> 4) | ((hi >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def _k_sub(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Shared tail of Q4_K/Q5_K: q is [n, 8, 32] quant levels of the 8 sub-blocks."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return ((d * sc)[..., None] * q.float() - (dmin * mn)[..., None]).reshape(-1, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    qs = b[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 32 bytes = 64 values: low nibbles, then high
    return _k_sub(b, torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48]  # bit j of qh[l] is the 5th bit of value l of sub-block j
    qs = b[:, 48:176].reshape(-1, 4, 32)
    low = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[None, :, None]
    high = ((qh[:, None, :] >> shifts) & 1) << 4
    return _k_sub(b, low | high)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # [half, byte-row, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)  # [half, l]
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(-1, 16, 1)
    d = _f16(b[:, 208:210])[..., None]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    hi = (qh >> shifts) & 3  # [n, half, 4, 32]: 2 high bits for the 4 rows of 32 in each 128-half
    lo = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # rows: ql[0:32] low, ql[32:64] low, ql[0:32] high, ql[32:64] high
    q = ((lo | (hi << 4)).to(torch.int32) - 32).float().reshape(-1, 16, 16)  # 16 groups of 16, one scale each
    return ((d * sc) * q).reshape(-1, 256)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32).reshape(-1, 1)


def _f16_elems(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float().reshape(-1, 1)


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float().reshape(-1, 1)


DEQUANT = {"F32": _f32, "F16": _f16_elems, "BF16": _bf16, "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1,
           "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize_blocks(type_name: str, raw_uint8: torch.Tensor, n_elements: int) -> torch.Tensor:
    """Stored blocks of a GGUF tensor (any shape of uint8, in file order) -> flat float32 tensor of n_elements."""
    if type_name not in DEQUANT:
        raise LocalpdError(f"unsupported GGUF tensor type {type_name}; supported: {SUPPORTED}")
    block, size = BLOCKS[type_name]
    if n_elements % block or raw_uint8.numel() != n_elements // block * size:
        raise LocalpdError(f"{type_name}: {raw_uint8.numel()} bytes do not hold {n_elements} elements")
    return DEQUANT[type_name](raw_uint8.reshape(-1, size)).reshape(n_elements)


class GGUFFile:
    """A GGUF file: plain-python metadata and memory-mapped tensor blocks."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise LocalpdError(f"model file not found: {self.path}")
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise LocalpdError(f"{self.path} is not a GGUF file (bad magic)")
        try:
            self.metadata, self.tensors = read_header(self.path)
        except (HeaderError, ValueError, OverflowError) as e:  # HeaderError, or a string that is not UTF-8
            raise LocalpdError(f"{self.path} is not a readable GGUF file (corrupt or truncated header: "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        size = self.path.stat().st_size
        end = max((t.data_offset + t.n_bytes for t in self.tensors), default=0)
        if end > size:
            raise LocalpdError(f"{self.path} is truncated: its tensors end at byte {end} but the file has {size} bytes")
        self._tensors = {t.name: t for t in self.tensors}

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise LocalpdError(f"tensor {name} not found in {self.path}")
        return self._tensors[name]

    def tensor_type(self, name: str) -> str:
        return self._tensor(name).tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Torch order (rows, cols): GGUF's ne order reversed."""
        return tuple(reversed(self._tensor(name).shape))

    def raw(self, name: str) -> np.ndarray:
        """The stored data as the reader maps it (uint8 blocks, or float arrays for F32/F16); no copy."""
        return self._tensor(name).data

    def dequantize(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = self._tensor(name)
        kind = t.tensor_type.name
        if kind not in DEQUANT:
            raise LocalpdError(f"unsupported GGUF tensor type {kind} in {name}; supported: {SUPPORTED}")
        raw = torch.from_numpy(np.array(t.data, copy=True).reshape(-1).view(np.uint8))  # off the read-only map
        shape = self.tensor_shape(name)
        flat = dequantize_blocks(kind, raw, int(np.prod(shape)))
        return flat.reshape(shape).to(dtype)
