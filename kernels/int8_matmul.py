"""y = x @ W.T for symmetric int8 weights (localpd.quant.weights.Int8Weight), in Triton.

Same kernel shape and launch paths as int4_matmul (whose `accumulate` and `store` steps it reuses); only
the weight tile differs: int8 [BLOCK_N, BLOCK_K] loaded contiguously along K, times the group's scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localpd.kernels.dispatch import int8_matmul_ref, launch_matmul  # noqa: F401
from localpd.kernels.int4_matmul import accumulate, make_kernels, store


@triton.jit
def _int8_tile(data_ptr, scales_ptr, stride_dn, stride_sn, offs_n, k0, N, K,
               GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weights [BLOCK_N, BLOCK_K] for columns k0 .. k0 + BLOCK_K, dequantized to fp32 (0 past N or K)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    q = tl.load(data_ptr + offs_n[:, None] * stride_dn + offs_k[None, :], mask=mask, other=0)
    scale = tl.load(scales_ptr + offs_n[:, None] * stride_sn + (offs_k // GROUP)[None, :], mask=mask, other=0.0)
    return q.to(tl.float32) * scale.to(tl.float32)


@triton.jit
def _int8_matmul_kernel(x_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                        data_ptr, scales_ptr, stride_dn, stride_sn, SPLIT_K,
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
        w = _int8_tile(data_ptr, scales_ptr, stride_dn, stride_sn, offs_n, k0, N, K, GROUP, BLOCK_K)
        acc = accumulate(acc, w, x_ptr, stride_xm, m0, offs_m, k0 + tl.arange(0, BLOCK_K), M, K,
                         BLOCK_M, USE_DOT, DOT_PRECISION)
    store(acc, y_ptr, stride_ym, offs_m, offs_n, M, N, ATOMIC)


_KERNELS = make_kernels(_int8_matmul_kernel)


def int8_matmul(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, group: int, *,
                out: torch.Tensor | None = None, split_k: int | None = None, path: str | None = None) -> torch.Tensor:
    """x [M, K] @ (data * scales).T -> [M, N] in x.dtype, fp32 accumulation. Extras as in int4_matmul."""
    n, k = data.shape
    if scales.shape != (n, k // group):
        raise ValueError(f"scales must be [{n}, {k // group}] for group {group}")
    data, scales = data.contiguous(), scales.contiguous()
    return launch_matmul(_KERNELS, x, (data, scales, data.stride(0), scales.stride(0)), n, k, group,
                         out=out, split_k=split_k, path=path)
