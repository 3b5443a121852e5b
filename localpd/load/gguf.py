"""Reading GGUF files (metadata, tensor blocks) and dequantizing their block formats in torch. No pickle."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from localpd.errors import LocalpdError
from localpd.load.gguf_header import GGML_TYPES, HeaderError, read_header
from localpd.quant import gguf_blocks

# type name -> (elements per block, bytes per block), for every type a tensor may have
BLOCKS = {name: (block, size) for name, (_, block, size) in GGML_TYPES.items()}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32, reading little-endian halves."""
    return raw.contiguous().view(torch.float16).float()


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


def _elements(dtype: torch.dtype):
    return lambda b: b.contiguous().view(dtype).float().reshape(-1, 1)


def _groups(decoder):
    return lambda b: gguf_blocks.dequantize(decoder(b))


def _reference(type_name: str):
    """The gguf package's numpy dequantization, for the types localpd has no torch code of its own for."""
    def run(b: torch.Tensor) -> torch.Tensor:
        import gguf.quants  # imported on first use: half a second

        out = gguf.quants.dequantize(b.numpy(), gguf.GGMLQuantizationType[type_name])
        return torch.from_numpy(np.asarray(out, dtype=np.float32))
    return run


# torch code for the common types (fast, and the group-32 ones shared with the int4/int8 import); the gguf package's
# numpy reference for the rest (Q2_K, Q3_K, the 1-3 bit IQ types, TQ*, NVFP4)
DEQUANT = {"F32": _elements(torch.float32), "F16": _elements(torch.float16), "BF16": _elements(torch.bfloat16),
           **{name: _groups(decoder) for name, decoder in gguf_blocks.DECODERS.items()},
           "Q6_K": _q6_k}
DEQUANT.update({name: _reference(name) for name in ("Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                                                     "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "NVFP4")})
SUPPORTED = ", ".join(DEQUANT)


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
            self.metadata, self.tensors, self._map = read_header(self.path)
        except (HeaderError, ValueError, OverflowError) as e:  # HeaderError, or a string that is not UTF-8
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise LocalpdError(f"{self.path} is not a readable GGUF file: {why}") from None
        size = self.path.stat().st_size
        for t in self.tensors:
            if t.data_offset + t.n_bytes > size:
                raise LocalpdError(f"{self.path} is truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} "
                                   f"but the file has {size} bytes")
        self._tensors = {t.name: t for t in self.tensors}

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise LocalpdError(f"tensor {name} not found in {self.path}")
        return self._tensors[name]

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each type the file holds, the most common first."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def bits_per_weight(self) -> float:
        """Stored bits per element over all tensors, as llama.cpp counts them."""
        return 8 * sum(t.n_bytes for t in self.tensors) / max(1, sum(t.n_elements for t in self.tensors))

    def check_types(self, names) -> None:
        """Refuse, before anything is loaded, a tensor among `names` whose type localpd cannot dequantize."""
        for name in names:
            kind = self.tensor_type(name)
            if kind not in DEQUANT:
                raise LocalpdError(f"unsupported GGUF tensor type {kind} in {name}; supported: {SUPPORTED}")

    def tensor_type(self, name: str) -> str:
        return self._tensor(name).tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Torch order (rows, cols): GGUF's ne order reversed."""
        return tuple(reversed(self._tensor(name).shape))

    def raw(self, name: str) -> np.ndarray:
        """The stored data as the reader maps it (uint8 blocks, or float arrays for F32/F16); no copy."""
        return self._tensor(name).data

    def release(self, name: str) -> None:
        """Unmaps the pages of a tensor's bytes from this process (the file's pages stay in the system's cache, and a
        later read maps them again): a tensor once converted is not read again, and a load's pages of the file would
        otherwise count in the process's memory beside the weights made of them, the file's size more."""
        if not hasattr(mmap, "MADV_DONTNEED"):  # not Linux/macOS: the pages stay until the file is closed
            return
        t = self._tensor(name)
        lo = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, lo, t.data_offset + t.n_bytes - lo)

    def dequantize(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self.check_types([name])
        t = self._tensor(name)
        kind = t.tensor_type.name
        raw = torch.from_numpy(np.array(t.data, copy=True).reshape(-1).view(np.uint8))  # off the read-only map
        shape = self.tensor_shape(name)
        flat = dequantize_blocks(kind, raw, int(np.prod(shape)))
        return flat.reshape(shape).to(dtype)
