"""The batch-1 decode GEMV whose program takes 4 outputs over the whole of K: no split-K (issue 32).

kernels/gemv_dp4a.py's program takes 128 outputs (32 lanes x 4) and a slice of K, and a launch needs 16-32 slices a
column tile to have enough programs; the slices' partials then meet through a workspace: each program stores its
partials, fences, counts itself on an atomic, and the last one reloads them all. On an H100 that reduction and
the launch kept every GEMV 3.9-4.7 us above its bytes' time (docs/PERF.md, scripts/gpu_floor.py), so o (3 us of
bytes) could not pass 40% of copy bandwidth however fast its loop.

Here the weights are stored in strips (quant/kmajor.py, `KStripWeight`): the words of outputs 4j..4j+3 are one
contiguous [K * bits / 32, 4] run, each row 16 bytes (one 128-bit load a lane: a word of each of the 4 outputs).
Program (m, j) streams strip j: lane l of trip c loads row c * ROWS + l, so a warp's load is 512 contiguous bytes,
and every lane meets its row with the activations of the same 8 inputs (int4; 4 for int8) in one 16-byte load (8
bytes for int8), shared by the strip's 4 outputs. A lane's integer sums become a float once a row, times the
block's d and the group's scale (plus, for int4, the group's bias times a quarter of the block's d sum(256 hi +
lo): each of a block's 4 rows adds its quarter). The lanes' partials meet in the program (a sum across its warps,
at the end): N / 4 programs a launch of one strip a program (1024 for a 4096-output matrix: about 8 an SM), each
waiting on one round trip of its weights and activations, not three. A launch costs more the more programs it has,
so one row takes programs of 4 strips where the SMs still get one each (WIDE_TILE: 256 for 4096 outputs), the
strips stacked as rows of the program's tile.

The activations are rounded as for gemv_dp4a (kernels/act_round.py: two int8 levels a value, d per block of 32),
and dp4a is gemv_dp4a's. Up to 4 rows a program share its loads (decode batches, a verification's drafted rows).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from localpd.errors import LocalpdError
from localpd.kernels.act_round import quantize_act, rounded_act_ref
from localpd.kernels.dispatch import sm_count
from localpd.kernels.gemv_dp4a import _asm, _dp4a
from localpd.kernels.pdl import launch_args, wait_prior
from localpd.kernels.tile_table import measured_tile
from localpd.quant.kmajor import STRIP, KStripInt4, KStripInt8  # STRIP: the outputs a program takes

MAX_BLOCK_M = 4  # rows a program takes, each with an accumulator of its own
MAX_ROWS = 16  # rows a launch takes (the model's decode batches and verifications): programs of up to 4
ONE_GROUP = tl.constexpr(1 << 30)  # GROUP of a weight with one group of all of K (int8 per output)
# The launch's knobs: warps, strip rows a lane a trip, trips ahead a trip's words and factors are loaded (0-2),
# strips a program (1, 2, 4 or 8 where they divide N: stacked as rows of the program's tile, each row with its own
# activations as one strip's rows are, so the layout and its loads stay one strip's; fewer, longer programs).
# DEFAULT_TILE's trip: 2 x 32 x 2 rows of a strip (2 KB of int4 words). At one row on sm_90, 2 rows a lane take 56
# registers (21.4 instructions an int4 word), so 18 programs fit an SM and qkv's 1536 programs start in one wave
# (4 rows a lane: 95 registers, 19.1 a word, 10 an SM: 1320 at once and a tail of 216, each waiting its own trips);
# programs of 4 rows take 126 (4 rows a lane: up to 254 on sm_80).
DEFAULT_TILE = dict(num_warps=2, rows_a_lane=2, PREFETCH=1, strips=1)
# A launch costs more the more programs it has (H100, scripts/gpu_floor.py, PDL on: an empty kernel of one program
# 0.51 us, of 1056 programs 1.82 us), so one row launches programs of 4 strips (16 outputs) wherever every SM
# still gets one: 256 programs for o and down, not 1024. 4 warps of one strip row a lane load 8 KB of int4 words a
# trip, with one trip ahead 16 KB in flight a program; sm_90: 96 registers, 19.6 instructions an int4 word (int8:
# 70, 8.4), no spills, no barriers (the strips spread across the tile's columns took 128 registers and 12 barriers
# a trip, for their activations' broadcast to 16 outputs).
WIDE_TILE = dict(num_warps=4, rows_a_lane=1, PREFETCH=1, strips=4)
# The fastest tile measured per card and one-row shape (scripts/bench_strip.py --table): {card name: {"bits:N:K":
# tile}}; none measured yet. LOCALPD_STRIP_TILES names another table (a missing file: DEFAULT_TILE).
TILE_TABLE = Path(os.environ.get("LOCALPD_STRIP_TILES") or Path(__file__).with_name("gemv_strip_tiles.json"))


def designed_tile(n: int, sms: int) -> dict:
    """The one-row tile for N outputs on a card of `sms` SMs, before any measurement: WIDE_TILE where its programs
    (N / 16) give every SM one, else DEFAULT_TILE."""
    outputs = STRIP * WIDE_TILE["strips"]
    return dict(WIDE_TILE if n % outputs == 0 and n // outputs >= sms else DEFAULT_TILE)


def tile_for(device: torch.device, bits: int, n: int, k: int, m: int) -> dict:
    """The launch's knobs: the measured tile for this card and shape at one row, else designed_tile's; rows sharing
    a program (m > 1) take DEFAULT_TILE."""
    if m > 1:
        return dict(DEFAULT_TILE)
    return measured_tile(TILE_TABLE, designed_tile(n, sm_count(device)), device, bits, n, k)


# The cards (torch.cuda.get_device_name) on which the model holds its int4/int8 matrices in strips and decodes
# through this GEMV; elsewhere K-major (kernels/gemv_dp4a.py's). A card joins once scripts/gpu_session.sh's `stripab`
# step has measured this GEMV faster there, end to end; none has yet (docs/PERF.md). LOCALPD_GEMV=strip (or
# =kmajor) chooses for every card.
MEASURED_FASTER: frozenset[str] = frozenset()


def holds_strips(device: torch.device) -> bool:
    """Whether a model placed on this device holds its int4/int8 matrices in strips (MEASURED_FASTER)."""
    asked = os.environ.get("LOCALPD_GEMV", "")
    if asked not in ("", "strip", "kmajor"):
        raise LocalpdError(f"LOCALPD_GEMV takes strip or kmajor, not {asked!r}")
    if asked:
        return asked == "strip"
    return device.type == "cuda" and torch.cuda.get_device_name(device) in MEASURED_FASTER


@triton.jit
def _row_sums(w, e0, e1, e2, e3, BITS: tl.constexpr, ASM: tl.constexpr):
    """One activation row's integer sum 256 hi + lo over strip rows' words w [R, 4]: int4 against the quad (hi
    even, hi odd, lo even, lo odd inputs; e0..e3 [R, 1]), int8 against (hi, lo) (e0, e1). The lo level's products
    start from the hi level's sum shifted up, so one chain of dp4a gives the whole sum (at most 8 x 15 x 127 x 257:
    no overflow)."""
    if BITS == 4:
        wl = w & 0x0F0F0F0F
        wh = (w >> 4) & 0x0F0F0F0F
        ih = _dp4a(wh, e1, _dp4a(wl, e0, w * 0, False, ASM), False, ASM)
        return _dp4a(wh, e3, _dp4a(wl, e2, ih << 8, False, ASM), False, ASM)
    return _dp4a(w, e1, _dp4a(w, e0, w * 0, True, ASM) << 8, True, ASM)


@triton.jit
def _row_trip(q_row, s_row, r0, lanes, U, w, scale, bias, acc, BITS: tl.constexpr, EVEN: tl.constexpr,
              ASM: tl.constexpr):
    """acc [R, 4] plus one activation row's products with the strip rows r0 + lanes (words w, their groups' scale
    and bias [R, 4]): the row's rounded inputs q_row, factors s_row (kernels/act_round.py). Past a strip's U rows
    (not EVEN) the activations load as 0s, so the rows repeated there add nothing."""
    WPB: tl.constexpr = BITS  # strip rows a block of 32 inputs
    live = (r0 + lanes < U)[:, None]
    d_at = s_row + (r0 // WPB) * 2 + (lanes // WPB)[:, None] * 2  # a block's d (int4: then d sum(256 hi + lo))
    if BITS == 4:
        at = q_row + r0 * 4 + lanes[:, None] * 4 + tl.arange(0, 4)[None, :]
        quad = tl.load(at) if EVEN else tl.load(at, mask=live, other=0)
        x02, x13 = tl.split(tl.reshape(quad, (quad.shape[0], 2, 2)))
        e0, e2 = tl.split(x02)
        e1, e3 = tl.split(x13)
        t = _row_sums(w, e0[:, None], e1[:, None], e2[:, None], e3[:, None], BITS, ASM)
        at = d_at + tl.arange(0, 2)[None, :]  # one 8-byte load: d and d sum
        d, dsum = tl.split(tl.load(at) if EVEN else tl.load(at, mask=live, other=0.0))
        return acc + t.to(tl.float32) * (d[:, None] * scale) + (dsum[:, None] * 0.25) * bias
    at = q_row + r0 * 2 + lanes[:, None] * 2 + tl.arange(0, 2)[None, :]
    e0, e1 = tl.split(tl.load(at) if EVEN else tl.load(at, mask=live, other=0))
    t = _row_sums(w, e0[:, None], e1[:, None], e0[:, None], e1[:, None], BITS, ASM)
    d = tl.load(d_at) if EVEN else tl.load(d_at, mask=live, other=0.0)
    return acc + t.to(tl.float32) * (d * scale)


@triton.jit
def _strip_trip(w_ptr, f_ptr, wcol, fcol, r0, lanes, U, GROUP: tl.constexpr, BITS: tl.constexpr,
                EVEN: tl.constexpr, ROWS: tl.constexpr):
    """The words [R, 4] of the program's strips' rows r0 + lanes (lane l's row 16 bytes after lane l - 1's; past
    their U rows, not EVEN, the last row again) and their groups' factors [R, 4] (scale | bias << 16: one 16-byte
    load a row, shared by a group's rows; with one group of all of K, 0s: the kernel loads its factors once).
    wcol, fcol ([1, 4], or [R, 4] for several strips): each tile element's offset in the words and in the factors
    (_columns). ROWS: strip rows a trip."""
    RPG: tl.constexpr = GROUP * BITS // 32  # strip rows a group
    if EVEN:
        w = tl.load(w_ptr + r0 * 4 + lanes[:, None] * 4 + wcol)
    else:
        w = tl.load(w_ptr + tl.minimum(r0 + lanes, U - 1)[:, None] * 4 + wcol)
    if GROUP == ONE_GROUP:
        return w, w * 0
    if EVEN and ROWS % RPG == 0:
        return w, tl.load(f_ptr + (r0 // RPG) * 4 + (lanes // RPG)[:, None] * 4 + fcol)
    return w, tl.load(f_ptr + (tl.minimum(r0 + lanes, U - 1) // RPG)[:, None] * 4 + fcol)


@triton.jit
def _columns(stride, ROWS: tl.constexpr, STRIPS: tl.constexpr):
    """Each tile element's offset from the program's first strip: one strip [1, 4] (output e at e); several [ROWS x
    STRIPS, 4], the strips stacked as rows of the tile (row s * ROWS + l of strip s at s * stride)."""
    c = tl.arange(0, 4)[None, :]
    if STRIPS > 1:
        c = (tl.arange(0, ROWS * STRIPS) // ROWS)[:, None] * stride + c
    return c


@triton.jit
def _trip_products(q_ptr, s_ptr, rq0, rq1, rq2, rq3, rs0, rs1, rs2, rs3, r0, lanes, U, w, fac, acc0, acc1, acc2,
                   acc3, BITS: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, ASM: tl.constexpr):
    """Every row's accumulator plus its products with a trip's words w and factors fac (_row_trip)."""
    scale = (fac & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    bias = (fac >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    acc0 = _row_trip(q_ptr + rq0, s_ptr + rs0, r0, lanes, U, w, scale, bias, acc0, BITS, EVEN, ASM)
    if BLOCK_M > 1:
        acc1 = _row_trip(q_ptr + rq1, s_ptr + rs1, r0, lanes, U, w, scale, bias, acc1, BITS, EVEN, ASM)
    if BLOCK_M > 2:
        acc2 = _row_trip(q_ptr + rq2, s_ptr + rs2, r0, lanes, U, w, scale, bias, acc2, BITS, EVEN, ASM)
        acc3 = _row_trip(q_ptr + rq3, s_ptr + rs3, r0, lanes, U, w, scale, bias, acc3, BITS, EVEN, ASM)
    return acc0, acc1, acc2, acc3


@triton.jit
def _gemv_strip_kernel(q_ptr, s_ptr, y_ptr, w_ptr, f_ptr, bias_ptr, M, N, K, stride_qm, stride_sm, stride_ym,
                       stride_wj, stride_fj, BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                       TAIL: tl.constexpr = False, BLOCK_M: tl.constexpr = 1, OUT_BIAS: tl.constexpr = False,
                       ASM: tl.constexpr = True, PREFETCH: tl.constexpr = 1, PDL: tl.constexpr = False,
                       STRIPS: tl.constexpr = 1):
    """Program (m, j): rows [m * BLOCK_M, (m + 1) * BLOCK_M) (1, 2 or 4; a row past M reads row M - 1 again and
    writes nothing), the STRIPS strips from j * STRIPS (outputs 4 STRIPS j..; their rows stacked in the tile,
    strip s's rows at s * ROWS) over all of K. w_ptr, f_ptr: the strips' words [N / 4, K * BITS / 32, 4] and
    factors [N / 4, K / GROUP, 4] (strip j at j * stride_wj, j * stride_fj). ROWS: strip rows a trip (its lanes x
    rows a lane, of each strip): the loop's trips take whole ROWS, unmasked, and with TAIL a last trip takes the
    rows past them, masked. PREFETCH 1 (at least one whole trip): the next trip's words and factors are loaded
    before this trip's arithmetic, 2: the one after it too (o's two trips all before the first's arithmetic), and
    with PDL the first trips' go out before the wait for the kernel that wrote the activations."""
    pid_m, j = tl.program_id(0), tl.program_id(1)
    m0 = pid_m * BLOCK_M
    U = K * BITS // 32  # a strip's rows
    lanes = tl.arange(0, ROWS * STRIPS) % ROWS  # each tile row's strip row in a trip: the strips stacked
    wj = w_ptr + (j * STRIPS).to(tl.int64) * stride_wj
    fj = f_ptr + (j * STRIPS).to(tl.int64) * stride_fj
    wcol, fcol = _columns(stride_wj, ROWS, STRIPS), _columns(stride_fj, ROWS, STRIPS)
    r1, r2, r3 = tl.minimum(m0 + 1, M - 1).to(tl.int64), tl.minimum(m0 + 2, M - 1).to(tl.int64), \
        tl.minimum(m0 + 3, M - 1).to(tl.int64)
    rq0, rq1, rq2, rq3 = m0.to(tl.int64) * stride_qm, r1 * stride_qm, r2 * stride_qm, r3 * stride_qm
    rs0, rs1, rs2, rs3 = m0.to(tl.int64) * stride_sm, r1 * stride_sm, r2 * stride_sm, r3 * stride_sm
    whole = U // ROWS
    if PREFETCH > 0:
        nw, nf = _strip_trip(wj, fj, wcol, fcol, 0, lanes, U, GROUP, BITS, True, ROWS)
    if PREFETCH > 1:
        pw, pf = _strip_trip(wj, fj, wcol, fcol, tl.minimum(1, whole - 1) * ROWS, lanes, U, GROUP, BITS, True, ROWS)
    wait_prior(PDL)  # the weights above are never written by a step; the activations below are
    acc0 = tl.zeros((ROWS * STRIPS, 4), tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    if GROUP == ONE_GROUP:  # the factors of one group (per output), loaded once
        one = tl.load(fj + fcol) + (lanes * 0)[:, None]
    for c in tl.range(0, whole):
        if PREFETCH > 0:  # the last trips load their own rows again (from L1) rather than past them
            w, fac = nw, nf
            ahead = tl.minimum(c + PREFETCH, whole - 1) * ROWS
            if PREFETCH > 1:
                nw, nf = pw, pf
                pw, pf = _strip_trip(wj, fj, wcol, fcol, ahead, lanes, U, GROUP, BITS, True, ROWS)
            else:
                nw, nf = _strip_trip(wj, fj, wcol, fcol, ahead, lanes, U, GROUP, BITS, True, ROWS)
        else:
            w, fac = _strip_trip(wj, fj, wcol, fcol, c * ROWS, lanes, U, GROUP, BITS, True, ROWS)
        if GROUP == ONE_GROUP:
            fac = one
        acc0, acc1, acc2, acc3 = _trip_products(q_ptr, s_ptr, rq0, rq1, rq2, rq3, rs0, rs1, rs2, rs3, c * ROWS,
                                                lanes, U, w, fac, acc0, acc1, acc2, acc3, BITS, True, BLOCK_M, ASM)
    if TAIL:
        w, fac = _strip_trip(wj, fj, wcol, fcol, whole * ROWS, lanes, U, GROUP, BITS, False, ROWS)
        if GROUP == ONE_GROUP:
            fac = one
        acc0, acc1, acc2, acc3 = _trip_products(q_ptr, s_ptr, rq0, rq1, rq2, rq3, rs0, rs1, rs2, rs3, whole * ROWS,
                                                lanes, U, w, fac, acc0, acc1, acc2, acc3, BITS, False, BLOCK_M, ASM)
    offs_n = j * 4 * STRIPS + tl.arange(0, 4 * STRIPS)
    n_mask = offs_n < N
    extra = tl.zeros((4 * STRIPS,), tl.float32)
    if OUT_BIAS:
        extra = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    accs = (acc0, acc1, acc2, acc3)
    for r in tl.static_range(BLOCK_M):
        if STRIPS == 1:
            y = tl.sum(accs[r], axis=0) + extra
        else:  # each strip's rows summed: [STRIPS, 4], output 4 i + e of the program's strip i
            y = tl.reshape(tl.sum(tl.reshape(accs[r], (STRIPS, ROWS, 4)), axis=1), (4 * STRIPS,)) + extra
        live = n_mask & (offs_n * 0 + m0 + r < M)
        tl.store(y_ptr + (m0 + r).to(tl.int64) * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=live)


def takes(shape: tuple[int, int], bits: int, group: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a weight of this shape is held in strips and multiplied here: outputs in whole strips, K a multiple
    of 32, groups of whole blocks, 16-bit activations."""
    n, k = shape
    return dtype in (torch.float16, torch.bfloat16) and n % STRIP == 0 and n > 0 and k % 32 == 0 and k > 0 and (
        group >= k or group % 32 == 0)


def gemv_strip(x: torch.Tensor, words: torch.Tensor, factors: torch.Tensor, bits: int, group: int, *, bias=None,
               tile: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ W.T (+ bias) -> [M, N] in x.dtype, for a weight in strips (words [N / 4, K * bits
    / 32, 4], factors [N / 4, K / group, 4]: quant/kmajor.py), with x rounded by quantize_act. tile overrides
    DEFAULT_TILE's knobs."""
    out = torch.empty((x.shape[0], words.shape[0] * STRIP), dtype=x.dtype, device=x.device)
    q, s = quantize_act(x, bits)
    return gemv_strip_rounded(q, s, out, words, factors, bits, group, bias=bias, tile=tile)


def gemv_strip_rounded(q: torch.Tensor, s: torch.Tensor, out: torch.Tensor, words: torch.Tensor,
                       factors: torch.Tensor, bits: int, group: int, *, bias=None, tile: dict | None = None):
    """gemv_strip's product of activations already rounded (quantize_act's q, s), written to out [M, N]."""
    n, k = words.shape[0] * STRIP, words.shape[1] * 32 // bits
    m = out.shape[0]
    if m == 0 or n == 0:
        return out
    assert words.is_contiguous() and factors.is_contiguous() and words.shape[2] == factors.shape[2] == STRIP
    rows = min(MAX_BLOCK_M, 1 << (m - 1).bit_length())
    tile = {**tile_for(out.device, bits, n, k, m), **(tile or {})}
    lanes = 32 * tile["num_warps"] * tile["rows_a_lane"]
    strips = tile["strips"] if words.shape[0] % tile["strips"] == 0 else 1
    _gemv_strip_kernel[(-(-m // rows), words.shape[0] // strips)](
        q, s, out, words, factors, out if bias is None else bias, m, n, k, q.stride(0), s.stride(0), out.stride(0),
        words.stride(0), factors.stride(0), BITS=bits, GROUP=group if group < k else ONE_GROUP, ROWS=lanes,
        TAIL=words.shape[1] % lanes != 0, BLOCK_M=rows, OUT_BIAS=bias is not None, ASM=_asm(out.device),
        PREFETCH=int(tile["PREFETCH"]) if words.shape[1] >= lanes else 0,  # no whole trip: nothing to load ahead
        STRIPS=strips, num_warps=tile["num_warps"], num_stages=1, **launch_args(out))
    return out


# torch reference, same signature

def gemv_strip_ref(x: torch.Tensor, words: torch.Tensor, factors: torch.Tensor, bits: int, group: int, *, bias=None,
                   tile: dict | None = None) -> torch.Tensor:
    """gemv_strip in torch: the rounded activations times the dequantized weights, in float64."""
    w = (KStripInt4 if bits == 4 else KStripInt8)(words, factors).dequantize(torch.float64)
    y = rounded_act_ref(x) @ w.T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)
