"""y = x @ W.T for weight-only quantized W (int4 group-wise with scale and bias, int8 with scales), in Triton.

Both formats are read as int32 words: int4 packs 8 columns a word (column 8j + s in bits 4s..4s+3), int8 4
columns (its int8 matrix viewed as int32). Two launch paths (quant_matmul picks by M):

- GEMV (M <= 8 by default, up to 16 when asked; decode): each program streams a [BLOCK_N, BLOCK_K] weight tile
  as [BLOCK_N, G, WPG] words (G groups of WPG words), turns every field into an exact float with one AND and
  one float subtract (the field, left where it sits in its half-word, OR-ed into the mantissa of 2**23; the
  activation is pre-scaled by the field's power of two instead of shifting the weight), multiplies it by all M
  activation rows, and applies scale and bias once per group: y = sum_g scale_g * (q . x)_g + bias_g * sum(x)_g.
  Optional split-K (atomic fp32 adds). Gated: the input is an MLP's [gate | up] and the GEMV multiplies
  silu(gate) * up, computed as it loads it, so the down projection needs no activation kernel before it. Norm:
  the GEMV adds the residual to its input, multiplies the sum by the RMSNorm weight and scales its output by the
  row's rsqrt(mean square + eps), and writes the sum out as the new residual stream (no norm kernel before it).
- GEMM (larger M, prefill): a dequantize kernel writes bf16/fp16/fp32 weight rows (in chunks of at most 32M
  values) and cuBLAS multiplies; prefill is compute-bound, so the extra weight traffic costs little.

On a GPU the model holds its int4/int8 matrices K-major (quant/kmajor.py) and runs kernels/gemv_kmajor.py's GEMV;
these row-major kernels serve the weights handed to them directly (tests, benchmarks, `localpd bench kernels`).
"""

from __future__ import annotations

import inspect
import math

import torch
import triton
import triton.language as tl

from localpd.kernels.dispatch import (GEMV_CONFIGS, GEMV_MAX_M, INTERPRET_GEMV, PreNorm, cdiv, gemv_block_m,
                                     gemv_tile_fits, pick_split_k, sm_count, triton_interpreting, tuned_gemv)
from localpd.errors import LocalpdError
from localpd.kernels.fused import gate_act
from localpd.kernels.fused_dispatch import GATE_ACTS, act_mul, add_rms_norm

INT8_XOR = tl.constexpr(-2139062144)  # 0x80808080 as int32: flips each byte's sign bit, so a byte reads q + 128
DEQUANT_CHUNK = 1 << 25  # weights dequantized at a time on the GEMM path
GEMV_AUTO_M = 8  # above this the GEMV's per-row work outweighs dequantizing once for cuBLAS (H100, 2026-11-23)


@triton.jit
def _field(w, hi, F: tl.constexpr, BITS: tl.constexpr):
    """Field F of each word as an exact float v * 2**p, p its bit position in w (fields in the low half) or in
    hi = the word's high half (the rest): a field must stay inside the 23 mantissa bits."""
    if F * BITS + BITS <= 16:
        bits = w & (((1 << BITS) - 1) << (F * BITS))
    else:
        bits = hi & (((1 << BITS) - 1) << (F * BITS - 16))
    return (bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _field_scaled(x, F: tl.constexpr, BITS: tl.constexpr):
    """x * 2**-p for _field's p (exact), so that _field(...) * _field_scaled(x, ...) = v * x."""
    if F * BITS + BITS <= 16:
        y = x * (1.0 / (1 << (F * BITS)))
    else:
        y = x * (1.0 / (1 << (F * BITS - 16)))
    return y


@triton.jit
def _residual_sum(x_ptr, r_ptr, x_rows, r_rows, cols, mask, HAS_RES: tl.constexpr):
    """x (+ r) at the given row offsets and columns, the sum rounded to x's dtype (0 where masked)."""
    s = tl.load(x_ptr + x_rows + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + r_rows + cols, mask=mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
    return s


@triton.jit
def _split_chunks(K, BLOCK_K: tl.constexpr, SPLIT_K, pid_k):
    """The K chunks [c0, c1) of split pid_k: ceil(chunks / SPLIT_K) each, the last ones shorter or empty."""
    chunks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(chunks, SPLIT_K)
    c0 = pid_k * per_split
    return c0, tl.minimum(chunks, c0 + per_split)


@triton.jit
def _gemv_kernel(x_ptr, y_ptr, M, N, K, stride_xm, stride_ym, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn, K_GROUPS,
                 SPLIT_K, r_ptr, g_ptr, sum_ptr, stride_rm, stride_summ, eps, out_bias_ptr, BITS: tl.constexpr,
                 GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, GATED: tl.constexpr = "", NORM: tl.constexpr = False,
                 HAS_RES: tl.constexpr = False, OUT_BIAS: tl.constexpr = False, WORD_ALIGN: tl.constexpr = 1):
    """GATED ("silu" or "gelu_tanh"; "" for none): x rows are [gate | up] (2K wide) and the activation is
    act(gate) * up, computed as it is loaded and rounded to x's dtype exactly as act_mul_kernel writes it (the down
    projection without its own kernel).

    NORM: the activation is RMSNorm(s) * g for s = x + r (HAS_RES; s = x otherwise), the sum rounded to x's dtype
    as add_rms_norm_kernel rounds it. The tile multiplies s * g, and y is scaled by rsqrt(mean(s^2) + eps) at the
    end (the product is linear in the activation), so the sum of squares comes from the same loads; under split-K
    a split sees only part of the row, so it first sums the squares over the whole row. The programs of the first
    column tile write s to sum_ptr (the new residual stream), each its own K chunks.

    OUT_BIAS: the layer's bias (out_bias_ptr, [N]) is added to y (by the first split under split-K); HAS_BIAS is
    the int4 format's per-group offsets. WORD_ALIGN: a power of two dividing the words per row (K * BITS / 32),
    which lets the compiler load 16-byte runs of words (Triton only knows that K is a multiple of 16).

    The weight tile is loaded as [1, BLOCK_N, G, WPG], in the layout the products are computed in: loaded as
    [BLOCK_N, G, WPG] and broadcast over the rows afterwards, every field went through shared memory to change
    layout (18 to 72 barriers per loop trip at M = 1 in the sm_90 code; scripts/gemv_sass.py counts them)."""
    FIELDS: tl.constexpr = 32 // BITS
    G: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP  # groups in a tile (1 when a group spans several tiles)
    WPG: tl.constexpr = BLOCK_K // FIELDS // G  # words of one group in a tile
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    word = tl.arange(0, G)[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [G, WPG]
    kw = tl.multiple_of(K // FIELDS, WORD_ALIGN)
    stride_wn = tl.multiple_of(stride_wn, WORD_ALIGN)
    c0, c1 = _split_chunks(K, BLOCK_K, SPLIT_K, pid_k)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    sq = tl.zeros((BLOCK_M, G, WPG), tl.float32)  # NORM: squares of s (the row's, summed as it is loaded)
    row_sq = tl.zeros((BLOCK_M,), tl.float32)  # NORM under split-K: the whole row's, summed first
    if NORM and ATOMIC:
        for c in range(0, tl.cdiv(K, BLOCK_K)):
            kk = c * BLOCK_K + tl.arange(0, BLOCK_K)
            mask = (offs_m < M)[:, None] & (kk < K)[None, :]
            sf = _residual_sum(x_ptr, r_ptr, offs_m[:, None] * stride_xm, offs_m[:, None] * stride_rm, kk[None, :],
                               mask, HAS_RES).to(tl.float32)
            row_sq += tl.sum(sf * sf, axis=1)
    for c in range(c0, c1):
        wk = c * (BLOCK_K // FIELDS) + word  # [G, WPG] word columns
        w = tl.load(w_ptr + offs_n[None, :, None, None] * stride_wn + wk[None, None],
                    mask=n_mask[None, :, None, None] & (wk < kw)[None, None], other=0)  # [1, BLOCK_N, G, WPG]
        if BITS == 8:
            w = w ^ INT8_XOR
        hi = (w >> 16) & 0xFFFF
        gk = (c * BLOCK_K) // GROUP + tl.arange(0, G)
        s_off = offs_n[:, None] * stride_sn + gk[None, :]
        s_mask = n_mask[:, None] & (gk < K_GROUPS)[None, :]
        xrow = x_ptr + offs_m[:, None, None] * stride_xm
        x_mask = (offs_m < M)[:, None, None] & (wk < kw)[None]
        part = tl.zeros((BLOCK_M, BLOCK_N, G, WPG), tl.float32)
        xsum = tl.zeros((BLOCK_M, G, WPG), tl.float32)
        for f in tl.static_range(FIELDS):
            kf = (wk * FIELDS + f)[None]  # [1, G, WPG] columns of field f
            if NORM:
                xs = _residual_sum(x_ptr, r_ptr, offs_m[:, None, None] * stride_xm, offs_m[:, None, None] * stride_rm,
                                   kf, x_mask, HAS_RES)
                if HAS_RES and pid_n == 0:
                    tl.store(sum_ptr + offs_m[:, None, None] * stride_summ + kf, xs, mask=x_mask)
                xs = xs.to(tl.float32)
                if not ATOMIC:
                    sq += xs * xs
                xs = xs * tl.load(g_ptr + kf, mask=(wk < kw)[None], other=0.0).to(tl.float32)
            else:
                xs = tl.load(xrow + kf, mask=x_mask, other=0.0)
            if GATED != "":
                up = tl.load(xrow + K + kf, mask=x_mask, other=0.0)
                act = gate_act(xs.to(tl.float32), GATED).to(up.dtype).to(tl.float32)
                xs = (act * up.to(tl.float32)).to(up.dtype)
            xs = xs.to(tl.float32)
            xsum += xs
            part += _field(w, hi, f, BITS) * _field_scaled(xs, f, BITS)[:, None]
        dot = tl.sum(part, axis=3)  # [BLOCK_M, BLOCK_N, G]
        xg = tl.sum(xsum, axis=2)  # [BLOCK_M, G]
        if BITS == 8:
            dot = dot - 128.0 * xg[:, None, :]
        t = dot * tl.load(s_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)[None]
        if HAS_BIAS:
            t += tl.load(b_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)[None] * xg[:, None, :]
        acc += tl.sum(t, axis=2)
    if NORM:
        if not ATOMIC:
            row_sq = tl.sum(tl.sum(sq, axis=2), axis=1)
        acc *= (1.0 / tl.sqrt(row_sq / K + eps))[:, None]
    if OUT_BIAS:
        bias = tl.load(out_bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = (offs_m[:, None] < M) & n_mask[None, :]
    if ATOMIC:  # split-K: partial sums into a zeroed fp32 buffer
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, b_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on, BITS: tl.constexpr,
                    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows of W in out's dtype: program (n tile, k tile) writes [BLOCK_N, BLOCK_K] values contiguously (each
    word and scale is read once per field it holds, from L1)."""
    FIELDS: tl.constexpr = 32 // BITS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (col < K)[None, :]
    w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (col // FIELDS)[None, :], mask=mask, other=0)
    v = ((w >> ((col % FIELDS) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    if BITS == 8:
        v = v - 256.0 * (v >= 128.0)  # two's complement byte
    s_off = offs_n[:, None] * stride_sn + (col // GROUP)[None, :]
    v = v * tl.load(s_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(b_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n[:, None] * stride_on + col[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


def _prune(configs, named_args, **kwargs):
    """Drop GEMV tiles whose per-row partial sums would not fit in registers for this many rows."""
    bm = kwargs.get("BLOCK_M", named_args.get("BLOCK_M", 1))
    bits = kwargs.get("BITS", named_args.get("BITS", 4))
    keep = [c for c in configs if gemv_tile_fits(bm, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], bits, c.num_warps)]
    return keep or configs[:1]


def _gemv_launcher():
    """The autotuned GEMV. Its timings are kept on disk (Triton's cache, keyed by the card's architecture, the
    kernel's source, the shape key and the candidates), so only the first process on a machine times the
    candidates: without that every `localpd chat` start, and every new batch size a server reaches, spent about
    0.1 s per candidate and shape timing them again, mid-stream for the server. Triton before 3.2 cannot keep
    them (no cache_results)."""
    if triton_interpreting():
        return _gemv_kernel
    keep = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    return triton.autotune(
        configs=[triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=s)
                 for bn, bk, w, s in GEMV_CONFIGS],
        key=["N", "K", "GROUP", "BITS", "BLOCK_M", "SPLIT_K", "GATED", "NORM"], reset_to_zero=["y_ptr"],
        prune_configs_by={"early_config_prune": _prune}, **keep)(_gemv_kernel)


_GEMV = _gemv_launcher()


def quant_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None, bits: int,
                 group: int, *, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 split_k: int | None = None, path: str | None = None, gated: str | None = None,
                 norm: PreNorm | None = None):
    """x [M, K] @ W.T (+ bias [N]) -> [M, N] in x.dtype; W given as int32 words [N, K * bits / 32], scales (and
    int4 biases) [N, K / group]. gated ("silu" or "gelu_tanh"): x is [M, 2K] = [gate | up] and the product is
    act(gate) * up @ W.T (an MLP's down projection; the GEMV computes the activation as it loads it). norm: the
    product is RMSNorm(x + residual) @ W.T and the result is (y, x + residual) (the GEMV normalises as it loads;
    see PreNorm). `out`, `split_k` and `path` ("gemv"/"gemm") override the defaults, for tests and benchmarks."""
    n, k = words.shape[0], words.shape[1] * 32 // bits
    width = 2 * k if gated else k
    if x.dim() != 2 or x.shape[1] != width:
        raise LocalpdError(f"expected activations of shape [M, {width}], got {tuple(x.shape)}")
    if gated and norm is not None:
        raise LocalpdError("a matmul takes either a gated or a normalised input, not both")
    if gated is not None and gated not in GATE_ACTS:
        raise LocalpdError(f"unknown MLP activation {gated!r}; localpd knows {', '.join(GATE_ACTS)}")
    res = None if norm is None else norm.residual
    if norm is not None and ((res is not None and (res.shape != x.shape or res.dtype != x.dtype))
                             or norm.weight.shape != (k,)):
        raise LocalpdError(f"the residual must be a [{x.shape[0]}, {k}] {x.dtype} tensor and the norm weight [{k}]")
    if bias is not None and bias.shape != (n,):
        raise LocalpdError(f"the bias must have {n} values, got {tuple(bias.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    path = path or ("gemv" if m <= GEMV_AUTO_M or split_k is not None else "gemm")
    if path not in ("gemv", "gemm") or (path == "gemv" and m > GEMV_MAX_M):
        raise LocalpdError(f"no {path} path for M = {m}")
    if gated and path == "gemm":  # prefill: one elementwise pass is cheap beside the GEMM
        x, gated = act_mul(x, gated), None
    if norm is not None and path == "gemm":
        x, s = add_rms_norm(x, norm.residual, norm.weight, norm.eps)
        return quant_matmul(x, words, scales, biases, bits, group, bias=bias, out=out, path=path), s
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride() != (n, 1):
        raise LocalpdError(f"out must be a contiguous [{m}, {n}] {x.dtype} tensor")
    if res is None:
        res = summed = x  # the residual stream is x itself
    else:
        res = res if res.stride(-1) == 1 else res.contiguous()
        summed = torch.empty_like(x)  # the new residual stream x + residual
    done = out if norm is None else (out, summed)
    if m == 0 or n == 0:
        return done
    words, scales = words.contiguous(), scales.contiguous()
    has_bias = biases is not None
    biases = biases.contiguous() if has_bias else scales
    # a single group per row (per-channel int8) is passed as a group no tile reaches past
    kernel_group = group if group < k else 1 << 30
    if path == "gemm":
        _dequant_matmul(x, words, scales, biases, bits, kernel_group, has_bias, out)
        return out if bias is None else out.add_(bias)
    block_m = gemv_block_m(m)
    kernel, tuned = _GEMV, None
    if split_k is None:  # a measured configuration (kernels/gemv_tuned.json), else the heuristic and autotuner
        tuned = tuned_gemv(x.device, bits, group, n, k, block_m)
        split_k = tuned.pop("split_k") if tuned else pick_split_k(n, k, sm_count(x.device))
    y = torch.zeros((m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    meta = dict(BITS=bits, GROUP=kernel_group, HAS_BIAS=has_bias, BLOCK_M=block_m, ATOMIC=split_k > 1,
                GATED=gated or "", NORM=norm is not None, HAS_RES=res is not x, OUT_BIAS=bias is not None,
                WORD_ALIGN=word_align(words))
    if tuned:
        kernel = _gemv_kernel
        meta.update(tuned)
    elif triton_interpreting():
        meta.update(INTERPRET_GEMV)
    gamma, eps = (x, 0.0) if norm is None else (norm.weight.contiguous(), norm.eps)
    grid = lambda META: (cdiv(m, block_m), cdiv(n, META["BLOCK_N"]), split_k)  # noqa: E731
    kernel[grid](x, y, m, n, k, x.stride(0), y.stride(0), words, scales, biases, words.stride(0), scales.stride(0),
                 scales.shape[1], split_k, res, gamma, summed, res.stride(0), summed.stride(0), eps,
                 x if bias is None else bias.contiguous(), **meta)
    if y is not out:
        out.copy_(y)
    return done


def word_align(words: torch.Tensor) -> int:
    """The GEMV's WORD_ALIGN for these int32 words [N, K * bits / 32]: 4 (16-byte runs) where the words per row
    and the row stride allow it."""
    n = math.gcd(words.shape[1], words.stride(0))
    return 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1


def _dequant_matmul(x, words, scales, biases, bits, group, has_bias, out):
    n, k = out.shape[1], x.shape[1]
    rows = max(1, min(n, DEQUANT_CHUNK // k))
    w = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    bn, bk = 16, 256
    for a in range(0, n, rows):
        b = min(n, a + rows)
        grid = (cdiv(b - a, bn), cdiv(k, bk))
        _dequant_kernel[grid](words[a:], scales[a:], biases[a:], w, b - a, k, words.stride(0), scales.stride(0),
                              w.stride(0), BITS=bits, GROUP=group, HAS_BIAS=has_bias, BLOCK_N=bn, BLOCK_K=bk)
        if a == 0 and b == n:
            torch.mm(x, w.T, out=out)
        else:
            out[:, a:b] = x @ w[:b - a].T
    return out


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group: int, *,
                bias=None, out=None, split_k=None, path=None, gated: str | None = None, norm: PreNorm | None = None):
    """x @ dequant(packed, scales, biases).T; the arguments of int4_matmul_ref, plus the overrides."""
    n, k = packed.shape[0], packed.shape[1] * 8
    if scales.shape != (n, k // group) or biases.shape != scales.shape:
        raise ValueError(f"scales/biases must be [{n}, {k // group}] for group {group}")
    return quant_matmul(x, packed, scales, biases, 4, group, bias=bias, out=out, split_k=split_k, path=path,
                        gated=gated, norm=norm)


def int8_matmul(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, group: int, *,
                bias=None, out=None, split_k=None, path=None, gated: str | None = None, norm: PreNorm | None = None):
    """x @ (data * scales).T; the arguments of int8_matmul_ref, plus the overrides."""
    n, k = data.shape
    if scales.shape != (n, k // group):
        raise ValueError(f"scales must be [{n}, {k // group}] for group {group}")
    if k % 4:
        raise LocalpdError(f"int8 kernels need an input dimension divisible by 4, got {k}")
    return quant_matmul(x, data.contiguous().view(torch.int32), scales, None, 8, group, bias=bias, out=out,
                        split_k=split_k, path=path, gated=gated, norm=norm)
