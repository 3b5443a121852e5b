"""Codebook int4: 4-bit codes that index a 16-entry table of int8 values, times a float16 scale per block of 32
columns: value = VALUES[q] * scale. GGUF's IQ4_NL and IQ4_XS (its scales multiplied out, rounded to float16) are
IQ4Weight, MXFP4 is MXFP4Weight: 4.5 bits a weight where the same values held as int8 took 8.5.

`packed` is uint8 [N, K // 2], a row's blocks of 32 columns in pairs: the pair of blocks 2p and 2p + 1 is bytes 32p ..
32p + 31, byte j holding column j of block 2p in its low nibble and column j of block 2p + 1 in its high one; where K
is an odd number of blocks, the last takes 16 bytes, byte j holding its columns j and j + 16 (GGUF's order). One
32-byte load then gives a pair's 64 codes in column order with a shift and no shuffle (kernels/cpu_kernels.c). The
table belongs to the class (each subclass one), so that, as in every other format, each tensor is indexed by output
row.

The CPU kernels look each code up in registers and multiply it as an int8 weight (kernels/cpu_kernels.c); the GPU
takes it as that int8 weight (kernels/dispatch.py's as_int8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localpd.errors import LocalpdError
from localpd.quant.gguf_blocks import IQ4_VALUES, MXFP4_VALUES

GROUP = 32


@dataclass
class CodebookWeight:
    packed: torch.Tensor  # uint8 [N, K // 2], GGUF's nibble order (module docstring)
    scales: torch.Tensor  # float16 [N, K // 32]

    # class attributes, not fields (no annotation): a subclass's 16 values, and them as int8 [16] on the CPU (the
    # kernels read it), made once per class
    VALUES = ()
    table = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.table = torch.tensor(cls.VALUES, dtype=torch.int8)

    def __post_init__(self):
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 2:
            raise LocalpdError(f"codebook codes must be a 2-D uint8 tensor, got {self.packed.dtype} "
                               f"{tuple(self.packed.shape)}")
        n, k = self.shape
        if k % GROUP:
            raise LocalpdError(f"a codebook weight needs the input dimension ({k}) to be a multiple of {GROUP}")
        if self.scales.dtype != torch.float16 or tuple(self.scales.shape) != (n, k // GROUP):
            raise LocalpdError(f"codebook scales must be float16 {(n, k // GROUP)} for a {n}x{k} weight, got "
                               f"{self.scales.dtype} {tuple(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def group(self) -> int:
        return GROUP

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))

    @classmethod
    def from_values(cls, values: torch.Tensor, scales: torch.Tensor) -> CodebookWeight:
        """int8 values [N, K] (each one of VALUES) and float16 scales [N, K // 32] -> the weight."""
        index = torch.full((256,), -1, dtype=torch.int16)
        index[cls.table.long() + 128] = torch.arange(16, dtype=torch.int16)  # equal entries (MXFP4's zeros): either
        codes = index.to(values.device)[values.long() + 128]
        if (codes < 0).any():
            raise LocalpdError(f"a value is not in {cls.__name__}'s codebook")
        return cls(pack(codes.to(torch.uint8)), scales.contiguous())

    def codes(self) -> torch.Tensor:
        """The codes as uint8 [N, K], columns in order."""
        n, k = self.shape
        pairs = k // GROUP // 2 * 2 * GROUP // 2
        body = self.packed[:, :pairs].reshape(n, -1, 1, GROUP)
        parts = [torch.cat([body & 15, body >> 4], dim=2).reshape(n, -1)]
        if k // GROUP % 2:
            last = self.packed[:, pairs:]
            parts.append(torch.cat([last & 15, last >> 4], dim=1))
        return torch.cat(parts, dim=1)

    def int8_values(self) -> torch.Tensor:
        """VALUES[q] as int8 [N, K]."""
        return self.table.to(self.packed.device)[self.codes().long()]

    def to_int8(self):
        """The Int8Weight of the same values: the entries as int8 codes with the same scales, exactly."""
        from localpd.quant.weights import Int8Weight  # weights imports this module (from_gguf's CODEBOOK_TYPES)

        return Int8Weight(self.int8_values(), self.scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        v = self.int8_values().float().reshape(n, k // GROUP, GROUP) * self.scales.float()[..., None]
        return v.reshape(n, k).to(dtype)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> packed [N, K // 2] in the module docstring's layout."""
    n, k = codes.shape
    nb = k // GROUP
    body = codes[:, :nb // 2 * 2 * GROUP].reshape(n, -1, 2, GROUP)
    parts = [(body[:, :, 0] | (body[:, :, 1] << 4)).reshape(n, -1)]
    if nb % 2:
        last = codes[:, -GROUP:]
        parts.append(last[:, :GROUP // 2] | (last[:, GROUP // 2:] << 4))
    return torch.cat(parts, dim=1).contiguous()


class IQ4Weight(CodebookWeight):
    VALUES = IQ4_VALUES  # IQ4_NL's and IQ4_XS's non-linear grid


class MXFP4Weight(CodebookWeight):
    VALUES = MXFP4_VALUES  # e2m1, doubled (its scale halved)


CODEBOOK_TYPES = {"IQ4_NL": IQ4Weight, "IQ4_XS": IQ4Weight, "MXFP4": MXFP4Weight}  # GGUF type -> its weight class
