"""The batch-1 decode GEMV over K-major int4/int8 words by integer dot products (dp4a), in Triton.

kernels/gemv_kmajor.py turns every weight field into a float and multiplies it by a float activation: about 42
instructions a 4-byte int4 word on sm_90, above the 32 an H200 can issue per word at full bandwidth (issue 32).
Here the activations are rounded first, as localpd's CPU kernels round them (kernels/cpu_kernels.c,
quantize_blocks): each block of 32 inputs to two int8 levels, v ~ (256 hi + lo) d with d = max|v| / 127 / 256,
about 15 bits a value. Then a word's products are integer: an int4 word's low nibbles (inputs 0, 2, 4, 6 of its 8)
and high nibbles (1, 3, 5, 7) are two groups of four bytes, each met by one `dp4a` per level (4 a word); an int8
word is four signed bytes, one `dp4a` per level (2 a word). A block's integer sum turns into a float once, times d
and the group's scale, plus the group's bias times d * sum(256 hi + lo): a block's integer sums are exact, so the
product equals (the rounded activations) @ (the dequantized weights) up to float rounding between blocks.

Layout of a launch: program (m, n, s) takes rows m * BLOCK_M.., outputs n * 128.. (32 lanes x 4 outputs: one
16-byte load of words, and one 16-byte load of the 4 activation int32 a quarter block needs, split in registers
and shared by the 4 outputs), and the s-th slice of K, a trip of NB blocks (one or more a warp: a thread holds a
block's int32 sums for its 4 outputs, so no value crosses threads before the end). Split-K and its
in-launch reduction are gemv_kmajor's (_finish_rows). The rounded activations (kernels/act_round.py) come from
the step that makes the GEMV's input (RMSNorm, SiLU * up: kernels/fused.py) or from a launch of their own.

Under Triton's interpreter `dp4a` is written out in integer operations (ASM=False); compiled for a GPU it is
the PTX instruction (ASM=True), which tests/kernels/test_gemv_dp4a.py checks in the SASS.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from localpd.kernels import gemv_kmajor as km
from localpd.kernels.act_round import quantize_act, rounded_act_ref
from localpd.kernels.pdl import launch_args, wait_prior
from localpd.kernels.tile_table import measured_tile


@triton.jit
def _dp4a(a, b, c, SIGNED_A: tl.constexpr, ASM: tl.constexpr):
    """c + the dot product of a's four bytes (unsigned, or signed with SIGNED_A) and b's four signed bytes."""
    if ASM:
        if SIGNED_A:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    for i in tl.static_range(4):
        if SIGNED_A:
            ai = (a << (24 - 8 * i)) >> 24
        else:
            ai = (a >> (8 * i)) & 0xFF
        c += ai * ((b << (24 - 8 * i)) >> 24)
    return c


@triton.jit
def _quad(q_ptr, at):
    """Four consecutive activation int32 at q_ptr + at ([NB, 32, 4] addresses, the same for every lane), loaded as
    one 16-byte load a thread and split into four [NB, 32, 1] values that broadcast over a thread's 4 outputs."""
    return _split_quad(tl.load(q_ptr + at))


@triton.jit
def _split_quad(v):
    """A loaded quad [NB, 32, 4] as its four [NB, 32, 1] values (_quad)."""
    x02, x13 = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], 2, 2)))
    e0, e2 = tl.split(x02)
    e1, e3 = tl.split(x13)
    return e0[:, :, None], e1[:, :, None], e2[:, :, None], e3[:, :, None]


@triton.jit
def _row_unit(q_ptr, at, wa, wb, ih, il, BITS: tl.constexpr, ASM: tl.constexpr):
    """One row's integer sums (hi level, lo level) advanced by a quarter of a block: an int4 word wa (its low and
    high nibbles against the quad's hi even, hi odd, lo even, lo odd inputs) or two int8 words wa, wb (against hi,
    lo of the first and hi, lo of the second)."""
    e0, e1, e2, e3 = _quad(q_ptr, at)
    return _quad_unit(e0, e1, e2, e3, wa, wb, ih, il, BITS, ASM)


@triton.jit
def _quad_unit(e0, e1, e2, e3, wa, wb, ih, il, BITS: tl.constexpr, ASM: tl.constexpr):
    """_row_unit of a quad already loaded and split (_split_quad)."""
    if BITS == 4:
        wl = wa & 0x0F0F0F0F
        wh = (wa >> 4) & 0x0F0F0F0F
        ih = _dp4a(wh, e1, _dp4a(wl, e0, ih, False, ASM), False, ASM)
        il = _dp4a(wh, e3, _dp4a(wl, e2, il, False, ASM), False, ASM)
    else:
        ih = _dp4a(wb, e2, _dp4a(wa, e0, ih, True, ASM), True, ASM)
        il = _dp4a(wb, e3, _dp4a(wa, e1, il, True, ASM), True, ASM)
    return ih, il


@triton.jit
def _unit(q_ptr, rq0, rq1, rq2, rq3, at, wa, wb, ih0, il0, ih1, il1, ih2, il2, ih3, il3, BITS: tl.constexpr,
          BLOCK_M: tl.constexpr, ASM: tl.constexpr):
    """Every row's integer sums advanced by a quarter of a block (_row_unit)."""
    ih0, il0 = _row_unit(q_ptr + rq0, at, wa, wb, ih0, il0, BITS, ASM)
    if BLOCK_M > 1:
        ih1, il1 = _row_unit(q_ptr + rq1, at, wa, wb, ih1, il1, BITS, ASM)
    if BLOCK_M > 2:
        ih2, il2 = _row_unit(q_ptr + rq2, at, wa, wb, ih2, il2, BITS, ASM)
        ih3, il3 = _row_unit(q_ptr + rq3, at, wa, wb, ih3, il3, BITS, ASM)
    return ih0, il0, ih1, il1, ih2, il2, ih3, il3


@triton.jit
def _trip_words(wp, fp, c, nb, trip, stride_wk, stride_fg, mask, NB: tl.constexpr, WPB: tl.constexpr,
                GROUP: tl.constexpr):
    """Trip c's words a thread, from wp (word 0 of each of trip 0's blocks, a trip apart): WPB of them (int8: 8;
    int4: 4, then 0s), and its blocks' group factors (fp: the factors' row 0)."""
    wp = wp + c * trip
    fac = tl.load(fp + ((c * NB + nb) * 32 // GROUP)[:, None, None] * stride_fg, mask=mask, other=0)
    w0 = tl.load(wp, mask=mask, other=0)
    w1 = tl.load(wp + stride_wk, mask=mask, other=0)
    w2 = tl.load(wp + 2 * stride_wk, mask=mask, other=0)
    w3 = tl.load(wp + 3 * stride_wk, mask=mask, other=0)
    if WPB == 8:
        w4 = tl.load(wp + 4 * stride_wk, mask=mask, other=0)
        w5 = tl.load(wp + 5 * stride_wk, mask=mask, other=0)
        w6 = tl.load(wp + 6 * stride_wk, mask=mask, other=0)
        w7 = tl.load(wp + 7 * stride_wk, mask=mask, other=0)
    else:
        w4, w5, w6, w7 = w0 * 0, w0 * 0, w0 * 0, w0 * 0
    return w0, w1, w2, w3, w4, w5, w6, w7, fac


@triton.jit
def _row_block(s_ptr, at, ih, il, scale, bias, BITS: tl.constexpr):
    """A block's float contribution from its integer sums: (256 ih + il) d scale (+ d sum(256 hi + lo) bias)."""
    at = s_ptr + at
    d = tl.load(at)
    if BITS == 4:
        return _block_part(d, tl.load(at + 1), ih, il, scale, bias, BITS)
    return _block_part(d, d, ih, il, scale, bias, BITS)


@triton.jit
def _block_part(d, dsum, ih, il, scale, bias, BITS: tl.constexpr):
    """_row_block of the block's activation factors already loaded: d, and d sum(256 hi + lo) (int4's bias term)."""
    part = (ih * 256 + il).to(tl.float32) * (d * scale)
    if BITS == 4:
        part += dsum * bias
    return part


@triton.jit
def _trip_acts(q_row, s_row, c, nb, four, NB: tl.constexpr, BITS: tl.constexpr):
    """One row's activations for trip c (q_row, s_row: the row's rounded inputs and factors): its blocks' four
    quads as loaded (_split_quad splits them) and their factors d and d sum (int4's only; int8 gets d again)."""
    qa = ((c * NB + nb) * 16)[:, None, None] + four
    sa = s_row + ((c * NB + nb) * 2)[:, None, None] + four * 0
    d = tl.load(sa)
    dsum = d
    if BITS == 4:
        dsum = tl.load(sa + 1)
    return tl.load(q_row + qa), tl.load(q_row + qa + 4), tl.load(q_row + qa + 8), tl.load(q_row + qa + 12), d, dsum


@triton.jit
def _gemv_dp4a_kernel(q_ptr, s_ptr, y_ptr, w_ptr, f_ptr, M, N, K, stride_qm, stride_sm, stride_ym, stride_wk,
                      stride_fg, ws_ptr, cnt_ptr, SPLIT_K, bias_ptr, BITS: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_N: tl.constexpr, NB: tl.constexpr, BLOCK_M: tl.constexpr = 1,
                      OUT_BIAS: tl.constexpr = False, ASM: tl.constexpr = True, PREFETCH: tl.constexpr = 1,
                      PDL: tl.constexpr = False, STAGES: tl.constexpr = 1, ACTS: tl.constexpr = 0):
    """Program (m, n, s): rows [m * BLOCK_M, (m + 1) * BLOCK_M) (1, 2 or 4), outputs [n * BLOCK_N, (n + 1) *
    BLOCK_N), the s-th slice of K's trips of NB blocks (K a multiple of 32 * NB; a warp takes NB / warps). q_ptr,
    s_ptr: the rows' rounded activations (kernels/act_round.py); ws_ptr, cnt_ptr: gemv_kmajor's split-K workspace
    and counters. GROUP: inputs per group, a multiple of 32 (per channel: a value no block reaches past). Tiles are
    [NB, BLOCK_N / 4, 4]: a thread holds 4 neighbouring outputs (16-byte word loads) and loads each quarter block's
    4 activation int32 with one 16-byte load. PREFETCH: trips ahead a trip's words and factors are loaded (0-2); with
    PDL those first trips' loads go out before the wait for the kernel that wrote the activations (kernels/pdl.py).
    STAGES > 1 (with PREFETCH 0): Triton's pipeliner stages each trip's loads through shared memory by asynchronous
    copies (cp.async: LDGSTS on sm_80 and later), STAGES - 1 trips ahead, where PREFETCH's registers held one or two
    trips whose loads ptxas issues late in the loop (docs/PERF.md, Nsight Compute: the GEMVs wait on memory with
    DRAM at 22-75% of its peak); tests/measure/test_predict.py checks the copies in the compiled loop.
    ACTS 1 (one row): the next trip's activations and their factors are loaded before this trip's arithmetic, as
    PREFETCH does for the words, where each trip waited for its own (an L2 round trip a trip, in turn: a program
    of a few trips spends most of its time on them; docs/PERF.md, scripts/gpu_floor.py).
    """
    WPB: tl.constexpr = BITS  # words a block of 32 inputs
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m0 = pid_m * BLOCK_M
    n3 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [BLOCK_N / 4, 4]
    m3 = (n3 < N)[None, :, :]
    four = (tl.arange(0, 4)[None, :] + tl.arange(0, BLOCK_N // 4)[:, None] * 0)[None, :, :]  # a quad's 4 int32
    nb = tl.arange(0, NB)
    chunks = K // (32 * NB)
    c0 = pid_k * chunks // SPLIT_K
    c1 = (pid_k + 1) * chunks // SPLIT_K
    # a row past M (the last block's padding) reads row M - 1 again and writes nothing
    r1, r2, r3 = tl.minimum(m0 + 1, M - 1).to(tl.int64), tl.minimum(m0 + 2, M - 1).to(tl.int64), \
        tl.minimum(m0 + 3, M - 1).to(tl.int64)
    rq0, rq1, rq2, rq3 = m0.to(tl.int64) * stride_qm, r1 * stride_qm, r2 * stride_qm, r3 * stride_qm
    rs0, rs1, rs2, rs3 = m0.to(tl.int64) * stride_sm, r1 * stride_sm, r2 * stride_sm, r3 * stride_sm
    acc0 = tl.zeros((NB, BLOCK_N // 4, 4), tl.float32)
    acc1 = tl.zeros((NB, BLOCK_N // 4, 4), tl.float32)
    acc2 = tl.zeros((NB, BLOCK_N // 4, 4), tl.float32)
    acc3 = tl.zeros((NB, BLOCK_N // 4, 4), tl.float32)
    wp = w_ptr + (nb * WPB)[:, None, None] * stride_wk + n3[None, :, :]  # word 0 of each block of trip 0
    trip = NB * WPB * stride_wk
    fp = f_ptr + n3[None, :, :]  # the factors' row 0
    # PREFETCH 1: the next trip's words and factors are loaded before this trip's arithmetic; 2: the trip after it
    # too (ptxas issues a trip's loads late in the loop body, so one trip ahead arrives just in time at best)
    if PREFETCH > 0:
        n0, n1, n2, n3_, n4, n5, n6, n7, nf = _trip_words(wp, fp, c0, nb, trip, stride_wk, stride_fg, m3, NB, WPB,
                                                          GROUP)
    if PREFETCH > 1:
        p0, p1, p2, p3, p4, p5, p6, p7, pf = _trip_words(wp, fp, tl.minimum(c0 + 1, c1 - 1), nb, trip, stride_wk,
                                                         stride_fg, m3, NB, WPB, GROUP)
    wait_prior(PDL)  # the weights above are never written by a step; the activations below are
    if ACTS:  # BLOCK_M 1: the first trip's activations, the next ones a trip ahead in the loop
        v0, v1, v2, v3, d, dsum = _trip_acts(q_ptr + rq0, s_ptr + rs0, c0, nb, four, NB, BITS)
    for c in tl.range(c0, c1, num_stages=STAGES):
        blk = c * NB + nb  # [NB]: this trip's blocks
        if PREFETCH > 0:
            w0, w1, w2, w3, w4, w5, w6, w7, fac = n0, n1, n2, n3_, n4, n5, n6, n7, nf
            # the last trips load their own again (from L1) rather than past the slice
            cn = tl.minimum(c + PREFETCH, c1 - 1)
            if PREFETCH > 1:
                n0, n1, n2, n3_, n4, n5, n6, n7, nf = p0, p1, p2, p3, p4, p5, p6, p7, pf
                p0, p1, p2, p3, p4, p5, p6, p7, pf = _trip_words(wp, fp, cn, nb, trip, stride_wk, stride_fg, m3, NB,
                                                                 WPB, GROUP)
            else:
                n0, n1, n2, n3_, n4, n5, n6, n7, nf = _trip_words(wp, fp, cn, nb, trip, stride_wk, stride_fg, m3, NB,
                                                                  WPB, GROUP)
        else:
            w0, w1, w2, w3, w4, w5, w6, w7, fac = _trip_words(wp, fp, c, nb, trip, stride_wk, stride_fg, m3, NB, WPB,
                                                              GROUP)
        scale = (fac & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        bias = (fac >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        ih0 = tl.zeros((NB, BLOCK_N // 4, 4), tl.int32)
        il0, ih1, il1, ih2, il2, ih3, il3 = ih0, ih0, ih0, ih0, ih0, ih0, ih0
        if BITS == 4:  # a quarter block: one word
            a0, b0, a1, b1, a2, b2, a3, b3 = w0, w0, w1, w1, w2, w2, w3, w3
        else:  # two words
            a0, b0, a1, b1, a2, b2, a3, b3 = w0, w1, w2, w3, w4, w5, w6, w7
        if ACTS:
            u0, u1, u2, u3, ud, uds = v0, v1, v2, v3, d, dsum
            v0, v1, v2, v3, d, dsum = _trip_acts(q_ptr + rq0, s_ptr + rs0, tl.minimum(c + 1, c1 - 1), nb, four, NB,
                                                 BITS)
            e0, e1, e2, e3 = _split_quad(u0)
            ih0, il0 = _quad_unit(e0, e1, e2, e3, a0, b0, ih0, il0, BITS, ASM)
            e0, e1, e2, e3 = _split_quad(u1)
            ih0, il0 = _quad_unit(e0, e1, e2, e3, a1, b1, ih0, il0, BITS, ASM)
            e0, e1, e2, e3 = _split_quad(u2)
            ih0, il0 = _quad_unit(e0, e1, e2, e3, a2, b2, ih0, il0, BITS, ASM)
            e0, e1, e2, e3 = _split_quad(u3)
            ih0, il0 = _quad_unit(e0, e1, e2, e3, a3, b3, ih0, il0, BITS, ASM)
            acc0 += _block_part(ud, uds, ih0, il0, scale, bias, BITS)
        else:
            qa = (blk * 16)[:, None, None] + four  # [NB, BLOCK_N / 4, 4]: the block's first quad
            ih0, il0, ih1, il1, ih2, il2, ih3, il3 = _unit(q_ptr, rq0, rq1, rq2, rq3, qa, a0, b0, ih0, il0, ih1, il1,
                                                           ih2, il2, ih3, il3, BITS, BLOCK_M, ASM)
            ih0, il0, ih1, il1, ih2, il2, ih3, il3 = _unit(q_ptr, rq0, rq1, rq2, rq3, qa + 4, a1, b1, ih0, il0, ih1,
                                                           il1, ih2, il2, ih3, il3, BITS, BLOCK_M, ASM)
            ih0, il0, ih1, il1, ih2, il2, ih3, il3 = _unit(q_ptr, rq0, rq1, rq2, rq3, qa + 8, a2, b2, ih0, il0, ih1,
                                                           il1, ih2, il2, ih3, il3, BITS, BLOCK_M, ASM)
            ih0, il0, ih1, il1, ih2, il2, ih3, il3 = _unit(q_ptr, rq0, rq1, rq2, rq3, qa + 12, a3, b3, ih0, il0, ih1,
                                                           il1, ih2, il2, ih3, il3, BITS, BLOCK_M, ASM)
            sa = (blk * 2)[:, None, None] + four * 0
            acc0 += _row_block(s_ptr + rs0, sa, ih0, il0, scale, bias, BITS)
            if BLOCK_M > 1:
                acc1 += _row_block(s_ptr + rs1, sa, ih1, il1, scale, bias, BITS)
            if BLOCK_M > 2:
                acc2 += _row_block(s_ptr + rs2, sa, ih2, il2, scale, bias, BITS)
                acc3 += _row_block(s_ptr + rs3, sa, ih3, il3, scale, bias, BITS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    km._finish_rows(_outputs(acc0, BLOCK_N), _outputs(acc1, BLOCK_N), _outputs(acc2, BLOCK_N),
                    _outputs(acc3, BLOCK_N), 0.0, y_ptr, bias_ptr, ws_ptr, cnt_ptr, SPLIT_K, M, N, K, m0, offs_n,
                    offs_n < N, stride_ym, 0.0, BLOCK_M, False, OUT_BIAS)


@triton.jit
def _outputs(acc, BLOCK_N: tl.constexpr):
    """A row's [NB, BLOCK_N / 4, 4] partial sums as its [BLOCK_N] outputs."""
    return tl.reshape(tl.sum(acc, axis=0), (BLOCK_N,))


def _asm(device: torch.device) -> bool:
    """dp4a as the PTX instruction (a GPU), or written out (Triton's interpreter)."""
    return device.type == "cuda"


# the launch's knobs: blocks (of 32 inputs) a trip, warps, trips ahead their words and factors are loaded (0-2),
# programs an SM, the pipeliner's stages (1: none; scripts/sweep_dp4a.py times the others), the next trip's
# activations loaded a trip ahead (1) at one row, or each trip's its own (0)
DEFAULT_TILE = dict(blocks=2, num_warps=2, PREFETCH=1, per_sm=8, stages=1, acts=0)  # best or within 4% on the H200 (PERF)
# The fastest tile measured per card and one-row shape (scripts/sweep_dp4a.py --table): {card name: {"bits:N:K":
# tile}}. On the H200 (2026-11-26) the best tile of a shape beat DEFAULT_TILE by 5-27% (docs/PERF.md). The H100's
# int4 tiles load the activations ahead (acts): its batch-1 int4-g128 decode 396.4-397.7 against 382.5-384.9 tok/s
# in the same call; its int8 shapes keep DEFAULT_TILE, their swept tiles faster alone but slower end to end.
# LOCALPD_DP4A_TILES names another table (a benchmark's A/B of a table before it ships; a missing file: DEFAULT_TILE).
TILE_TABLE = Path(os.environ.get("LOCALPD_DP4A_TILES") or Path(__file__).with_name("gemv_dp4a_tiles.json"))


def tile_for(device: torch.device, bits: int, n: int, k: int, m: int) -> dict:
    """The launch's knobs: the measured tile for this card and shape at one row, else DEFAULT_TILE."""
    if m == 1:
        return measured_tile(TILE_TABLE, DEFAULT_TILE, device, bits, n, k)
    return dict(DEFAULT_TILE)


def blocks_a_trip(k: int, most: int = DEFAULT_TILE["blocks"]) -> int:
    """Blocks a trip: the most of most, most / 2, ..., 1 that K's blocks divide into."""
    nb = most
    while (k // 32) % nb:
        nb //= 2
    return nb


# Rows the model sends here (decode batches, a verification's drafted rows): 4 a program, so 9-16 rows read each
# weight tile in 3-4 programs, where past gemv_kmajor.MAX_ROWS (8) the weight was dequantized for cuBLAS: 5.6x a
# one-row step at 9-16 rows on an H100 (Llama-3-8B int4-g128, scripts/gpu_speculate.py, 2026-11-26).
MAX_ROWS = 16
# The model's GEMVs take this kernel where its activations are 16-bit floats: the rounding to two int8 levels keeps
# about 15 bits, more than float16's 11 and bfloat16's 8 (float32 activations keep gemv_kmajor's float product).
# False sends every GEMV to gemv_kmajor (the benchmarks compare the two).
ENABLED = True


def takes(shape: tuple[int, int], bits: int, group: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the model's GEMV runs here for a weight of this shape and activations of this dtype: K a multiple
    of 32, groups of whole blocks, 16-bit activations (ENABLED)."""
    k = shape[1]
    return ENABLED and dtype in (torch.float16, torch.bfloat16) and k % 32 == 0 and k > 0 and (
        group >= k or group % 32 == 0)


def gemv_dp4a(x: torch.Tensor, words: torch.Tensor, factors: torch.Tensor, bits: int, group: int, *, bias=None,
              split_k: int | None = None, tile: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ W.T (+ bias) -> [M, N] in x.dtype, for K-major words and factors
    (quant/kmajor.py), with x rounded by quantize_act. split_k overrides gemv_kmajor.split_for (tests); tile
    overrides DEFAULT_TILE's knobs (scripts/sweep_dp4a.py)."""
    out = torch.empty((x.shape[0], words.shape[1]), dtype=x.dtype, device=x.device)
    q, s = quantize_act(x, bits)
    return gemv_rounded(q, s, out, words, factors, bits, group, bias=bias, split_k=split_k, tile=tile)


def gemv_rounded(q: torch.Tensor, s: torch.Tensor, out: torch.Tensor, words: torch.Tensor, factors: torch.Tensor,
                 bits: int, group: int, *, bias=None, split_k: int | None = None, tile: dict | None = None):
    """gemv_dp4a's product of activations already rounded (quantize_act's q, s), written to out [M, N]."""
    n, k = words.shape[1], words.shape[0] * 32 // bits
    m = out.shape[0]
    if m == 0 or n == 0:
        return out
    tile = {**tile_for(out.device, bits, n, k, m), **(tile or {})}
    nb = blocks_a_trip(k, tile["blocks"])
    rows = min(km.MAX_BLOCK_M, 1 << (m - 1).bit_length())
    blocks, tiles = -(-m // rows), -(-n // km.BLOCK_N)
    split = split_k or km.split_for(blocks, n, k, 32 * nb, km.sm_count(out.device), tile["per_sm"])
    split = max(1, min(split, k // (32 * nb)))
    ws, cnt = km.workspace(out.device, blocks * rows * split * n + blocks * tiles * split, blocks * tiles)
    _gemv_dp4a_kernel[(blocks, tiles, split)](
        q, s, out, words, factors, m, n, k, q.stride(0), s.stride(0), out.stride(0), words.stride(0),
        factors.stride(0), ws, cnt, split, out if bias is None else bias, BITS=bits,
        GROUP=group if group < k else 1 << 30, BLOCK_N=km.BLOCK_N, NB=nb, BLOCK_M=rows, OUT_BIAS=bias is not None,
        ASM=_asm(out.device), PREFETCH=int(tile["PREFETCH"]), STAGES=int(tile["stages"]),
        ACTS=int(tile["acts"]) if rows == 1 else 0,
        num_warps=min(nb, tile["num_warps"]), num_stages=int(tile["stages"]),
        **launch_args(out))
    return out


# torch references, same signatures

def gemv_dp4a_ref(x: torch.Tensor, words: torch.Tensor, factors: torch.Tensor, bits: int, group: int, *, bias=None,
                  split_k: int | None = None, tile: dict | None = None) -> torch.Tensor:
    """gemv_dp4a in torch: the rounded activations times the dequantized weights, in float64."""
    from localpd.quant.kmajor import KMajorInt4, KMajorInt8

    w = (KMajorInt4 if bits == 4 else KMajorInt8)(words, factors).dequantize(torch.float64)
    y = rounded_act_ref(x) @ w.T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)
