"""y = x @ W.T for group-wise int4 weights (localpd.quant.weights.Int4Weight), in Triton.

One kernel, two launch paths (see dispatch.launch_matmul): GEMV for M <= 16 with optional split-K, and GEMM
tiles feeding tl.dot. Each program loads packed int32 words [BLOCK_N, BLOCK_K // 8] (contiguous along K,
16 bytes = 32 columns per four words), unpacks nibbles in registers, applies scale and bias per group and
accumulates in fp32. The shared steps `accumulate` and `store` are reused by the int8 kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localpd.kernels.dispatch import (GEMM_CONFIGS, GEMV_CONFIGS, int4_matmul_ref, launch_matmul,  # noqa: F401
                                      triton_interpreting)


@triton.jit
def accumulate(acc, w, x_ptr, stride_xm, m0, offs_m, offs_k, M, K,
               BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc[BLOCK_M, BLOCK_N] += x[rows, offs_k] @ w.T for one K chunk; w is the dequantized [BLOCK_N, BLOCK_K]."""
    k_mask = offs_k < K
    if USE_DOT:
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
    else:  # a few rows: multiply and reduce on the CUDA cores, one x row at a time
        for i in tl.static_range(BLOCK_M):
            row = m0 + i
            k_limit = tl.where(row < M, K, 0)  # rows past M read nothing
            x = tl.load(x_ptr + row * stride_xm + offs_k, mask=offs_k < k_limit, other=0.0).to(tl.float32)
            part = tl.sum(w * x[None, :], axis=1)
            acc += tl.where(offs_m[:, None] == row, part[None, :], 0.0)
    return acc


@triton.jit
def store(acc, y_ptr, stride_ym, offs_m, offs_n, M, N, ATOMIC: tl.constexpr):
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if ATOMIC:  # split-K: partial sums into a zeroed fp32 buffer
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_tile(packed_ptr, scales_ptr, biases_ptr, stride_pn, stride_sn, offs_n, k0, N, K,
               GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weights [BLOCK_N, BLOCK_K] for columns k0 .. k0 + BLOCK_K, dequantized to fp32 (0 past N or K)."""
    n_mask = offs_n < N
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(packed_ptr + offs_n[:, None] * stride_pn + offs_w[None, :],
                    mask=n_mask[:, None] & (offs_w[None, :] < K // 8), other=0)
    shifts = tl.arange(0, 8) * 4  # column 8j + s sits in bits 4s .. 4s+3 of word j
    q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = n_mask[:, None] & (offs_k[None, :] < K)
    group_offs = offs_n[:, None] * stride_sn + (offs_k // GROUP)[None, :]
    scale = tl.load(scales_ptr + group_offs, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(biases_ptr + group_offs, mask=mask, other=0.0).to(tl.float32)
    return q.to(tl.float32) * scale + bias


@triton.jit
def _int4_matmul_kernel(x_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                        packed_ptr, scales_ptr, biases_ptr, stride_pn, stride_sn, SPLIT_K,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_DOT: tl.constexpr, ATOMIC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    chunks_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_start = pid_k * chunks_per_split * BLOCK_K
    k_end = tl.minimum(K, k_start + chunks_per_split * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w = _int4_tile(packed_ptr, scales_ptr, biases_ptr, stride_pn, stride_sn, offs_n, k0, N, K,
                       GROUP, BLOCK_N, BLOCK_K)
        acc = accumulate(acc, w, x_ptr, stride_xm, m0, offs_m, k0 + tl.arange(0, BLOCK_K), M, K,
                         BLOCK_M, USE_DOT, DOT_PRECISION)
    store(acc, y_ptr, stride_ym, offs_m, offs_n, M, N, ATOMIC)


def make_kernels(kernel):
    """(gemv, gemm) launchers for one format's kernel: autotuned on the GPU, plain under the interpreter."""
    if triton_interpreting():
        return kernel, kernel
    gemv = triton.autotune(
        configs=[triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=s) for bn, bk, w, s in GEMV_CONFIGS],
        key=["N", "K", "GROUP", "BLOCK_M", "SPLIT_K"], reset_to_zero=["y_ptr"])(kernel)
    gemm = triton.autotune(
        configs=[triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=s)
                 for bm, bn, bk, w, s in GEMM_CONFIGS],
        key=["N", "K", "GROUP"])(kernel)
    return gemv, gemm


_KERNELS = make_kernels(_int4_matmul_kernel)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group: int, *,
                out: torch.Tensor | None = None, split_k: int | None = None, path: str | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(packed, scales, biases).T -> [M, N] in x.dtype, fp32 accumulation.

    Same arguments as int4_matmul_ref; `out` (written in place), `split_k` and `path` ("gemv"/"gemm") override
    the defaults, for tests and benchmarks.
    """
    n, k = packed.shape[0], packed.shape[1] * 8
    if scales.shape != (n, k // group) or biases.shape != scales.shape:
        raise ValueError(f"scales/biases must be [{n}, {k // group}] for group {group}")
    packed, scales, biases = packed.contiguous(), scales.contiguous(), biases.contiguous()
    weight_args = (packed, scales, biases, packed.stride(0), scales.stride(0))
    return launch_matmul(_KERNELS, x, weight_args, n, k, group, out=out, split_k=split_k, path=path)
