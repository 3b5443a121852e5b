"""The batch-1 decode GEMV over K-major int4/int8 words (quant/kmajor.py), in Triton: y = x @ W.T.

Design (issue 32), each point checked on the compiled code by tests/kernels/test_gemv_kmajor.py:

- A program streams a [BLOCK_K inputs, BLOCK_N outputs] tile a trip as [G, WPG, BLOCK_N] words (G groups of WPG
  words); a thread loads 4 neighbouring outputs' words with one 16-byte load, and every weight byte is loaded
  once. A group's scale and bias come in one int32 (quant/kmajor.py), loaded once per group and trip.
- A thread's activation for a word row serves the 4 outputs it holds: each of a word's fields is turned into an
  exact float with one AND-OR (the field, left where it sits in its half-word, OR-ed into the mantissa of 2**23)
  and one subtraction, and multiplied by the activation pre-scaled by the field's power of two, so no shift per
  field. Partial sums stay elementwise per thread across trips and are reduced once, at the end.
- Split-K inside the one launch: program (n, s) covers the s-th of SPLIT_K even slices of K; each writes its
  partial outputs (and, with NORM, its slice's sum of squares) to a workspace, counts itself done on the column
  tile's counter, and the last to finish sums the partials, applies the epilogue (RMSNorm factor, bias), writes y
  and resets the counter for the next launch: no torch op before or after it. split_for() sizes SPLIT_K so that
  every decode shape launches at least 4 programs per SM.
- Prologues as quant_matmul's GEMV: NORM (RMSNorm of x + residual, the factor applied once per output at the end,
  each split summing only its own slice's squares) and GATED (act(gate) * up over the program's own K slice).

Up to 4 rows (M > 1: a batch of decodes, or a speculative step's drafted tokens) share a program: each trip's
words are loaded and their fields decoded once for all of them, each row with an accumulator of its own (at 4
rows 25 SASS instructions a word and row on sm_90, against 45.6 for a row alone); more rows take more programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localpd.kernels.fused import gate_act

INT8_XOR = tl.constexpr(-2139062144)  # 0x80808080: flips each byte's sign bit, so a byte reads q + 128


@triton.jit
def _field(lo, hi, F: tl.constexpr, BITS: tl.constexpr):
    """Field F of each word as the exact float v * 2**p, p its bit position in its half-word: lo and hi are the
    word's low and high halves with the exponent of 2**23 (0x4B000000) OR-ed in above them, so one AND with a constant
    that keeps the field and the exponent gives 2**23 + v * 2**p (one immediate operand, where AND then OR took a
    second constant the compiler kept re-materialising)."""
    if F * BITS + BITS <= 16:
        bits = lo & ((((1 << BITS) - 1) << (F * BITS)) | 0x4B000000)
    else:
        bits = hi & ((((1 << BITS) - 1) << (F * BITS - 16)) | 0x4B000000)
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _prescale(F: tl.constexpr, BITS: tl.constexpr):
    """2**-p for _field's p."""
    if F * BITS + BITS <= 16:
        return 1.0 / (1 << (F * BITS))
    else:
        return 1.0 / (1 << (F * BITS - 16))


@triton.jit
def _activation(x_ptr, r_ptr, g_ptr, sum_ptr, row_x, row_r, row_s, k, kmask, K, store_sum,
                NORM: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr):
    """The activation the weights meet at inputs k of one row, in fp32, rounded as the unfused kernels round
    it: act(gate) * up (GATED), x + r written out as the new residual (NORM with HAS_RES, by the programs that
    store_sum) and, with NORM, (s, s * g) (the factor rsqrt(mean(s^2) + eps) is applied at the end)."""
    xs = tl.load(x_ptr + row_x + k, mask=kmask)
    if GATED != "":
        up = tl.load(x_ptr + row_x + K + k, mask=kmask)
        act = gate_act(xs.to(tl.float32), GATED).to(up.dtype).to(tl.float32)
        xs = (act * up.to(tl.float32)).to(up.dtype)
    if NORM:
        if HAS_RES:
            xs = (xs.to(tl.float32) + tl.load(r_ptr + row_r + k, mask=kmask).to(tl.float32)).to(xs.dtype)
            if store_sum:
                tl.store(sum_ptr + row_s + k, xs, mask=kmask)
        sf = xs.to(tl.float32)
        return sf, sf * tl.load(g_ptr + k, mask=kmask).to(tl.float32)
    sf = xs.to(tl.float32)
    return sf, sf


@triton.jit
def _row_trip(x_ptr, r_ptr, g_ptr, sum_ptr, row_x, row_r, row_s, wk, lo, hi, scale, bias, K, store_sum,
              FIELDS: tl.constexpr, BITS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
              GATED: tl.constexpr):
    """One row's share of a trip: its activations at the trip's inputs times every field of the words (lo, hi:
    _field's halves), with the group factors applied; (the increment of the row's [G, WPG, BLOCK_N] accumulator,
    the squares of its activation over the trip's inputs for NORM)."""
    part = tl.zeros(lo.shape, tl.float32)
    xsum = tl.zeros(wk.shape, tl.float32)
    sq = tl.zeros(wk.shape, tl.float32)
    for f in tl.static_range(FIELDS):
        sf, xs = _activation(x_ptr, r_ptr, g_ptr, sum_ptr, row_x, row_r, row_s, wk * FIELDS + f, None, K, store_sum,
                             NORM, HAS_RES, GATED)
        if NORM:
            sq += sf * sf
        xsum += xs
        part += _field(lo, hi, f, BITS) * (xs * _prescale(f, BITS))[:, :, None]
    if BITS == 8:
        return (part - 128.0 * xsum[:, :, None]) * scale, sq
    return part * scale + xsum[:, :, None] * bias, sq


@triton.jit
def _gemv_kmajor_kernel(x_ptr, y_ptr, w_ptr, f_ptr, M, N, K, stride_xm, stride_ym, stride_wk, stride_fg,
                        ws_ptr, cnt_ptr, SPLIT_K, r_ptr, g_ptr, sum_ptr, stride_rm, stride_sm, eps, bias_ptr,
                        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GATED: tl.constexpr = "", NORM: tl.constexpr = False, HAS_RES: tl.constexpr = False,
                        OUT_BIAS: tl.constexpr = False, PREFETCH: tl.constexpr = False, BLOCK_M: tl.constexpr = 1):
    """Program (m, n, s): rows [m * BLOCK_M, (m + 1) * BLOCK_M) (1, 2 or 4; the fused input steps with 1 only),
    outputs [n * BLOCK_N, (n + 1) * BLOCK_N), the s-th slice of K (module doc). The rows share each trip's words
    and their fields, each with an accumulator of its own (a [rows, ...] tile compiled to layout changes, with
    barriers, every trip). ws_ptr: fp32 workspace of at least rows * SPLIT_K * N + row blocks * column tiles *
    SPLIT_K values (rows padded to BLOCK_M); cnt_ptr: int32 counters, one per (row block, column tile), zero between
    launches. GROUP: inputs per group (any multiple or divisor of BLOCK_K; a per-channel int8 weight passes a value
    no tile reaches past)."""
    FIELDS: tl.constexpr = 32 // BITS
    G: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP  # groups in a tile (1 when a group spans several tiles)
    WPG: tl.constexpr = BLOCK_K // FIELDS // G  # words of one group in a tile
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m0 = pid_m * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    word = tl.arange(0, G)[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [G, WPG]
    chunks = K // BLOCK_K  # K is a multiple of BLOCK_K (the launcher picks BLOCK_K so)
    c0 = pid_k * chunks // SPLIT_K
    c1 = (pid_k + 1) * chunks // SPLIT_K
    # a row past M (the last block's padding) reads row M - 1 again and writes nothing
    rx0 = m0.to(tl.int64) * stride_xm
    rx1 = tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_xm
    rx2 = tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_xm
    rx3 = tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_xm
    row_r = m0.to(tl.int64) * stride_rm
    row_s = m0.to(tl.int64) * stride_sm
    store_sum = pid_n == 0
    acc0 = tl.zeros((G, WPG, BLOCK_N), tl.float32)
    acc1 = tl.zeros((G, WPG, BLOCK_N), tl.float32)
    acc2 = tl.zeros((G, WPG, BLOCK_N), tl.float32)
    acc3 = tl.zeros((G, WPG, BLOCK_N), tl.float32)
    sq = tl.zeros((G, WPG), tl.float32)  # NORM: squares of the activation over this slice
    w_ptrs = w_ptr + word[:, :, None] * stride_wk + offs_n[None, None, :]
    step = (BLOCK_K // FIELDS) * stride_wk
    if PREFETCH:  # the next trip's words are loaded before this trip's arithmetic: twice the bytes in flight
        w_next = tl.load(w_ptrs + c0 * step, mask=n_mask[None, None, :], other=0)  # every slice has a chunk
    for c in range(c0, c1):
        wk = c * (BLOCK_K // FIELDS) + word  # [G, WPG] word rows
        if PREFETCH:
            w = w_next
            # the last trip loads its own words again (from L1) rather than past the slice
            w_next = tl.load(w_ptrs + tl.minimum(c + 1, c1 - 1) * step, mask=n_mask[None, None, :], other=0)
        else:
            w = tl.load(w_ptrs + c * step, mask=n_mask[None, None, :], other=0)
        if BITS == 8:
            w = w ^ INT8_XOR
        lo = (w & 0xFFFF) | 0x4B000000  # 2**23's exponent above each half-word (_field)
        hi = ((w >> 16) & 0xFFFF) | 0x4B000000
        gk = (c * BLOCK_K) // GROUP + tl.arange(0, G)
        # loaded for every word row of the group (the same 16 bytes again, from L1): a [G, 1, BLOCK_N] load is
        # one value a thread, in another layout than the words', and moving it costs barriers every trip
        fac = tl.load(f_ptr + gk[:, None, None] * stride_fg + (word * 0)[:, :, None] + offs_n[None, None, :],
                      mask=n_mask[None, None, :], other=0)
        scale = (fac & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        bias = (fac >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        inc, trip_sq = _row_trip(x_ptr, r_ptr, g_ptr, sum_ptr, rx0, row_r, row_s, wk, lo, hi, scale, bias, K,
                                 store_sum, FIELDS, BITS, NORM, HAS_RES, GATED)
        acc0 += inc
        if NORM:
            sq += trip_sq
        if BLOCK_M > 1:
            acc1 += _row_trip(x_ptr, r_ptr, g_ptr, sum_ptr, rx1, row_r, row_s, wk, lo, hi, scale, bias, K, store_sum,
                              FIELDS, BITS, False, False, "")[0]
        if BLOCK_M > 2:
            acc2 += _row_trip(x_ptr, r_ptr, g_ptr, sum_ptr, rx2, row_r, row_s, wk, lo, hi, scale, bias, K, store_sum,
                              FIELDS, BITS, False, False, "")[0]
            acc3 += _row_trip(x_ptr, r_ptr, g_ptr, sum_ptr, rx3, row_r, row_s, wk, lo, hi, scale, bias, K, store_sum,
                              FIELDS, BITS, False, False, "")[0]
    y0, y1 = tl.sum(tl.sum(acc0, axis=1), axis=0), tl.sum(tl.sum(acc1, axis=1), axis=0)  # [BLOCK_N] each
    y2, y3 = tl.sum(tl.sum(acc2, axis=1), axis=0), tl.sum(tl.sum(acc3, axis=1), axis=0)
    row_sq = tl.sum(tl.sum(sq, axis=1), axis=0)
    _finish_rows(y0, y1, y2, y3, row_sq, y_ptr, bias_ptr, ws_ptr, cnt_ptr, SPLIT_K, M, N, K, m0, offs_n, n_mask,
                 stride_ym, eps, BLOCK_M, NORM, OUT_BIAS)


@triton.jit
def _finish_rows(y0, y1, y2, y3, row_sq, y_ptr, bias_ptr, ws_ptr, cnt_ptr, SPLIT_K, M, N, K, m0, offs_n, n_mask,
                 stride_ym, eps, BLOCK_M: tl.constexpr, NORM: tl.constexpr, OUT_BIAS: tl.constexpr):
    """A program's partial outputs y0..y3 (rows m0..m0 + BLOCK_M - 1, [BLOCK_N] each) to y: directly with one slice
    of K; else to the workspace, the last program of the column tile (counted on its counter) summing the slices,
    applying the epilogue and resetting the counter for the next launch (module doc)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ys = (y0, y1, y2, y3)
    if SPLIT_K > 1:  # partials to the workspace; the last program of this column tile reduces them
        block = pid_m * tl.num_programs(1) + pid_n
        part_ptr = ws_ptr + (m0.to(tl.int64) * SPLIT_K + pid_k) * N + offs_n  # row m0 + r at + r * SPLIT_K * N
        sq_ptr = ws_ptr + tl.num_programs(0).to(tl.int64) * BLOCK_M * SPLIT_K * N + block * SPLIT_K
        for r in tl.static_range(BLOCK_M):
            tl.store(part_ptr + r * SPLIT_K * N, ys[r], mask=n_mask)
        if NORM:
            tl.store(sq_ptr + pid_k, row_sq)
        tl.debug_barrier()  # every thread's partials are written before the count says so
        done = tl.atomic_add(cnt_ptr + block, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            total_sq = 0.0
            if NORM:
                for s in range(0, SPLIT_K):
                    total_sq += tl.load(sq_ptr + s, cache_modifier=".cg")
            for r in tl.static_range(BLOCK_M):
                y = tl.zeros((offs_n.shape[0],), tl.float32)
                for s in range(0, SPLIT_K):
                    y += tl.load(part_ptr + (r * SPLIT_K + s - pid_k) * N, mask=n_mask, other=0.0,
                                 cache_modifier=".cg")
                live = n_mask & (offs_n * 0 + m0 + r < M)
                _epilogue(y, total_sq, y_ptr, bias_ptr, m0 + r, offs_n, live, stride_ym, K, eps, NORM, OUT_BIAS)
            tl.atomic_xchg(cnt_ptr + block, 0, sem="relaxed", scope="gpu")
    else:
        for r in tl.static_range(BLOCK_M):
            live = n_mask & (offs_n * 0 + m0 + r < M)
            _epilogue(ys[r], row_sq, y_ptr, bias_ptr, m0 + r, offs_n, live, stride_ym, K, eps, NORM, OUT_BIAS)


@triton.jit
def _epilogue(y, row_sq, y_ptr, bias_ptr, row, offs_n, mask, stride_ym, K, eps, NORM: tl.constexpr,
              OUT_BIAS: tl.constexpr):
    if NORM:
        y = y * (1.0 / tl.sqrt(row_sq / K + eps))
    if OUT_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kmajor_kernel(w_ptr, f_ptr, out_ptr, N, K, stride_wk, stride_fg, stride_ok, stride_ws, stride_fs,
                           BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           STRIPS: tl.constexpr = False):
    """W.T's rows [K, N] in out's dtype for the prefill GEMM: program (k tile, n tile) writes [BLOCK_K, BLOCK_N].
    STRIPS: the words and factors in strips of 4 outputs (quant/kmajor.py), strip j at j * stride_ws (j *
    stride_fs), a strip's rows stride_wk (stride_fg) apart."""
    FIELDS: tl.constexpr = 32 // BITS
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (k < K)[:, None] & (n < N)[None, :]
    wn, fn = n, n
    if STRIPS:
        wn, fn = (n // 4) * stride_ws + n % 4, (n // 4) * stride_fs + n % 4
    w = tl.load(w_ptr + (k // FIELDS)[:, None] * stride_wk + wn[None, :], mask=mask, other=0)
    v = (w >> ((k % FIELDS) * BITS)[:, None]) & ((1 << BITS) - 1)
    if BITS == 8:
        v = v - 256 * (v >= 128)  # two's complement byte
    fac = tl.load(f_ptr + (k // GROUP)[:, None] * stride_fg + fn[None, :], mask=mask, other=0)
    scale = (fac & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    out = v.to(tl.float32) * scale
    if BITS == 4:
        out += (fac >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    tl.store(out_ptr + k[:, None] * stride_ok + n[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


BLOCK_N = 128  # outputs a program covers: 32 threads x 4 outputs (one 16-byte load of words)
NUM_WARPS = 4  # stacked along K: each thread holds BLOCK_K * BITS / 32 / 4 word rows of its 4 outputs
MAX_ROWS = 8  # activation rows the GEMV takes; more go through dequantize + cuBLAS (prefill, large batches)
MAX_BLOCK_M = 4  # rows a program takes, sharing each trip's words and fields (each with its own accumulator)
PROGRAMS_PER_SM = 4  # the fewest programs a launch should have per SM (bytes in flight: issue 32)
DEQUANT_ROWS = 1 << 25  # weights dequantized at a time on the GEMM path
# the launch's knobs (gemv_kmajor's tile): BLOCK_K 0 picks block_k(); scripts/sweep_kmajor.py times the others
# (measured on an H200, 2026-11-26, docs/PERF.md: the next trip's words ahead and 8 programs an SM were faster on
# the large matrices, by up to 20% on down)
DEFAULT_TILE = dict(BLOCK_K=64, num_warps=NUM_WARPS, PREFETCH=True, per_sm=8)
# The model runs the RMSNorm and SiLU * up in kernels of their own before this GEMV: fused, every program (a thread
# for every 4 outputs) redoes the input step, which cost more than the launch it saves (H200: gate_up with the norm
# 59 us against 43 plain, down with SiLU 39 against 26, the head 208 against 158). The fused forms stay tested.
FUSE_INPUT_STEP = False


def block_k(k: int, bits: int, group: int) -> int:
    """Inputs a trip covers: the largest of 128, 64, 32 that divides K, holds at least one word row per warp
    (NUM_WARPS rows of words), and nests with the group (a multiple or a divisor of it)."""
    for bk in (128, 64, 32):
        if k % bk == 0 and bk * bits // 32 >= NUM_WARPS and (bk % group == 0 or group % bk == 0):
            return bk
    raise ValueError(f"no K-major GEMV tile for K = {k}, group {group}")


def launch_block_k(k: int, bits: int, group: int, asked: int) -> int:
    """The tile's BLOCK_K where it divides K and nests with the group, else block_k's choice."""
    g = min(group, k)
    if asked and k % asked == 0 and (asked % g == 0 or g % asked == 0):
        return asked
    return block_k(k, bits, g)


def takes(shape: tuple[int, int], bits: int, group: int) -> bool:
    """Whether this GEMV has a tile for a weight of this shape (K a multiple of 32 that nests with the group)."""
    try:
        block_k(shape[1], bits, min(group, shape[1]))
    except ValueError:
        return False
    return True


def split_for(m: int, n: int, k: int, bk: int, sms: int, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Slices of K per column tile so that a launch has at least PROGRAMS_PER_SM programs per SM (every SM
    streams weights with several programs' loads in flight), at most one slice per BLOCK_K chunk."""
    tiles = m * -(-n // BLOCK_N)
    return max(1, min(k // bk, -(-per_sm * sms // tiles)))


_workspaces: dict = {}
_retired: list = []  # workspaces a larger one replaced: graphs captured with them still point at them


def workspace(device: torch.device, values: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K partials' fp32 workspace and the zeroed tile counters, kept per device (launches on one stream
    run in turn, and each leaves its counters at zero). Sized at first use for any launch up to MAX_ROWS rows
    (split_for keeps a launch's partials near PROGRAMS_PER_SM * SMs * BLOCK_N values); a larger need replaces
    them, and the old ones are kept, since a captured CUDA graph may still use them."""
    ws, cnt = _workspaces.get(device, (None, None))
    if ws is None or ws.numel() < values or cnt.numel() < counters:
        if ws is not None:
            _retired.append((ws, cnt))
        ws = torch.empty(max(values, 1 << 20), dtype=torch.float32, device=device)
        cnt = torch.zeros(max(counters, 1 << 16), dtype=torch.int32, device=device)
        _workspaces[device] = ws, cnt
    return ws, cnt


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few slices, so tests reach the split-K reduction


def gemv_kmajor(x: torch.Tensor, words: torch.Tensor, factors: torch.Tensor, bits: int, group: int, *,
                bias=None, gated: str | None = None, norm=None, split_k: int | None = None, tile: dict | None = None):
    """x [M, K] (M <= MAX_ROWS; [M, 2K] = [gate | up] when gated) @ W.T (+ bias) -> [M, N] in x.dtype, for
    K-major words [K * bits / 32, N] and factors [K / group, N]; with norm (a dispatch.PreNorm) the product is
    RMSNorm(x + residual) @ W.T and (y, x + residual) is returned. split_k overrides split_for (tests); tile
    overrides the launch (BLOCK_K, num_warps, PREFETCH, per_sm: programs an SM; scripts/sweep_kmajor.py)."""
    n, k = words.shape[1], words.shape[0] * 32 // bits
    m = x.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res = None if norm is None else norm.residual
    if res is None:
        res = summed = x
    else:
        res = res if res.stride(-1) == 1 else res.contiguous()
        summed = torch.empty_like(x)
    done = out if norm is None else (out, summed)
    if m == 0 or n == 0:
        return done
    kernel_group = group if group < k else 1 << 30  # per channel: a group no tile reaches past
    tile = {**DEFAULT_TILE, **(tile or {})}
    bk = launch_block_k(k, bits, group, tile["BLOCK_K"])
    tiles = -(-n // BLOCK_N)
    rows = 1 if gated or norm is not None else min(MAX_BLOCK_M, 1 << (m - 1).bit_length())  # a program's rows
    blocks = -(-m // rows)
    split = split_k or split_for(blocks, n, k, bk, sm_count(x.device), tile["per_sm"])
    split = max(1, min(split, k // bk))
    ws, cnt = workspace(x.device, blocks * rows * split * n + blocks * tiles * split, blocks * tiles)
    gamma, eps = (x, 0.0) if norm is None else (norm.weight, norm.eps)
    _gemv_kmajor_kernel[(blocks, tiles, split)](
        x, out, words, factors, m, n, k, x.stride(0), out.stride(0), words.stride(0), factors.stride(0), ws, cnt, split,
        res, gamma, summed, res.stride(0), summed.stride(0), eps, x if bias is None else bias,
        BITS=bits, GROUP=kernel_group, BLOCK_N=BLOCK_N, BLOCK_K=bk, GATED=gated or "", NORM=norm is not None,
        HAS_RES=res is not x, OUT_BIAS=bias is not None, PREFETCH=tile["PREFETCH"], BLOCK_M=rows,
        num_warps=tile["num_warps"], num_stages=1)
    return done


def dequant_matmul_kmajor(x: torch.Tensor, words: torch.Tensor, factors: torch.Tensor, bits: int, group: int,
                          bias=None, strips: bool = False) -> torch.Tensor:
    """x @ W.T (+ bias) by dequantizing W.T in chunks of inputs and cuBLAS (prefill: compute-bound); strips: the
    words [N / 4, K * bits / 32, 4] and factors [N / 4, K / group, 4] of a weight in strips (quant/kmajor.py)."""
    if strips:  # a chunk of inputs is a range of each strip's rows
        n, k = words.shape[0] * 4, words.shape[1] * 32 // bits
        rows_of = lambda t, a: t[:, a:]  # noqa: E731
        strides = (words.stride(1), factors.stride(1), words.stride(0), factors.stride(0))
    else:
        n, k = words.shape[1], words.shape[0] * 32 // bits
        rows_of = lambda t, a: t[a:]  # noqa: E731
        strides = (words.stride(0), factors.stride(0), 0, 0)
    kernel_group = group if group < k else 1 << 30
    rows = max(128, DEQUANT_ROWS // max(n, 1) // 128 * 128)  # a multiple of every group and word
    wt = torch.empty((min(rows, k), n), dtype=x.dtype, device=x.device)
    out = torch.zeros((x.shape[0], n), dtype=torch.float32, device=x.device) if rows < k else None
    for a in range(0, k, rows):
        b = min(k, a + rows)
        fields = 32 // bits
        grid = (triton.cdiv(b - a, 64), triton.cdiv(n, 64))
        gk0 = a // group if group < k else 0
        _dequant_kmajor_kernel[grid](rows_of(words, a // fields), rows_of(factors, gk0), wt, n, b - a, strides[0],
                                     strides[1], wt.stride(0), strides[2], strides[3], BITS=bits, GROUP=kernel_group,
                                     BLOCK_N=64, BLOCK_K=64, STRIPS=strips)
        if out is None:  # one chunk: cuBLAS writes x's dtype
            y = x @ wt
            return y if bias is None else y.add_(bias)
        out += (x[:, a:b] @ wt[:b - a]).float()
    return (out if bias is None else out + bias.float()).to(x.dtype)
