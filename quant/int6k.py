"""6-bit codes with a scale a group of 16: GGUF's Q6_K (Int6KWeight), imported bit for bit, at 6.6 bits a weight
where the nearest int8 weight that localpd held it as took 8.5 (and moved its values by up to 1/254 of a group's
largest: the logits by tenths).

Row n, column k in super-block j = k // 256 and sub-block s = k // 16:
    value = d[n, j] * sc[n, s] * (q - 32),    q in 0..63
with d float16 and sc int8, as ggml's Q6_K. The codes' low four bits are in `packed` (Int4Weight's layout), their
two upper bits in `upper`, uint8 [N, K // 4]: each four blocks of 32 columns of a row (blocks 4g .. 4g + 3) take 32
bytes, byte e holding at bits 2j, 2j + 1 block 4g + j's bits for position e in the order the CPU kernels expand a
block's nibbles (quant/int5.py's planes: e < 16 column 2e, e >= 16 column 2 (e - 16) + 1). So one 32-byte load
and a shift give a block's 32 upper bits in the places its nibbles take, where a plane a bit (as the 5-bit weights
held their fifth before) took a 32-bit broadcast, a shuffle and three masks a bit (the AVX2 products, docs/PERF.md). The
GPU takes these weights as their nearest int8 (to_int8, kernels/dispatch.py's as_int8), as localpd held them
everywhere before.

GGUF's Q3_K is the same form with 4-bit codes (Int3KWeight): ggml's value d * (sc3 - 32) * (q3 - 4), q3 in 0..7 and
sc3 six bits a sub-block of 16, is d * sc * (q - 8) at q = q3 + 4 (a nibble) and sc = sc3 - 32, imported bit for bit
at 4.56 bits a weight (its file's 3.44; the int8 weight it was re-quantized to before took 8.5). Both are signed
codes stored offset by half their range (32 for six bits, 8 for four), the rule the CPU kernels apply to a weight
with scales a sub-block of 16 (kernels/cpu_kernels.c's sub16_offset).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from localpd.errors import LocalpdError
from localpd.quant.int5 import EVEN_THEN_ODD, GROUP, plane_bits
from localpd.quant.weights import Int8Weight, check_fields, pack_int4, unpack_int4

SUB, SUPER = 16, 256  # columns a scale; columns a d
UPPER_GROUP = 4  # blocks (of GROUP columns) an `upper` group: 32 bytes
BLOCK_ORDER = torch.from_numpy(EVEN_THEN_ODD)            # position e of a block's expanded codes -> its column
COLUMN_PLACE = torch.argsort(BLOCK_ORDER)               # a block's column -> its position e


def upper_plane(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..63, K a multiple of 128) -> their two upper bits as `upper` holds them: uint8
    [N, K // 4] (the module docstring)."""
    n, k = codes.shape
    top = (codes.to(torch.uint8) >> 4).reshape(n, k // (GROUP * UPPER_GROUP), UPPER_GROUP, GROUP)
    top = top[..., BLOCK_ORDER.to(codes.device)]  # [N, groups, j, e]
    return (top[:, :, 0] | top[:, :, 1] << 2 | top[:, :, 2] << 4 | top[:, :, 3] << 6).reshape(n, k // 4).contiguous()


def upper_codes(upper: torch.Tensor) -> torch.Tensor:
    """upper_plane's inverse: each code's two upper bits, uint8 [N, K] (0..3)."""
    n, k = upper.shape[0], upper.shape[1] * 4
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=upper.device).reshape(1, 1, UPPER_GROUP, 1)
    top = (upper.reshape(n, -1, 1, GROUP) >> shifts) & 3  # [N, groups, j, e]
    return top[..., COLUMN_PLACE.to(upper.device)].reshape(n, k)


def per_sub_block(per_super: torch.Tensor, per_sub: torch.Tensor) -> torch.Tensor:
    """A float16 a super-block [N, K // 256] times an int8 a sub-block [N, K // 16], in float32: [N, K // 16]."""
    return per_super.float().repeat_interleave(SUPER // SUB, dim=1) * per_sub.float()


class SubScaled:
    """What the two share: value = d * sc * (q - OFFSET), a float16 d a super-block of 256 and an int8 sc a
    sub-block of 16, the codes' low four bits in `packed`; each subclass its planes and OFFSET."""

    OFFSET = 0
    BITS = 0
    PLANES: dict[str, int] = {}  # a plane's field -> columns a byte

    MINIMA: dict[str, tuple[torch.dtype, int]] = {}  # a minimum's field -> (dtype, columns an element)

    def __post_init__(self):
        if self.packed.dtype != torch.int32 or self.packed.dim() != 2:
            raise LocalpdError(f"{self.BITS}-bit packed weights must be a 2-D int32 tensor, got {self.packed.dtype} "
                               f"{tuple(self.packed.shape)}")
        n, k = self.shape
        if k % SUPER:
            raise LocalpdError(f"{self.BITS}-bit weights need the input dimension ({k}) to be a multiple of {SUPER}")
        check_fields(f"{self.BITS}-bit", self, {**{p: (torch.uint8, (n, k // c)) for p, c in self.PLANES.items()},
                                                "d": (torch.float16, (n, k // SUPER)),
                                                "sc": (torch.int8, (n, k // SUB)),
                                                **{f: (t, (n, k // c)) for f, (t, c) in self.MINIMA.items()}})

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 8

    @property
    def group(self) -> int:
        return 32  # the kernels' blocks (each two scales)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))  # (the 5-bit formats' FifthBits.nbytes)

    def sub_scales(self) -> torch.Tensor:
        """Each sub-block's scale d * sc in float32, [N, K // 16], as ggml multiplies them."""
        return per_sub_block(self.d, self.sc)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        q = (self.codes().to(torch.int16) - self.OFFSET).float().reshape(n, k // SUB, SUB)
        return (self.sub_scales()[..., None] * q).reshape(n, k).to(dtype)

    def to_int8(self) -> Int8Weight:
        """The nearest int8 weight with a float16 scale a block of 32 (what localpd held Q6_K and Q3_K as before):
        what the GPU's kernels take."""
        return Int8Weight.quantize(self.dequantize(), 32)


@dataclass
class Int3KWeight(SubScaled):
    """Q3_K's codes in nibbles (the module docstring): value = d * sc * (q - 8)."""

    packed: torch.Tensor  # int32 [N, K // 8]: the codes, Int4Weight's layout
    d: torch.Tensor       # float16 [N, K // 256]
    sc: torch.Tensor      # int8 [N, K // 16]

    OFFSET, BITS = 8, 3

    def codes(self) -> torch.Tensor:
        """q as uint8 [N, K], 0..15."""
        return unpack_int4(self.packed)

    def as_6_bit(self) -> Int6KWeight:
        """The same values as 6-bit codes (q + 24, the same d and sc): what GGUF export writes, as Q6_K."""
        return Int6KWeight.from_codes(self.codes() + 24, self.d, self.sc)

    @classmethod
    def from_q3_k(cls, blocks: torch.Tensor, shape: tuple[int, int]) -> Int3KWeight:
        """A GGUF Q3_K tensor's blocks (uint8 [n_blocks, 110]: 32 bytes of high bits, 64 of two low bits, 12 of
        six-bit scales, d), bit for bit, as q = q3 + 4 and sc = sc3 - 32."""
        n, k = shape
        hmask, qs, s = blocks[:, :32], blocks[:, 32:96].reshape(-1, 2, 1, 32), blocks[:, 96:108]
        # ggml's order, per half h of 128 values: value 32 j + l (j = 0..3, l < 32) is qs[h][l]'s bits 2j, 2j + 1,
        # with hmask[l]'s bit 4h + j as its third
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8).reshape(1, 1, 4, 1)
        low = (qs >> shifts) & 3
        third = (hmask.reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1
        codes = (low | (third.reshape(-1, 2, 4, 32) << 2)) + 4
        # the sixteen scales: bytes 0-7's low nibbles, then their high ones, each with two bits of bytes 8-11 above
        a, b = s[:, :8], s[:, 8:].repeat(1, 2)
        pick = torch.tensor([0, 0, 0, 0, 2, 2, 2, 2], dtype=torch.uint8)
        sc3 = torch.cat([(a & 15) | (((b >> pick) & 3) << 4), (a >> 4) | (((b >> (pick + 4)) & 3) << 4)], 1)
        d = blocks[:, 108:110].contiguous().view(torch.float16).reshape(n, -1).clone()
        sc = (sc3.to(torch.int16) - 32).to(torch.int8).reshape(n, -1).contiguous()
        return cls(pack_int4(codes.reshape(n, k)), d, sc)


@dataclass
class Int2KWeight(SubScaled):
    """Q2_K's codes in nibbles with a minimum a sub-block (the module docstring): value = d * sc * q - dmin * mn."""

    packed: torch.Tensor  # int32 [N, K // 8]: the codes 0..3, Int4Weight's layout
    d: torch.Tensor       # float16 [N, K // 256]
    dmin: torch.Tensor    # float16 [N, K // 256]
    sc: torch.Tensor      # int8 [N, K // 16]: 0..15
    mn: torch.Tensor      # int8 [N, K // 16]: 0..15

    OFFSET, BITS = 0, 2
    MINIMA = {"dmin": (torch.float16, SUPER), "mn": (torch.int8, SUB)}

    def codes(self) -> torch.Tensor:
        """q as uint8 [N, K], 0..3."""
        return unpack_int4(self.packed)

    def sub_minima(self) -> torch.Tensor:
        """Each sub-block's dmin * mn in float32, [N, K // 16], as ggml multiplies them."""
        return per_sub_block(self.dmin, self.mn)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        q = self.codes().float().reshape(n, k // SUB, SUB)
        return (self.sub_scales()[..., None] * q - self.sub_minima()[..., None]).reshape(n, k).to(dtype)

    @classmethod
    def from_q2_k(cls, blocks: torch.Tensor, shape: tuple[int, int]) -> Int2KWeight:
        """A GGUF Q2_K tensor's blocks (uint8 [n_blocks, 84]: 16 bytes of scales (sc low, m high), 64 of two-bit
        codes, d, dmin), bit for bit."""
        n, k = shape
        s, qs = blocks[:, :16], blocks[:, 16:80].reshape(-1, 2, 1, 32)
        # ggml's order, per half h of 128 values: value 32 j + l (j = 0..3, l < 32) is qs[h][l]'s bits 2j, 2j + 1
        codes = (qs >> torch.arange(0, 8, 2, dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
        d = blocks[:, 80:82].contiguous().view(torch.float16).reshape(n, -1).clone()
        dmin = blocks[:, 82:84].contiguous().view(torch.float16).reshape(n, -1).clone()
        sc = (s & 15).to(torch.int8).reshape(n, -1).contiguous()
        mn = (s >> 4).to(torch.int8).reshape(n, -1).contiguous()
        return cls(pack_int4(codes.reshape(n, k)), d, dmin, sc, mn)

    def to_q2_k(self) -> torch.Tensor:
        """from_q2_k's inverse: the GGUF Q2_K blocks, uint8 [N * K // 256, 84]."""
        n, k = self.shape
        codes = self.codes().reshape(-1, 2, 4, 32)
        qs = codes[:, :, 0] | codes[:, :, 1] << 2 | codes[:, :, 2] << 4 | codes[:, :, 3] << 6
        s = (self.sc.to(torch.uint8) | self.mn.to(torch.uint8) << 4).reshape(-1, 16)
        d, dmin = (t.reshape(-1, 1).view(torch.uint8) for t in (self.d, self.dmin))
        return torch.cat([s, qs.reshape(-1, 64), d, dmin], dim=1)


@dataclass
class Int6KWeight(SubScaled):
    packed: torch.Tensor  # int32 [N, K // 8]: the codes' low four bits, Int4Weight's layout
    upper: torch.Tensor   # uint8 [N, K // 4]: their two upper bits (upper_plane)
    d: torch.Tensor       # float16 [N, K // 256]
    sc: torch.Tensor      # int8 [N, K // 16]

    OFFSET, BITS, PLANES = 32, 6, {"upper": 4}

    def codes(self) -> torch.Tensor:
        """q as uint8 [N, K], 0..63."""
        return unpack_int4(self.packed) | (upper_codes(self.upper) << 4)

    @classmethod
    def from_q6_k(cls, blocks: torch.Tensor, shape: tuple[int, int]) -> Int6KWeight:
        """A GGUF Q6_K tensor's blocks (uint8 [n_blocks, 210]: 128 bytes of low nibbles, 64 of two high bits, 16
        int8 scales, d), bit for bit."""
        n, k = shape
        ql, qh = blocks[:, :128].reshape(-1, 2, 64), blocks[:, 128:192].reshape(-1, 2, 32)
        # ggml's order, per half of 128 values: value l + 32 i (i = 0..3, l < 32) is ql[l + 32 (i % 2)]'s nibble
        # i // 2 with qh[l]'s bits 2i, 2i + 1 above it
        low = torch.stack([ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], dim=2)
        two = torch.stack([(qh >> (2 * i)) & 3 for i in range(4)], dim=2)
        codes = (low | (two << 4)).reshape(n, k)
        d = blocks[:, 208:210].contiguous().view(torch.float16).reshape(n, -1).clone()
        sc = blocks[:, 192:208].contiguous().view(torch.int8).reshape(n, -1).clone()
        return cls.from_codes(codes, d, sc)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> Int6KWeight:
        """codes uint8 [N, K] (0..63), d float16 [N, K // 256], sc int8 [N, K // 16] -> the weight."""
        codes = codes.to(torch.uint8)
        return cls(pack_int4(codes & 15), upper_plane(codes), d, sc)

    @classmethod
    def from_bit_planes(cls, packed: torch.Tensor, high: torch.Tensor, top: torch.Tensor, d: torch.Tensor,
                        sc: torch.Tensor) -> Int6KWeight:
        """The weight a quantized directory of format version 1 held as a fifth-bit and a sixth-bit plane
        (quant/int5.py's bit_plane, uint8 [N, K // 8] each)."""
        codes = unpack_int4(packed) | plane_bits(high) << 4 | plane_bits(top) << 5
        return cls.from_codes(codes, d, sc)


# GGUF's types with a scale a sub-block of 16 (quant/weights.py's SUB16_TYPES) -> their import of a tensor's blocks
FROM_BLOCKS = {"Q6_K": Int6KWeight.from_q6_k, "Q3_K": Int3KWeight.from_q3_k, "Q2_K": Int2KWeight.from_q2_k}
