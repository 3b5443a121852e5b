"""5-bit codes in groups of 32: GGUF's Q5_0 and Q5_1 (Int5Weight: a float16 scale and bias a group, as int4-g32's)
and Q5_K (Int5KWeight: int4-k's super-block scales and biases), each imported bit for bit.

Each is an int4 weight of its kind (Int4Weight, Int4KWeight: the same fields, the same kernels' factors) whose
codes have a fifth bit, held apart in `fifth`: value = (q + 16 h) * scale + bias, q the four low bits (in `packed`,
Int4Weight's layout) and h the fifth. Q5_0's value (q5 - 16) * d is the case bias = -16 d (exact in float16, as
Q4_0's -8 d is). 5.5 bits a weight for Q5_0/Q5_1 (5.6 for Q5_K), where the nearest int8 weight that the CPU held
them as before took 8.5.

`fifth` is uint8 [N, K // 8], the fifth bits in the order the CPU kernels expand a block's nibbles: position e of
a block is column 2e for e < 16 (its low nibbles) and column 2(e - 16) + 1 for e >= 16 (its high ones). Each eight
blocks of a row (256 columns, blocks 8g .. 8g + 7) take 32 bytes, byte e holding at bit j block 8g + j's bit for
position e: so one 16-byte load, widened to 16-bit lanes once for the eight blocks, gives each block's bits in place
by one shift and a mask (as Q6_K's `upper` gives its two, quant/int6k.py), where a block's 32-bit word took a
broadcast, a shuffle and three masks (the AVX2 products, docs/PERF.md). The blocks past a row's last eight (K not a
multiple of 256: Q5_0 and Q5_1 only) take 4 bytes each, a little-endian uint32 whose bit e is position e's
(`bit_plane`'s layout, which every block took in a quantized directory written before `fifth`, as `high`:
quant/store.py reads it).
The GPU takes these weights as their nearest int8 (to_int8, kernels/dispatch.py's as_int8), as localpd held them
everywhere before.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from localpd.errors import LocalpdError
from localpd.quant import gguf_blocks
from localpd.quant.int4k import Int4KWeight
from localpd.quant.weights import Int4Weight, Int8Weight, cpu_biases_skipped, int8_near, pack_int4, unpack_int4

GROUP = 32
EVEN_THEN_ODD = np.concatenate([np.arange(0, GROUP, 2), np.arange(1, GROUP, 2)])  # a block's columns by position
FIFTH_GROUP = 8  # blocks a group of `fifth`: 32 bytes


def split_codes(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 codes [N, K] (0..31, K a multiple of 32) -> (packed low four bits, Int4Weight's int32 layout; the
    fifth bits, uint8 [N, K // 8] as `fifth` holds them: the module docstring)."""
    codes = codes.to(torch.uint8)
    return pack_int4(codes & 15), fifth_plane(codes)


def bit_plane(codes: torch.Tensor, bit: int) -> torch.Tensor:
    """Bit `bit` of each of uint8 codes [N, K] (K a multiple of 32), a block's 32 as one little-endian uint32 (bit e
    position e's): uint8 [N, K // 8]."""
    n, k = codes.shape
    if k % GROUP:
        raise LocalpdError(f"5-bit weights need the input dimension ({k}) to be a multiple of {GROUP}")
    if codes.device.type == "cpu":  # each block's even columns, then its odd ones, packed by numpy: where the torch
        # below (a transposed copy, a multiply-and-sum in int32) took 60% of a Q6_K file's load
        set_bits = codes.to(torch.uint8).contiguous().numpy().reshape(-1, GROUP) & (1 << bit)
        ordered = np.take(set_bits, EVEN_THEN_ODD, axis=1)
        return torch.from_numpy(np.packbits(ordered, axis=-1, bitorder="little").reshape(n, k // 8))
    bits = ((codes.to(torch.uint8) >> bit) & 1).reshape(n, k // GROUP, GROUP // 2, 2)
    ordered = bits.transpose(2, 3).reshape(n, k // 8, 8)  # each block's even columns first
    weights = 1 << torch.arange(8, dtype=torch.int32, device=codes.device)
    return (ordered.to(torch.int32) * weights).sum(-1).to(torch.uint8).contiguous()


def plane_bits(plane: torch.Tensor) -> torch.Tensor:
    """bit_plane's inverse: the bits, uint8 [N, K] (0 or 1)."""
    n = plane.shape[0]
    bits = (plane[..., None] >> torch.arange(8, dtype=torch.uint8, device=plane.device)) & 1  # [N, K // 8, 8]
    k = bits.shape[1] * 8
    return bits.reshape(n, k // GROUP, 2, GROUP // 2).transpose(2, 3).reshape(n, k)


def _grouped(k: int) -> int:
    """The columns of a row that `fifth` holds eight blocks at a time (the rest a block at a time)."""
    return k - k % (GROUP * FIFTH_GROUP)


def fifth_plane(codes: torch.Tensor) -> torch.Tensor:
    """The fifth bits of uint8 codes [N, K] (K a multiple of 32) as `fifth` holds them (the module docstring)."""
    n, k = codes.shape
    plane = bit_plane(codes, 4)
    full = _grouped(k)
    if full:
        bits = ((codes[:, :full].to(torch.int32) >> 4) & 1).reshape(n, full // 256, FIFTH_GROUP, GROUP)
        bits = bits[..., torch.from_numpy(EVEN_THEN_ODD).to(codes.device)]  # [N, g, j, e]
        shifts = torch.arange(FIFTH_GROUP, dtype=torch.int32, device=codes.device).reshape(1, 1, FIFTH_GROUP, 1)
        plane[:, :full // 8] = (bits << shifts).sum(2).to(torch.uint8).reshape(n, full // 8)
    return plane.contiguous()


def fifth_bits(fifth: torch.Tensor) -> torch.Tensor:
    """fifth_plane's inverse: each code's fifth bit, uint8 [N, K] (0 or 1)."""
    n, k = fifth.shape[0], fifth.shape[1] * 8
    full = _grouped(k)
    bits = plane_bits(fifth)
    if full:
        shifts = torch.arange(FIFTH_GROUP, dtype=torch.uint8, device=fifth.device).reshape(1, 1, FIFTH_GROUP, 1)
        grouped = (fifth[:, :full // 8].reshape(n, -1, 1, GROUP) >> shifts) & 1  # [N, g, j, e]
        place = torch.argsort(torch.from_numpy(EVEN_THEN_ODD)).to(fifth.device)
        bits[:, :full] = grouped[..., place].reshape(n, full)
    return bits


def join_codes(packed: torch.Tensor, fifth: torch.Tensor) -> torch.Tensor:
    """split_codes' inverse: uint8 codes [N, K], 0..31."""
    return unpack_int4(packed) | (fifth_bits(fifth) << 4)


def _check_fifth(fifth: torch.Tensor, n: int, k: int) -> None:
    if fifth.dtype != torch.uint8 or tuple(fifth.shape) != (n, k // 8):
        raise LocalpdError(f"5-bit weights' fifth bits must be uint8 {(n, k // 8)} for a {n}x{k} weight, got "
                           f"{fifth.dtype} {tuple(fifth.shape)}")
    if k % GROUP:
        raise LocalpdError(f"5-bit weights need the input dimension ({k}) to be a multiple of {GROUP}")


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = codes.shape
    q = codes.float().reshape(n, k // GROUP, GROUP)
    return (q * scale[..., None] + bias[..., None]).reshape(n, k).to(dtype)


def _to_int8(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> Int8Weight:
    n, k = codes.shape
    g = gguf_blocks.Groups(codes.reshape(-1, GROUP), scale.reshape(-1, 1), bias.reshape(-1, 1))
    q, s = int8_near(g)
    return Int8Weight(q.reshape(n, k), s.half().reshape(n, k // GROUP))


class FifthBits:
    """What the two 5-bit formats share: int4's packed low bits beside the fifth-bit plane, blocks of 32."""

    @classmethod
    def from_block_plane(cls, packed: torch.Tensor, high: torch.Tensor, *factors: torch.Tensor) -> FifthBits:
        """The weight a quantized directory written before `fifth` held, its fifth bits a block at a time (`high`,
        bit_plane's layout)."""
        return cls(packed, fifth_plane(plane_bits(high) << 4), *factors)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 8

    @property
    def group(self) -> int:
        return GROUP

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))

    def codes(self) -> torch.Tensor:
        return join_codes(self.packed, self.fifth)


@dataclass
class Int5Weight(FifthBits):
    """Q5_0 / Q5_1: value = q5 * scales[n, b] + biases[n, b] per block b of 32 columns, q5 in 0..31."""

    packed: torch.Tensor  # int32 [N, K // 8]: the codes' low four bits, Int4Weight's layout
    fifth: torch.Tensor   # uint8 [N, K // 8]: their fifth bits (module docstring)
    scales: torch.Tensor  # float16 [N, K // 32]
    biases: torch.Tensor  # float16 [N, K // 32]
    SYMMETRIC_BIAS = -16  # a symmetric weight's bias, times its scale (Q5_0's): quant.weights.symmetric

    def __post_init__(self):
        low = Int4Weight(self.packed, self.scales, self.biases)  # its checks
        if low.group != GROUP:
            raise LocalpdError(f"5-bit weights take a scale a group of {GROUP} columns, not {low.group}")
        _check_fifth(self.fifth, *self.shape)

    @property
    def nbytes(self) -> int:
        return super().nbytes - cpu_biases_skipped(self)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _dequantize(self.codes(), self.scales.float(), self.biases.float(), dtype)

    def to_int8(self) -> Int8Weight:
        """The nearest int8 weight (quant.weights.int8_near; Q5_0's exactly): what the GPU's kernels take."""
        return _to_int8(self.codes(), self.scales.float(), self.biases.float())

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor) -> Int5Weight:
        """codes [N, K] (0..31) with a float16 scale and bias [N, K // 32] a block."""
        return cls(*split_codes(codes), scales.contiguous(), biases.contiguous())


@dataclass
class Int5KWeight(FifthBits):
    """Q5_K: value = q5 * d[n, j] * sc[n, b] + dmin[n, j] * mn[n, b], as int4-k (quant/int4k.py) with 5-bit codes."""

    packed: torch.Tensor  # int32 [N, K // 8]: the codes' low four bits, Int4Weight's layout
    fifth: torch.Tensor   # uint8 [N, K // 8]: their fifth bits (module docstring)
    d: torch.Tensor       # float16 [N, super-blocks]
    dmin: torch.Tensor    # float16 [N, super-blocks]
    sub: torch.Tensor     # uint8 [N, 2 * nb]: sc (uint8), then mn (int8), a group each

    def __post_init__(self):
        self.low()  # its checks
        _check_fifth(self.fifth, *self.shape)

    def low(self) -> Int4KWeight:
        return Int4KWeight(self.packed, self.d, self.dmin, self.sub)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _dequantize(self.codes(), *self.low().group_scales(), dtype)

    def to_int8(self) -> Int8Weight:
        return _to_int8(self.codes(), *self.low().group_scales())

    @classmethod
    def from_q5_k(cls, blocks: torch.Tensor, shape: tuple[int, int]) -> Int5KWeight:
        """A GGUF Q5_K tensor's blocks (uint8 [n_blocks, 176]: d, dmin, 12 bytes of six-bit scales and mins, 32 of
        fifth bits, 128 of low nibbles), bit for bit: sc = the six-bit scale, mn = minus the six-bit min."""
        n, k = shape
        sc, m = gguf_blocks.k_scales(blocks[:, 4:16])
        codes = gguf_blocks.q5_k(blocks).codes.reshape(n, k)
        sub = torch.cat([sc.to(torch.uint8).reshape(n, -1), (-m).to(torch.int8).view(torch.uint8).reshape(n, -1)], 1)
        half = lambda t: t.contiguous().view(torch.float16).reshape(n, -1).clone()  # noqa: E731
        return cls(*split_codes(codes), half(blocks[:, 0:2]), half(blocks[:, 2:4]), sub.contiguous())


def from_q5(type_name: str, blocks: torch.Tensor, shape: tuple[int, int]) -> Int5Weight:
    """A GGUF Q5_0 or Q5_1 tensor's blocks, bit for bit: Q5_0's codes q5 - 16 as q5 with the bias -16 d."""
    n, k = shape
    g = gguf_blocks.DECODERS[type_name](blocks)
    scale = g.scale.half()
    if type_name == "Q5_0":
        codes, bias = (g.codes.to(torch.int16) + 16).to(torch.uint8), (-16 * g.scale).half()
    else:
        codes, bias = g.codes, g.bias.half()
    if not (torch.isfinite(scale).all() and torch.isfinite(bias).all()):
        raise LocalpdError(f"GGUF {type_name}: a block scale or bias does not fit float16 (largest 65504)")
    return Int5Weight.from_codes(codes.reshape(n, k), scale.reshape(n, k // GROUP), bias.reshape(n, k // GROUP))
