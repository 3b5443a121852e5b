"""y = x @ W.T for M = 1..16 rows on the tensor cores: an experiment beside quant_matmul's GEMV, not yet used by
the model (scripts/sweep_gemv.py times it on a GPU; scripts/gemv_sass.py --mma counts its code).

The GEMV multiplies every weight by every row on the CUDA cores: at M = 8 its loops take 150-260 instructions per
int4 word, where a card streaming at full bandwidth issues 45 (H100) to 164 (RTX 4090) per word. Here the
products go to tl.dot (the activations padded to 16 rows): per weight only its field is extracted, as the bits of
a 16-bit float 2**7 + q (bf16) or 2**10 + q (fp16), whatever M is. The dot sums x * (base + q) over one group's
words of one field at a time (the field's columns are every FIELDS-th of x, in the order the words hold them),
and the group's scale and offset are applied once per tile after the dot:

    y += scale_g * (dot - base * sum(x)_g) + bias_g * sum(x)_g

So a dot's K is the words of one group in a tile, at least 16: int4 with groups of 128 or more, and int8 per
output channel (int8 reads its bytes as q + 128, as the GEMV does). Other formats keep the GEMV (mma_fits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localpd.errors import LocalpdError
from localpd.kernels.dispatch import cdiv, triton_interpreting
from localpd.kernels.quant_matmul import INT8_XOR, _split_chunks, word_align

MMA_ROWS = 16  # a dot's smallest M: the activation rows are padded to it
# (BLOCK_N, BLOCK_K, num_warps) that scripts/gemv_sass.py --mma counts by default; the sweep tries a wider grid
MMA_CONFIGS = [(32, 256, 4), (64, 256, 4), (64, 512, 8), (128, 256, 4), (128, 256, 8)]


@triton.jit
def _operand(w, F: tl.constexpr, BITS: tl.constexpr, FP16: tl.constexpr, DOT_F32: tl.constexpr):
    """Field F of each word as the 16-bit float base + q (exact), in the dot's operand type. int4: the field's
    bits OR-ed into the mantissa of base = 2**7 (bf16) or 2**10 (fp16); int8 (its byte read as q + 128, so base
    128, up to 255: more than a bf16 mantissa holds) is converted from an exact fp32 instead."""
    q = (w >> (F * BITS)) & ((1 << BITS) - 1)
    if BITS == 8:
        v = q.to(tl.float32)
        v = v.to(tl.float16) if FP16 else v.to(tl.bfloat16)
    else:
        if FP16:
            v = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        else:
            v = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    if DOT_F32:  # Triton's interpreter multiplies bf16 dots wrongly; the values are the same in fp32
        v = v.to(tl.float32)
    return v


@triton.jit
def _gemv_mma_kernel(x_ptr, y_ptr, M, N, K, stride_xm, stride_ym, w_ptr, s_ptr, b_ptr, stride_wn, stride_sn,
                     K_GROUPS, SPLIT_K, out_bias_ptr, BITS: tl.constexpr, GROUP: tl.constexpr,
                     HAS_BIAS: tl.constexpr, OUT_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     ATOMIC: tl.constexpr, FP16: tl.constexpr, DOT_F32: tl.constexpr, WORD_ALIGN: tl.constexpr = 1):
    """Program (row tile, column tile, split) over MMA_ROWS rows and BLOCK_N outputs; per K chunk and group in it:
    a [BLOCK_N, WPG] word tile, FIELDS dots of K = WPG, the group's sum of x, then scale and offset."""
    FIELDS: tl.constexpr = 32 // BITS
    G: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP  # groups in a tile (1 when a group spans several tiles)
    WPG: tl.constexpr = BLOCK_K // FIELDS // G  # words of one group in a tile: a dot's K
    BASE: tl.constexpr = 1024.0 if BITS == 4 and FP16 else 128.0  # what _operand adds to each field
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * 16 + tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    j = tl.arange(0, WPG)
    kw = tl.multiple_of(K // FIELDS, WORD_ALIGN)
    stride_wn = tl.multiple_of(stride_wn, WORD_ALIGN)
    xrow = x_ptr + offs_m[:, None] * stride_xm
    c0, c1 = _split_chunks(K, BLOCK_K, SPLIT_K, pid_k)
    acc = tl.zeros((16, BLOCK_N), tl.float32)
    for c in range(c0, c1):
        for g in tl.static_range(G):
            w0 = c * (BLOCK_K // FIELDS) + g * WPG  # the group's first word column in this tile
            wk = w0 + j
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + wk[None, :],
                        mask=n_mask[:, None] & (wk < kw)[None, :], other=0)  # [BLOCK_N, WPG]
            if BITS == 8:
                w = w ^ INT8_XOR
            x_mask = m_mask[:, None] & (wk < kw)[None, :]
            dot = tl.zeros((16, BLOCK_N), tl.float32)
            for f in tl.static_range(FIELDS):
                xf = tl.load(xrow + (wk * FIELDS + f)[None, :], mask=x_mask, other=0.0)  # [16, WPG]: field f's
                if DOT_F32:  # fp32 activations, or the interpreter: exact fp32 products, no tf32
                    dot = tl.dot(xf.to(tl.float32), tl.trans(_operand(w, f, BITS, FP16, DOT_F32)), dot,
                                 input_precision="ieee")
                else:
                    dot = tl.dot(xf, tl.trans(_operand(w, f, BITS, FP16, DOT_F32)), dot)
            cols = w0 * FIELDS + tl.arange(0, WPG * FIELDS)
            xg = tl.sum(tl.load(xrow + cols[None, :], mask=m_mask[:, None] & (cols < K)[None, :],
                                other=0.0).to(tl.float32), axis=1)[:, None]  # [16, 1]: the group's sum of x
            gk = (w0 * FIELDS) // GROUP + tl.zeros((BLOCK_N,), tl.int32)  # the group, per output
            s_mask = n_mask & (gk < K_GROUPS)
            scale = tl.load(s_ptr + offs_n * stride_sn + gk, mask=s_mask, other=0.0).to(tl.float32)[None, :]
            acc += (dot - BASE * xg) * scale
            if HAS_BIAS:
                acc += xg * tl.load(b_ptr + offs_n * stride_sn + gk, mask=s_mask, other=0.0).to(tl.float32)[None, :]
    if OUT_BIAS:
        bias = tl.load(out_bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def mma_fits(bits: int, group: int, k: int, block_k: int) -> bool:
    """Whether the tensor-core path takes this format and tile: a dot's K (one group's words of one field in a
    tile) must be at least 16 words."""
    if bits not in (4, 8):
        return False
    if group >= k:  # one group a row (int8 per channel): the whole tile
        return block_k * bits // 32 >= 16
    return min(group, block_k) * bits // 32 >= 16 and (block_k % group == 0 or group % block_k == 0)


def gemv_mma(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None, bits: int,
             group: int, *, bias: torch.Tensor | None = None, block_n: int = 32, block_k: int = 256,
             split_k: int = 1, num_warps: int = 4, num_stages: int = 1) -> torch.Tensor:
    """x [M <= 16, K] @ W.T (+ bias [N]) -> [M, N] in x.dtype, W as quant_matmul takes it (int32 words
    [N, K * bits / 32], scales and int4 offsets [N, K / group]). The launch configuration is explicit (this path
    is swept, not autotuned)."""
    n, k = words.shape[0], words.shape[1] * 32 // bits
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k or not 1 <= m <= MMA_ROWS:
        raise LocalpdError(f"gemv_mma takes [1..{MMA_ROWS}, {k}] activations, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise LocalpdError(f"gemv_mma takes bf16, fp16 or fp32 activations, not {x.dtype}")
    if not mma_fits(bits, group, k, block_k):
        raise LocalpdError(f"no tensor-core GEMV for {bits}-bit weights in groups of {group} with BLOCK_K {block_k}")
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    y = torch.zeros((m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    words, scales = words.contiguous(), scales.contiguous()
    has_bias = biases is not None
    kernel_group = group if group < k else 1 << 30
    _gemv_mma_kernel[(cdiv(m, MMA_ROWS), cdiv(n, block_n), split_k)](
        x, y, m, n, k, x.stride(0), y.stride(0), words, scales, biases.contiguous() if has_bias else scales,
        words.stride(0), scales.stride(0), scales.shape[1], split_k, x if bias is None else bias.contiguous(),
        BITS=bits, GROUP=kernel_group, HAS_BIAS=has_bias, OUT_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, ATOMIC=split_k > 1, FP16=x.dtype == torch.float16,
        DOT_F32=x.dtype == torch.float32 or triton_interpreting(), WORD_ALIGN=word_align(words),
        num_warps=num_warps, num_stages=num_stages)
    if y is not out:
        out.copy_(y)
    return out
