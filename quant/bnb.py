"""bitsandbytes' weight formats as plain data: NF4 (4-bit NormalFloat, QLoRA) and LLM.int8.

A weight W has shape [N, K] (N outputs, K inputs) and is used as y = x @ W.T. Both formats hold only tensors
indexed by output row ([N, ...]), so rows can be taken, concatenated and permuted like the other formats' rows
(localpd.quant.weights.cat_rows / take_rows, loader.unpermute_qk) and saved field by field. The bytes are
bitsandbytes' own, so its kernels read them as they are:

NF4: `data` uint8 [N, K // 2] is quantize_4bit's packed output seen as rows: byte b of row n holds column 2b in
its high nibble and column 2b + 1 in its low nibble. Column k is NF4[code] * absmax[n, k // blocksize].
bitsandbytes runs its blocks over the flattened matrix; a blocksize that divides K keeps every block in one row.

LLM.int8: `data` int8 [N, K], column k is data[n, k] * scales[n] / 127 (scales: the row's absmax, bitsandbytes'
SCB).

bitsandbytes is optional: it is imported only when a weight is quantized or multiplied, and dequantize() is
plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from localpd.errors import LocalpdError

NF4_BLOCKSIZE = 64  # bitsandbytes' default on the GPU (QLoRA's)
NF4_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # what quantize_4bit takes on every backend
# bitsandbytes' NF4 code (functional.get_4bit_type("nf4")): quantiles of N(0, 1) scaled to [-1, 1], 0 exact
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
LLM_INT8_THRESHOLD = 6.0  # activation columns with a larger |value| are multiplied in fp16 (LLM.int8's outliers)


def bitsandbytes(scheme: str = "bnb-nf4"):
    """The bitsandbytes module, or one clear line on how to get it."""
    try:
        import bitsandbytes
    except ImportError:
        raise LocalpdError(f"{scheme} needs bitsandbytes: pip install bitsandbytes") from None
    return bitsandbytes


@lru_cache
def nf4_code(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4, dtype=torch.float32, device=device)


def _rows_fit(kind: str, name: str, t: torch.Tensor, n: int, k: int) -> None:
    if t.dim() != 2 or t.shape[0] != n or t.shape[1] == 0 or k % t.shape[1]:
        raise LocalpdError(f"{kind} {name} of shape {tuple(t.shape)} do not fit a {n}x{k} weight")


@dataclass
class Nf4Weight:
    """bitsandbytes NF4: 4-bit codes into the NF4 table, times an fp32 absmax per block of `blocksize` columns."""

    data: torch.Tensor    # uint8 [N, K // 2], layout in the module docstring
    absmax: torch.Tensor  # float32 [N, K // blocksize]

    def __post_init__(self):
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise LocalpdError(f"nf4 data must be a 2-D uint8 tensor, got {self.data.dtype} {tuple(self.data.shape)}")
        _rows_fit("nf4", "absmax", self.absmax, *self.shape)

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1] * 2

    @property
    def blocksize(self) -> int:
        return self.shape[1] // self.absmax.shape[1]

    group = blocksize  # the name the other formats use (model.fuse groups weights by it)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.absmax.numel() * self.absmax.element_size()

    @classmethod
    def quantize(cls, w: torch.Tensor, blocksize: int = NF4_BLOCKSIZE) -> Nf4Weight:
        """bitsandbytes' quantize_4bit(quant_type="nf4"): per block, absmax, then the nearest NF4 code."""
        n, k = w.shape
        if blocksize not in NF4_BLOCKSIZES:
            raise LocalpdError(f"nf4 block size must be one of {NF4_BLOCKSIZES}, got {blocksize}")
        if k % blocksize:
            raise LocalpdError(f"bnb-nf4 needs the input dimension ({k}) to be a multiple of its block size "
                               f"({blocksize})")
        F = bitsandbytes("bnb-nf4").functional
        data, state = F.quantize_4bit(w.detach().contiguous(), blocksize=blocksize, quant_type="nf4")
        return cls(data.view(n, k // 2), state.absmax.float().view(n, k // blocksize))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        codes = torch.stack((self.data >> 4, self.data & 15), dim=-1).reshape(n, k // self.blocksize, self.blocksize)
        values = nf4_code(self.data.device)[codes.long()] * self.absmax.float()[..., None]
        return values.reshape(n, k).to(dtype)


@dataclass
class BnbInt8Weight:
    """LLM.int8 (bitsandbytes): int8 weights with one fp32 absmax per output row. At run time bitsandbytes'
    matmul quantizes each activation row to int8 too, except the columns holding a value above
    LLM_INT8_THRESHOLD, which it multiplies in fp16 (the outlier decomposition); activations go through fp16."""

    data: torch.Tensor    # int8 [N, K]
    scales: torch.Tensor  # float32 [N, 1]: the row's absmax, value = data * scales / 127

    def __post_init__(self):
        if self.data.dtype != torch.int8 or self.data.dim() != 2:
            raise LocalpdError(f"bnb-int8 data must be a 2-D int8 tensor, got {self.data.dtype} "
                               f"{tuple(self.data.shape)}")
        _rows_fit("bnb-int8", "scales", self.scales, *self.shape)
        if self.scales.shape[1] != 1:
            raise LocalpdError(f"bnb-int8 has one scale per row, got scales of shape {tuple(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * self.scales.element_size()

    @classmethod
    def quantize(cls, w: torch.Tensor) -> BnbInt8Weight:
        """bitsandbytes' int8_vectorwise_quant of the fp16 weights (as its Int8Params does): per row,
        round(w * 127 / absmax)."""
        F = bitsandbytes("bnb-int8").functional
        data, scales, _ = F.int8_vectorwise_quant(w.detach().to(torch.float16).contiguous())
        return cls(data, scales.float()[:, None])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * (self.scales.float() / 127)).to(dtype)
