"""GGUF block types whose every group of 32 values is codes * scale (+ bias): decoded into that form.

In this form a block type maps onto localpd's own formats with group 32: codes 0..15 with a scale and a bias are
an Int4Weight, 5-bit codes (Q5_0, Q5_1) an Int5Weight (quant/int5.py), 4-bit codes into a table of int8 values
(IQ4_NL, IQ4_XS, MXFP4) a CodebookWeight (quant/codebook.py), other signed codes with a scale alone an Int8Weight.
Scales computed from several stored fields (IQ4_XS's d * (ls - 32)) are rounded to float16 there; the other types
import bit for bit. Q4_K and Q5_K keep their fields apart, as int4-k (quant/int4k.py) and Int5KWeight; their
decoders here serve the exact float dequantization.

Each decoder takes the stored blocks as uint8 [n_blocks, bytes per block] and returns Groups, one row per group of
32 values, in file order. `dequantize(groups)` computes in float32 exactly as ggml (and the gguf package) do.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL / IQ4_XS codebook
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled (ggml's kvalues_mxfp4)


class Groups(NamedTuple):
    codes: torch.Tensor          # [n_groups, 32]: uint8 0..15 where bias is set, else int8
    scale: torch.Tensor          # float32 [n_groups, 1]
    bias: torch.Tensor | None    # float32 [n_groups, 1], or None


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32, reading little-endian halves."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32]: the 16 low nibbles, then the 16 high nibbles (ggml's order within 32 values)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _lookup(table, idx: torch.Tensor) -> torch.Tensor:
    return torch.tensor(table, dtype=torch.int8, device=idx.device)[idx.long()]


def q8_0(b: torch.Tensor) -> Groups:
    return Groups(b[:, 2:].contiguous().view(torch.int8), _f16(b[:, :2]), None)


def q4_0(b: torch.Tensor) -> Groups:
    d = _f16(b[:, :2])
    return Groups(_nibbles(b[:, 2:]), d, d * -8)  # q * d - 8d: exactly ggml's (q - 8) * d


def q4_1(b: torch.Tensor) -> Groups:
    return Groups(_nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]))


def q5_0(b: torch.Tensor) -> Groups:
    q = (_nibbles(b[:, 6:]) | (_fifth_bits(b[:, 2:6]) << 4)).to(torch.int32)
    return Groups((q - 16).to(torch.int8), _f16(b[:, :2]), None)


def q5_1(b: torch.Tensor) -> Groups:
    return Groups(_nibbles(b[:, 8:]) | (_fifth_bits(b[:, 4:8]) << 4), _f16(b[:, :2]), _f16(b[:, 2:4]))


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """The 4 bytes qh of Q5_0/Q5_1 -> [n, 32]: bit j is the 5th bit of value j."""
    j = torch.arange(32, device=qh.device)
    return (qh[:, j // 8] >> (j % 8).to(torch.uint8)) & 1


def iq4_nl(b: torch.Tensor) -> Groups:
    return Groups(_lookup(IQ4_VALUES, _nibbles(b[:, 2:])), _f16(b[:, :2]), None)


def k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins per block, as float32."""
    s = s.int()
    lo, hi = s[:, 0:4], s[:, 4:8]
    sc = torch.cat([lo & 63, (s[:, 8:12] & 0x0F) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([hi & 63, (s[:, 8:12] >> 4) | ((hi >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def _k_groups(b: torch.Tensor, q: torch.Tensor) -> Groups:
    """Q4_K/Q5_K: 256 values in 8 sub-blocks of 32, d * sc[j] * q - dmin * m[j]; q [n_blocks * 8, 32]."""
    sc, mn = k_scales(b[:, 4:16])
    return Groups(q, (_f16(b[:, 0:2]) * sc).reshape(-1, 1), (-(_f16(b[:, 2:4]) * mn)).reshape(-1, 1))


def k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes in 4 chunks of 32 (each 64 values: low nibbles, then high) -> [n_blocks * 8, 32]."""
    qs = qs.reshape(-1, 4, 32)
    return torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 32)


def q4_k(b: torch.Tensor) -> Groups:
    return _k_groups(b, k_nibbles(b[:, 16:144]))


def q5_k(b: torch.Tensor) -> Groups:
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[None, :, None]
    high = (b[:, None, 16:48] >> shifts) & 1  # bit j of qh[l]: the 5th bit of value l of sub-block j
    return _k_groups(b, k_nibbles(b[:, 48:176]) | (high.reshape(-1, 32) << 4))


def iq4_xs(b: torch.Tensor) -> Groups:
    """256 values in 8 sub-blocks of 32: d * (ls[j] - 32) * codebook[q], ls six bits (4 in scales_l, 2 in scales_h)."""
    j = torch.arange(8, device=b.device)
    high = (b[:, 2:4].contiguous().view(torch.int16).int() >> (2 * j)) & 3
    low = (b[:, 4:8].int()[:, j // 2] >> (4 * (j % 2))) & 0x0F
    scale = _f16(b[:, 0:2]) * ((low | (high << 4)) - 32).float()
    return Groups(_lookup(IQ4_VALUES, _nibbles(b[:, 8:].reshape(-1, 8, 16))).reshape(-1, 32), scale.reshape(-1, 1),
                  None)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml's E8M0 scale byte, halved (as its MXFP4 codebook is doubled): 2 ** (e - 128), float32 (subnormal below)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def mxfp4(b: torch.Tensor) -> Groups:
    return Groups(_lookup(MXFP4_VALUES, _nibbles(b[:, 1:])), e8m0_half(b[:, :1]), None)


DECODERS = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1, "Q4_K": q4_k, "Q5_K": q5_k,
            "IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs, "MXFP4": mxfp4}
INT4_TYPES = {"Q4_0", "Q4_1"}  # codes 0..15 with a bias: Int4Weight (Q4_K: Int4KWeight); IQ4 and MXFP4: a
# CodebookWeight (quant/codebook.py's CODEBOOK_TYPES); the rest are Int8Weight
INT5_TYPES = {"Q5_0", "Q5_1", "Q5_K"}  # 5-bit codes: Int5Weight, Int5KWeight (quant/int5.py)


def dequantize(g: Groups) -> torch.Tensor:
    """float32 [n_groups * 32], as ggml computes it: codes * scale (+ bias)."""
    x = g.codes.float() * g.scale
    return (x if g.bias is None else x + g.bias).reshape(-1)
