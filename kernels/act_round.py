"""Activations rounded for the integer GEMV (kernels/gemv_dp4a.py): each block of 32 inputs of a row to two int8
levels, v ~ (256 hi + lo) d with d = max|v| / 127 / 256, as localpd's CPU kernels round them (kernels/cpu_kernels.c,
quantize_blocks): hi rounds v at step 256 d, lo what is left at step d (clamped to +-127), about 15 bits a value.

Layout, per row: q int32 [K / 2], 16 a block: int4's order (word j of a block covers inputs 8j .. 8j + 7: hi of its
even inputs in one int32, hi of its odd ones, then the same of lo: an int4 word's low and high nibbles meet them
with one dp4a each) or int8's (word j: hi of inputs 4j .. 4j + 3, then lo); s float32 [K / 16]: each block's d and
d * sum(256 hi + lo) (an int4 group's bias meets the latter).

round_blocks is the one place the rounding is written in Triton: the standalone kernel here and the fused steps
before a GEMV (kernels/fused.py: add_rms_norm, act_mul) call it, so the model rounds each GEMV input where it is
made rather than in a launch of its own. The torch references follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from localpd.kernels.pdl import launch_args, wait_prior

MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + MAGIC - MAGIC rounds |x| < 2**22 half to even


@triton.jit
def two_levels(v):
    """The rounding: each row of v [R, C] fp32 as (hi, lo, d), v ~ (256 hi + lo) d: hi, lo int32 in -127 .. 127
    [R, C], d [R] fp32 (module doc). A row is a GEMV input's block of 32, or an attention query head
    (kernels/paged_attention.py, int8 keys)."""
    amax = tl.max(tl.abs(v), axis=1)
    step = amax / 127.0
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    hi = (v * inv[:, None] + MAGIC) - MAGIC
    rest = v - hi * step[:, None]
    lo = (rest * (inv * 256.0)[:, None] + MAGIC) - MAGIC
    return hi.to(tl.int32), tl.minimum(tl.maximum(lo, -127.0), 127.0).to(tl.int32), step / 256.0


@triton.jit
def round_blocks(v, blk, bmask, q_row, s_row, BLOCKS: tl.constexpr, BITS: tl.constexpr):
    """v [BLOCKS, 32] fp32: blocks blk [BLOCKS] of a row (bmask: those that exist) rounded and stored at the row's
    q and s (module doc)."""
    hi, lo, d = two_levels(v)
    isum = tl.sum(hi * 256 + lo, axis=1)
    tl.store(s_row + blk * 2, d, mask=bmask)
    tl.store(s_row + blk * 2 + 1, d * isum.to(tl.float32), mask=bmask)
    base = q_row + blk * 16
    if BITS == 4:
        byte = (tl.arange(0, 4) * 8)[None, None, :, None]  # [1, 1, p, 1]: input 8j + 2p + q in byte p of int32 q
        hq = tl.sum((tl.reshape(hi, (BLOCKS, 4, 4, 2)) & 0xFF) << byte, axis=2)  # [blocks, word j, q]
        lq = tl.sum((tl.reshape(lo, (BLOCKS, 4, 4, 2)) & 0xFF) << byte, axis=2)
        at = base[:, None, None] + tl.arange(0, 4)[None, :, None] * 4 + tl.arange(0, 2)[None, None, :]
        tl.store(at, hq, mask=bmask[:, None, None])
        tl.store(at + 2, lq, mask=bmask[:, None, None])
    else:
        byte = (tl.arange(0, 4) * 8)[None, None, :]
        hq = tl.sum((tl.reshape(hi, (BLOCKS, 8, 4)) & 0xFF) << byte, axis=2)  # [blocks, word j]
        lq = tl.sum((tl.reshape(lo, (BLOCKS, 8, 4)) & 0xFF) << byte, axis=2)
        at = base[:, None] + tl.arange(0, 8)[None, :] * 2
        tl.store(at, hq, mask=bmask[:, None])
        tl.store(at + 1, lq, mask=bmask[:, None])


@triton.jit
def _quantize_act_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, BITS: tl.constexpr,
                         BLOCKS: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, c): blocks [c * BLOCKS, (c + 1) * BLOCKS) of x's row."""
    wait_prior(PDL)  # kernels/pdl.py: what the kernel before wrote is read from here on
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    blk = c * BLOCKS + tl.arange(0, BLOCKS)
    bmask = blk < K // 32
    v = tl.load(x_ptr + row * stride_xm + blk[:, None] * 32 + tl.arange(0, 32)[None, :], mask=bmask[:, None],
                other=0.0).to(tl.float32)
    round_blocks(v, blk, bmask, q_ptr + row * stride_qm, s_ptr + row * stride_sm, BLOCKS, BITS)


QUANT_BLOCKS = 16  # blocks a program of quantize_act rounds


@dataclass
class Rounded:
    """Rows rounded for the integer GEMV of a bits-wide weight (quantize_act's q and s) by the kernel that made
    them (the decode attention's reduce: kvcache.dispatch.paged_attention's round_into), handed to the product."""

    q: torch.Tensor
    s: torch.Tensor
    bits: int

    @classmethod
    def empty(cls, m: int, k: int, bits: int, device) -> "Rounded":
        return cls(*empty_rounded(m, k, device), bits)


def empty_rounded(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) for m rows of k inputs, unwritten."""
    return (torch.empty((m, k // 2), dtype=torch.int32, device=device),
            torch.empty((m, k // 16), dtype=torch.float32, device=device))


def quantize_act(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) rounded for the int4 (bits 4) or int8 GEMV: (q, s) (module doc)."""
    m, k = x.shape
    q, s = empty_rounded(m, k, x.device)
    if m and k:
        x = x if x.stride(-1) == 1 else x.contiguous()
        _quantize_act_kernel[(m, triton.cdiv(k // 32, QUANT_BLOCKS))](
            x, q, s, k, x.stride(0), q.stride(0), s.stride(0), BITS=bits, BLOCKS=QUANT_BLOCKS, num_warps=4,
            enable_fp_fusion=False, **launch_args(x))
    return q, s


# torch references, same signatures

def _levels_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rounding in torch: (hi, lo) int32 [M, K / 32, 32] and each block's step [M, K / 32, 1]."""
    m, k = x.shape
    v = x.float().reshape(m, k // 32, 32)
    amax = v.abs().amax(-1, keepdim=True)
    step = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    hi = torch.round(v * inv)
    lo = torch.round((v - hi * step) * (inv * 256.0)).clamp(-127, 127)
    return hi.to(torch.int32), lo.to(torch.int32), step


def quantize_act_ref(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    hi, lo, step = _levels_ref(x)
    d = step[..., 0] / 256.0
    s = torch.stack([d, d * (hi * 256 + lo).sum(-1).float()], -1).reshape(m, k // 16)
    byte = torch.arange(4, device=x.device, dtype=torch.int32) * 8
    if bits == 4:  # [m, blocks, word, p, q] -> [m, blocks, word, q]
        quads = [((t.reshape(m, k // 32, 4, 4, 2) & 0xFF) << byte[:, None]).sum(3, dtype=torch.int32) for t in (hi, lo)]
    else:
        quads = [((t.reshape(m, k // 32, 8, 4) & 0xFF) << byte).sum(3, dtype=torch.int32)[..., None] for t in (hi, lo)]
    return torch.cat(quads, -1).reshape(m, k // 2), s


def rounded_act_ref(x: torch.Tensor) -> torch.Tensor:
    """The activations the integer GEMV multiplies, in float64: (256 hi + lo) d per block."""
    hi, lo, step = _levels_ref(x)
    d = (step / 256.0).double()  # d as the kernel stores it (float32)
    return ((hi.double() * 256 + lo.double()) * d).reshape(x.shape)


def unpack_ref(q: torch.Tensor, s: torch.Tensor, bits: int) -> torch.Tensor:
    """The values (q, s) hold, in float64 [M, K]: (256 hi + lo) d per block, unpacked from either layout."""
    m, k = q.shape[0], q.shape[1] * 2
    b = (q.reshape(m, k // 32, -1)[..., None] >> (torch.arange(4, device=q.device, dtype=torch.int32) * 8)) & 0xFF
    b = b - 256 * (b > 127)  # signed bytes [m, blocks, 16 int32, 4 bytes]
    if bits == 4:  # int32 (word j, level, quad q) byte p = input 8j + 2p + q
        hi, lo = (b.reshape(m, k // 32, 4, 2, 2, 4)[:, :, :, lvl].transpose(-1, -2).reshape(m, k // 32, 32)
                  for lvl in (0, 1))
    else:  # int32 (word j, level) byte p = input 4j + p
        hi, lo = (b.reshape(m, k // 32, 8, 2, 4)[:, :, :, lvl].reshape(m, k // 32, 32) for lvl in (0, 1))
    d = s.reshape(m, k // 32, 2)[..., :1].double()
    return ((hi.double() * 256 + lo.double()) * d).reshape(m, k)
