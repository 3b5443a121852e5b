"""int4-k: 4-bit codes in groups of 32 whose scales and biases are themselves quantized within a super-block of 8
groups (256 columns), as llama.cpp's Q4_K does: about 4.6 bits per weight where int4-g32's float16 scale and bias
cost 5.

Row n, group b (columns 32b .. 32b + 31), super-block j = b // 8:
    value = d[n, j] * sc[n, b] * q + dmin[n, j] * mn[n, b],    q in 0..15
with d, dmin float16, sc in 0..255 (uint8) and mn in -127..127 (int8). Q4_K's 6-bit unsigned scale and min (value =
d * sc * q - dmin * m) are the special case sc < 64, mn = -m, so a Q4_K tensor imports bit for bit; a group's
minimum may also be positive here, and its scale has 8 bits where Q4_K's has 6. A row's last super-block holds
the groups left over (K = 576: 8, 8 and 2 groups).

`packed` is Int4Weight's layout (quant/weights.py): the same codes, the same kernels' inner loops. `sub` holds each
row's nb scale bytes, then its nb minimum bytes (int8 seen as uint8), nb = K // 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localpd.errors import LocalpdError
from localpd.quant import gguf_blocks
from localpd.quant.weights import Int4Weight, check_fields, pack_int4, unpack_int4

GROUP, PER_SUPER = 32, 8  # columns a group; groups a super-block


def super_blocks(k: int) -> int:
    return -(-(k // GROUP) // PER_SUPER)


@dataclass
class Int4KWeight:
    packed: torch.Tensor  # int32 [N, K // 8], Int4Weight's layout
    d: torch.Tensor       # float16 [N, super-blocks]: the groups' scales are d * sc
    dmin: torch.Tensor    # float16 [N, super-blocks]: their biases are dmin * mn
    sub: torch.Tensor     # uint8 [N, 2 * nb]: sc (uint8) for each group, then mn (int8) for each group

    def __post_init__(self):
        if self.packed.dtype != torch.int32 or self.packed.dim() != 2:
            raise LocalpdError(f"int4-k packed weights must be a 2-D int32 tensor, got {self.packed.dtype} "
                               f"{tuple(self.packed.shape)}")
        n, k = self.shape
        if k % GROUP:
            raise LocalpdError(f"int4-k needs the input dimension ({k}) to be a multiple of {GROUP}")
        check_fields("int4-k", self, {"d": (torch.float16, (n, super_blocks(k))),
                                      "dmin": (torch.float16, (n, super_blocks(k))),
                                      "sub": (torch.uint8, (n, 2 * (k // GROUP)))})

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 8

    @property
    def group(self) -> int:
        return GROUP

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.d, self.dmin, self.sub))

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's scale and bias in float32, [N, nb]: d * sc and dmin * mn."""
        nb = self.shape[1] // GROUP
        sc, mn = self.sub[:, :nb].float(), self.sub[:, nb:].contiguous().view(torch.int8).float()
        d = self.d.float().repeat_interleave(PER_SUPER, dim=1)[:, :nb]
        dmin = self.dmin.float().repeat_interleave(PER_SUPER, dim=1)[:, :nb]
        return d * sc, dmin * mn

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        scale, bias = self.group_scales()
        q = unpack_int4(self.packed).float().reshape(n, k // GROUP, GROUP)
        return (q * scale[..., None] + bias[..., None]).reshape(n, k).to(dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, importance: torch.Tensor | None = None) -> Int4KWeight:
        """int4-g32's search (clipping ratios, least-squares refit, importance-weighted), then its scales and
        biases quantized within each super-block (from_groups)."""
        g32 = Int4Weight.quantize(w, GROUP, importance)
        return cls.from_groups(g32.unpack(), g32.scales.float(), g32.biases.float(), w.detach().float(), importance)

    @classmethod
    def from_int4(cls, w: Int4Weight) -> Int4KWeight:
        """An int4-g32 weight (a Q4_0/Q4_1 file's blocks) at int4-k's size: its scales and biases quantized within
        each super-block, the codes re-rounded to them against the values the int4-g32 weight held."""
        if w.group != GROUP:
            raise LocalpdError(f"int4-k takes int4 weights in groups of {GROUP}, not {w.group}")
        return cls.from_groups(w.unpack(), w.scales.float(), w.biases.float(), w.dequantize())

    @classmethod
    def from_groups(cls, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, target: torch.Tensor,
                    importance: torch.Tensor | None = None) -> Int4KWeight:
        """codes [N, K] (0..15), each group's scale and bias [N, nb] -> int4-k. d = the super-block's largest
        scale / 255 and dmin = its largest |bias| / 127 (float16), sc and mn rounded to them; then each group's codes
        are re-rounded to the stored scale and bias where that brings them nearer `target` [N, K] (weighted by
        importance per column, if given)."""
        n, k = codes.shape
        nb, ns = k // GROUP, super_blocks(k)
        pad = ns * PER_SUPER - nb

        def per_super(x: torch.Tensor) -> torch.Tensor:  # [N, nb] -> [N, ns, PER_SUPER], padded with zeros
            return torch.nn.functional.pad(x, (0, pad)).reshape(n, ns, PER_SUPER)

        d = (per_super(scale).amax(-1) / 255).half()
        dmin = (per_super(bias).abs().amax(-1) / 127).half()
        df, dminf = d.float()[..., None], dmin.float()[..., None]
        sc = torch.round(per_super(scale) / torch.where(df > 0, df, torch.ones_like(df))).clamp(0, 255)
        mn = torch.round(per_super(bias) / torch.where(dminf > 0, dminf, torch.ones_like(dminf))).clamp(-127, 127)
        s_new, b_new = (sc * df).reshape(n, -1)[:, :nb, None], (mn * dminf).reshape(n, -1)[:, :nb, None]
        t = target.float().reshape(n, nb, GROUP)
        old = codes.float().reshape(n, nb, GROUP)
        new = torch.round((t - b_new) / torch.where(s_new > 0, s_new, torch.ones_like(s_new))).clamp(0, 15)
        h = torch.ones(1, 1, GROUP) if importance is None else importance.float().clamp_min(0).reshape(1, nb, GROUP)
        err_old = (h * (old * s_new + b_new - t) ** 2).sum(-1, keepdim=True)
        err_new = (h * (new * s_new + b_new - t) ** 2).sum(-1, keepdim=True)
        q = torch.where(err_new < err_old, new, old).to(torch.uint8).reshape(n, k)
        sub = torch.cat([sc.reshape(n, -1)[:, :nb].to(torch.uint8),
                         mn.reshape(n, -1)[:, :nb].to(torch.int8).view(torch.uint8)], dim=1)
        return cls(pack_int4(q), d.contiguous(), dmin.contiguous(), sub.contiguous())

    @classmethod
    def from_q4_k(cls, blocks: torch.Tensor, shape: tuple[int, int]) -> Int4KWeight:
        """A GGUF Q4_K tensor's blocks (uint8 [n_blocks, 144]: d, dmin, 12 bytes of six-bit scales and mins, 128 of
        codes), bit for bit: sc = the six-bit scale, mn = minus the six-bit min."""
        n, k = shape
        sc, m = gguf_blocks.k_scales(blocks[:, 4:16])
        codes = gguf_blocks.k_nibbles(blocks[:, 16:144]).reshape(n, k)
        sub = torch.cat([sc.to(torch.uint8).reshape(n, -1), (-m).to(torch.int8).view(torch.uint8).reshape(n, -1)], 1)
        return cls(pack_int4(codes), blocks[:, 0:2].contiguous().view(torch.float16).reshape(n, -1).clone(),
                   blocks[:, 2:4].contiguous().view(torch.float16).reshape(n, -1).clone(), sub.contiguous())
