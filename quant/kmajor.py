"""The GPU's layout of the int4 and int8 formats: the same codes, stored K-major for the batch-1 GEMV.

A decode GEMV on a GPU streams each weight byte once; the row-major words of quant/weights.py make a thread
hold 32 consecutive inputs of one output, so every activation it loads serves one column. Transposed, a thread's
16-byte load holds the same 8 inputs (int4; 4 for int8) of 4 neighbouring outputs, and one activation serves all
four (kernels/gemv_kmajor.py). The words are exactly the row-major words transposed:

- `words` int32 [K * bits / 32, N]: word j of column n is row-major word j of row n (int4: input 8j + s in bits
  4s..4s+3; int8: input 4j + s in byte s, two's complement).
- `factors` int32 [K / group, N]: a group's float16 scale in the low half and, for int4, its float16 bias in the
  high half (0 for int8), so one load brings both.

The model converts its int4/int8 matrices to this layout when it is placed on a GPU (to_kmajor); the CPU keeps the
row-major formats. `dequantize` gives the same [N, K] matrix as the row-major weight it came from.

Strips (`KStripInt4`, `KStripInt8`: to_strips) are the same words K-major within each strip of 4 outputs: `words`
[N / 4, K * bits / 32, 4], strip j's row i the K-major row i of outputs 4j..4j+3 (16 bytes), `factors` [N / 4, K /
group, 4] likewise, so one program streams a strip's 4 outputs over all of K as one contiguous run
(kernels/gemv_strip.py: no split-K). Strips stack along the outputs as row-major weights do (cat_rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localpd.errors import LocalpdError
from localpd.quant.weights import Int4Weight, Int8Weight


def _half_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def _halves(factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) float16 halves of int32 factors."""
    pairs = factors.contiguous().view(torch.float16).reshape(*factors.shape, 2)
    return pairs[..., 0], pairs[..., 1]


@dataclass
class KMajorWeight:
    """Codes transposed to [K * bits / 32, N] int32 words and their group factors [K / group, N] (module doc)."""

    words: torch.Tensor
    factors: torch.Tensor
    BITS = 0  # the subclass's code width

    def __post_init__(self):
        for name, t in (("words", self.words), ("factors", self.factors)):
            if t.dtype != torch.int32 or t.dim() != 2:
                raise LocalpdError(f"K-major {name} must be a 2-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
        if self.factors.shape[1] != self.words.shape[1] or self.factors.shape[0] == 0 \
                or self.shape[1] % self.factors.shape[0]:
            raise LocalpdError(f"K-major factors {tuple(self.factors.shape)} do not fit words "
                               f"{tuple(self.words.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.words.shape[1], self.words.shape[0] * 32 // self.BITS

    @property
    def group(self) -> int:
        return self.shape[1] // self.factors.shape[0]

    @property
    def nbytes(self) -> int:
        return 4 * (self.words.numel() + self.factors.numel())

    def codes(self) -> torch.Tensor:
        """The codes as int32 [N, K] (int4: 0..15; int8: -128..127)."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        scale, bias = (h.float().T for h in _halves(self.factors))  # [N, K / group]
        q = self.codes().float().reshape(n, k // self.group, self.group)
        return (q * scale[..., None] + bias[..., None]).reshape(n, k).to(dtype)

    def take_rows(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dense rows (outputs) of W, dequantizing only those: an embedding lookup from a tied output head."""
        return type(self)(self.words[:, rows], self.factors[:, rows]).dequantize(dtype)


class KMajorInt4(KMajorWeight):
    BITS = 4

    def codes(self) -> torch.Tensor:
        shifts = torch.arange(0, 32, 4, device=self.words.device, dtype=torch.int32)
        q = (self.words.T[..., None] >> shifts) & 15  # [N, K / 8, 8]
        return q.reshape(self.shape)

    @classmethod
    def from_weight(cls, w: Int4Weight) -> KMajorInt4:
        return cls(w.packed.T.contiguous(), (_half_bits(w.scales) | (_half_bits(w.biases) << 16)).T.contiguous())

    def to_weight(self) -> Int4Weight:
        scale, bias = _halves(self.factors)
        return Int4Weight(self.words.T.contiguous(), scale.T.contiguous(), bias.T.contiguous())


class KMajorInt8(KMajorWeight):
    BITS = 8

    def codes(self) -> torch.Tensor:
        return self.words.T.contiguous().view(torch.int8).to(torch.int32)

    @classmethod
    def from_weight(cls, w: Int8Weight) -> KMajorInt8:
        if w.shape[1] % 4:
            raise LocalpdError(f"int8 K-major words need an input dimension divisible by 4, got {w.shape[1]}")
        return cls(w.data.contiguous().view(torch.int32).T.contiguous(), _half_bits(w.scales).T.contiguous())

    def to_weight(self) -> Int8Weight:
        return Int8Weight(self.words.T.contiguous().view(torch.int8), _halves(self.factors)[0].T.contiguous())


STRIP = 4  # outputs a strip holds: a row of it is one 16-byte load


def _strip(t: torch.Tensor) -> torch.Tensor:
    """[R, N] -> [N / STRIP, R, STRIP]."""
    return t.reshape(t.shape[0], -1, STRIP).transpose(0, 1).contiguous()


def _unstrip(t: torch.Tensor) -> torch.Tensor:
    """[N / STRIP, R, STRIP] -> [R, N]."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


@dataclass
class KStripWeight:
    """K-major words and factors in strips of STRIP outputs (module doc): words [N / 4, K * bits / 32, 4], factors
    [N / 4, K / group, 4]."""

    words: torch.Tensor
    factors: torch.Tensor
    BITS = 0  # the subclass's code width
    KMAJOR = KMajorWeight  # and its K-major form

    def __post_init__(self):
        for name, t in (("words", self.words), ("factors", self.factors)):
            if t.dtype != torch.int32 or t.dim() != 3 or t.shape[2] != STRIP:
                raise LocalpdError(f"strip {name} must be a [N / {STRIP}, rows, {STRIP}] int32 tensor, got {t.dtype} "
                                   f"{tuple(t.shape)}")
        if self.factors.shape[0] != self.words.shape[0] or self.factors.shape[1] == 0 \
                or self.shape[1] % self.factors.shape[1]:
            raise LocalpdError(f"strip factors {tuple(self.factors.shape)} do not fit words {tuple(self.words.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.words.shape[0] * STRIP, self.words.shape[1] * 32 // self.BITS

    @property
    def group(self) -> int:
        return self.shape[1] // self.factors.shape[1]

    @property
    def nbytes(self) -> int:
        return 4 * (self.words.numel() + self.factors.numel())

    def kmajor(self) -> KMajorWeight:
        """The same weight K-major (a copy): the GEMM and float-GEMV paths' layout."""
        return self.KMAJOR(_unstrip(self.words), _unstrip(self.factors))

    def codes(self) -> torch.Tensor:
        return self.kmajor().codes()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.kmajor().dequantize(dtype)

    def take_rows(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dense rows (outputs) of W, dequantizing only those: an embedding lookup from a tied output head."""
        j, e = rows // STRIP, rows % STRIP
        return self.KMAJOR(self.words[j, :, e].T, self.factors[j, :, e].T).dequantize(dtype)

    @classmethod
    def from_kmajor(cls, w: KMajorWeight) -> KStripWeight:
        return cls(_strip(w.words), _strip(w.factors))


class KStripInt4(KStripWeight):
    BITS = 4
    KMAJOR = KMajorInt4


class KStripInt8(KStripWeight):
    BITS = 8
    KMAJOR = KMajorInt8


def to_strips(w):
    """The strips of an int4 or int8 weight (or of its K-major form) with whole strips of outputs; any other weight
    unchanged."""
    w = to_kmajor(w)
    if isinstance(w, KMajorWeight) and w.shape[0] % STRIP == 0:
        return (KStripInt4 if w.BITS == 4 else KStripInt8).from_kmajor(w)
    return w


def to_kmajor(w):
    """The K-major form of an int4 or int8 weight; any other weight unchanged."""
    if isinstance(w, Int4Weight):
        return KMajorInt4.from_weight(w)
    if isinstance(w, Int8Weight):
        return KMajorInt8.from_weight(w)
    return w
