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
16-byte load of words), and the s-th slice of K; each of its 4 warps takes one 32-input block a trip (a thread
holds a block's int32 sums for its 4 outputs, so no value crosses threads before the end). Split-K and its
in-launch reduction are gemv_kmajor's (_finish_rows). The rounded activations (kernels/act_round.py) come from
the step that makes the GEMV's input (RMSNorm, SiLU * up: kernels/fused.py) or from a launch of their own.

Under Triton's interpreter `dp4a` is written out in integer operations (ASM=False); compiled for a GPU it is
the PTX instruction (ASM=True), which tests/kernels/test_gemv_dp4a.py checks in the SASS.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from localpd.kernels import gemv_kmajor as km
from localpd.kernels.act_round import quantize_act, rounded_act_ref

BLOCK = 32  # inputs sharing one activation scale (the CPU kernels' block)
NUM_WARPS = 4  # blocks a trip: one a warp


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
def _row_word(q_ptr, at, w, wl, wh, ih, il, BITS: tl.constexpr, ASM: tl.constexpr):
    """One row's integer sums (hi level, lo level) advanced by one word a thread (w; int4: its low and high
    nibbles wl, wh); q_ptr + at: the word's four (int4) or two (int8) activation int32 (quantize_act's layout)."""
    at = q_ptr + at
    if BITS == 4:
        ih = _dp4a(wh, tl.load(at + 1), _dp4a(wl, tl.load(at), ih, False, ASM), False, ASM)
        il = _dp4a(wh, tl.load(at + 3), _dp4a(wl, tl.load(at + 2), il, False, ASM), False, ASM)
    else:
        ih = _dp4a(w, tl.load(at), ih, True, ASM)
        il = _dp4a(w, tl.load(at + 1), il, True, ASM)
    return ih, il


@triton.jit
def _word(q_ptr, rq0, rq1, rq2, rq3, at, w, ih0, il0, ih1, il1, ih2, il2, ih3, il3, BITS: tl.constexpr,
          BLOCK_M: tl.constexpr, ASM: tl.constexpr):
    """Every row's integer sums advanced by a word a thread (w), its fields split once for all rows."""
    wl = w & 0x0F0F0F0F
    wh = (w >> 4) & 0x0F0F0F0F
    ih0, il0 = _row_word(q_ptr + rq0, at, w, wl, wh, ih0, il0, BITS, ASM)
    if BLOCK_M > 1:
        ih1, il1 = _row_word(q_ptr + rq1, at, w, wl, wh, ih1, il1, BITS, ASM)
    if BLOCK_M > 2:
        ih2, il2 = _row_word(q_ptr + rq2, at, w, wl, wh, ih2, il2, BITS, ASM)
        ih3, il3 = _row_word(q_ptr + rq3, at, w, wl, wh, ih3, il3, BITS, ASM)
    return ih0, il0, ih1, il1, ih2, il2, ih3, il3


@triton.jit
def _trip_words(wp, fp, stride_wk, mask, WPB: tl.constexpr):
    """A trip's words a thread, from wp (word 0 of each of its blocks): WPB of them (int8: 8; int4: 4, then 0s),
    and its blocks' group factors (from fp)."""
    fac = tl.load(fp, mask=mask, other=0)
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
    part = (ih * 256 + il).to(tl.float32) * (tl.load(at) * scale)
    if BITS == 4:
        part += tl.load(at + 1) * bias
    return part


@triton.jit
def _gemv_dp4a_kernel(q_ptr, s_ptr, y_ptr, w_ptr, f_ptr, M, N, K, stride_qm, stride_sm, stride_ym, stride_wk,
                      stride_fg, ws_ptr, cnt_ptr, SPLIT_K, bias_ptr, BITS: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_N: tl.constexpr, NB: tl.constexpr, BLOCK_M: tl.constexpr = 1,
                      OUT_BIAS: tl.constexpr = False, ASM: tl.constexpr = True, PREFETCH: tl.constexpr = True):
    """Program (m, n, s): rows [m * BLOCK_M, (m + 1) * BLOCK_M) (1, 2 or 4), outputs [n * BLOCK_N, (n + 1) *
    BLOCK_N), the s-th slice of K's trips of NB blocks (K a multiple of 32 * NB; a warp takes NB / warps). q_ptr, s_ptr: the
    rows' rounded activations (quantize_act); ws_ptr, cnt_ptr: gemv_kmajor's split-K workspace and counters.
    GROUP: inputs per group, a multiple of 32 (per channel: a value no block reaches past). A trip's words are
    loaded a trip ahead with PREFETCH (WPB 16-byte loads a thread in flight while a trip computes)."""
    WPB: tl.constexpr = BITS  # words a block of 32 inputs
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m0 = pid_m * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    lanes = (offs_n * 0)[None, :]  # activation addresses are the same for a warp's lanes (broadcast loads)
    nb = tl.arange(0, NB)
    chunks = K // (32 * NB)
    c0 = pid_k * chunks // SPLIT_K
    c1 = (pid_k + 1) * chunks // SPLIT_K
    # a row past M (the last block's padding) reads row M - 1 again and writes nothing
    r1, r2, r3 = tl.minimum(m0 + 1, M - 1).to(tl.int64), tl.minimum(m0 + 2, M - 1).to(tl.int64), \
        tl.minimum(m0 + 3, M - 1).to(tl.int64)
    rq0, rq1, rq2, rq3 = m0.to(tl.int64) * stride_qm, r1 * stride_qm, r2 * stride_qm, r3 * stride_qm
    rs0, rs1, rs2, rs3 = m0.to(tl.int64) * stride_sm, r1 * stride_sm, r2 * stride_sm, r3 * stride_sm
    acc0 = tl.zeros((NB, BLOCK_N), tl.float32)
    acc1 = tl.zeros((NB, BLOCK_N), tl.float32)
    acc2 = tl.zeros((NB, BLOCK_N), tl.float32)
    acc3 = tl.zeros((NB, BLOCK_N), tl.float32)
    m2 = n_mask[None, :]
    wp = w_ptr + (nb * WPB)[:, None] * stride_wk + offs_n[None, :]  # word 0 of each block of trip 0
    trip = NB * WPB * stride_wk
    fp = f_ptr + offs_n[None, :]  # + a block's group row
    if PREFETCH:  # the next trip's words and factors are loaded before this trip's arithmetic
        n0, n1, n2, n3, n4, n5, n6, n7, nf = _trip_words(wp + c0 * trip, fp + ((c0 * NB + nb) * 32 // GROUP)[:, None]
                                                         * stride_fg, stride_wk, m2, WPB)
    for c in range(c0, c1):
        blk = c * NB + nb  # [NB]: this trip's blocks
        if PREFETCH:
            w0, w1, w2, w3, w4, w5, w6, w7, fac = n0, n1, n2, n3, n4, n5, n6, n7, nf
            # the last trip loads its own again (from L1) rather than past the slice
            cn = tl.minimum(c + 1, c1 - 1)
            n0, n1, n2, n3, n4, n5, n6, n7, nf = _trip_words(wp + cn * trip, fp + ((cn * NB + nb) * 32 // GROUP)[:, None]
                                                             * stride_fg, stride_wk, m2, WPB)
        else:
            w0, w1, w2, w3, w4, w5, w6, w7, fac = _trip_words(wp + c * trip, fp + (blk * 32 // GROUP)[:, None]
                                                              * stride_fg, stride_wk, m2, WPB)
        scale = (fac & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        bias = (fac >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        ih0 = tl.zeros((NB, BLOCK_N), tl.int32)
        il0, ih1, il1, ih2, il2, ih3, il3 = ih0, ih0, ih0, ih0, ih0, ih0, ih0
        qa = (blk * 16)[:, None] + lanes  # [NB, BLOCK_N]: the block's activation int32
        step: tl.constexpr = 16 // WPB  # activation int32 a word
        ih0, il0, ih1, il1, ih2, il2, ih3, il3 = _word(q_ptr, rq0, rq1, rq2, rq3, qa, w0, ih0, il0, ih1, il1, ih2,
                                                       il2, ih3, il3, BITS, BLOCK_M, ASM)
        ih0, il0, ih1, il1, ih2, il2, ih3, il3 = _word(q_ptr, rq0, rq1, rq2, rq3, qa + step, w1, ih0, il0, ih1, il1,
                                                       ih2, il2, ih3, il3, BITS, BLOCK_M, ASM)
        ih0, il0, ih1, il1, ih2, il2, ih3, il3 = _word(q_ptr, rq0, rq1, rq2, rq3, qa + 2 * step, w2, ih0, il0, ih1,
                                                       il1, ih2, il2, ih3, il3, BITS, BLOCK_M, ASM)
        ih0, il0, ih1, il1, ih2, il2, ih3, il3 = _word(q_ptr, rq0, rq1, rq2, rq3, qa + 3 * step, w3, ih0, il0, ih1,
                                                       il1, ih2, il2, ih3, il3, BITS, BLOCK_M, ASM)
        if WPB == 8:
            ih0, il0, ih1, il1, ih2, il2, ih3, il3 = _word(q_ptr, rq0, rq1, rq2, rq3, qa + 4 * step, w4, ih0, il0,
                                                           ih1, il1, ih2, il2, ih3, il3, BITS, BLOCK_M, ASM)
            ih0, il0, ih1, il1, ih2, il2, ih3, il3 = _word(q_ptr, rq0, rq1, rq2, rq3, qa + 5 * step, w5, ih0, il0,
                                                           ih1, il1, ih2, il2, ih3, il3, BITS, BLOCK_M, ASM)
            ih0, il0, ih1, il1, ih2, il2, ih3, il3 = _word(q_ptr, rq0, rq1, rq2, rq3, qa + 6 * step, w6, ih0, il0,
                                                           ih1, il1, ih2, il2, ih3, il3, BITS, BLOCK_M, ASM)
            ih0, il0, ih1, il1, ih2, il2, ih3, il3 = _word(q_ptr, rq0, rq1, rq2, rq3, qa + 7 * step, w7, ih0, il0,
                                                           ih1, il1, ih2, il2, ih3, il3, BITS, BLOCK_M, ASM)
        sa = (blk * 2)[:, None] + lanes
        acc0 += _row_block(s_ptr + rs0, sa, ih0, il0, scale, bias, BITS)
        if BLOCK_M > 1:
            acc1 += _row_block(s_ptr + rs1, sa, ih1, il1, scale, bias, BITS)
        if BLOCK_M > 2:
            acc2 += _row_block(s_ptr + rs2, sa, ih2, il2, scale, bias, BITS)
            acc3 += _row_block(s_ptr + rs3, sa, ih3, il3, scale, bias, BITS)
    km._finish_rows(tl.sum(acc0, axis=0), tl.sum(acc1, axis=0), tl.sum(acc2, axis=0), tl.sum(acc3, axis=0), 0.0,
                    y_ptr, bias_ptr, ws_ptr, cnt_ptr, SPLIT_K, M, N, K, m0, offs_n, n_mask, stride_ym, 0.0, BLOCK_M,
                    False, OUT_BIAS)


def _asm(device: torch.device) -> bool:
    """dp4a as the PTX instruction (a GPU), or written out (Triton's interpreter)."""
    return device.type == "cuda"


# the launch's knobs: blocks (of 32 inputs) a trip, warps, the next trip's words and factors loaded ahead, programs
# an SM (scripts/sweep_dp4a.py times the others)
DEFAULT_TILE = dict(blocks=4, num_warps=4, PREFETCH=True, per_sm=8)
# The fastest tile measured per card and one-row shape (scripts/sweep_dp4a.py --table): {card name: {"bits:N:K":
# tile}}. On the H200 (2026-11-26) the best tile of a shape beat DEFAULT_TILE by 5-27% (docs/PERF.md).
TILE_TABLE = Path(__file__).with_name("gemv_dp4a_tiles.json")


@functools.lru_cache(maxsize=None)
def _measured_tiles(card: str) -> dict:
    try:
        return json.loads(TILE_TABLE.read_text()).get(card, {})
    except (OSError, ValueError):
        return {}


def tile_for(device: torch.device, bits: int, n: int, k: int, m: int) -> dict:
    """The launch's knobs: the measured tile for this card and shape at one row, else DEFAULT_TILE."""
    if device.type == "cuda" and m == 1:
        return {**DEFAULT_TILE, **_measured_tiles(torch.cuda.get_device_name(device)).get(f"{bits}:{n}:{k}", {})}
    return dict(DEFAULT_TILE)


def blocks_a_trip(k: int, most: int = DEFAULT_TILE["blocks"]) -> int:
    """Blocks a trip: the most of most, most / 2, ..., 1 that K's blocks divide into."""
    nb = most
    while (k // 32) % nb:
        nb //= 2
    return nb


# The model's GEMVs take this kernel where its activations are 16-bit floats: the rounding to two int8 levels keeps
# about 15 bits, below the 11 of float16 and 8 of bfloat16 (float32 activations keep gemv_kmajor's float product).
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
    """x [M, K] (M <= gemv_kmajor.MAX_ROWS) @ W.T (+ bias) -> [M, N] in x.dtype, for K-major words and factors
    (quant/kmajor.py), with x rounded by quantize_act. split_k overrides gemv_kmajor.split_for (tests); tile
    overrides DEFAULT_TILE's knobs (scripts/sweep_dp4a.py)."""
    n, k = words.shape[1], words.shape[0] * 32 // bits
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
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
        ASM=_asm(out.device), PREFETCH=tile["PREFETCH"], num_warps=min(nb, tile["num_warps"]), num_stages=1)
    return out


# torch references, same signatures

def gemv_dp4a_ref(x: torch.Tensor, words: torch.Tensor, factors: torch.Tensor, bits: int, group: int, *, bias=None,
                  split_k: int | None = None, per_sm: int = 0) -> torch.Tensor:
    """gemv_dp4a in torch: the rounded activations times the dequantized weights, in float64."""
    from localpd.quant.kmajor import KMajorInt4, KMajorInt8

    w = (KMajorInt4 if bits == 4 else KMajorInt8)(words, factors).dequantize(torch.float64)
    y = rounded_act_ref(x) @ w.T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)
