"""Which implementation runs a quantized linear layer, the torch references, and launch heuristics.

Nothing here imports Triton: on a CPU-only install the references run; the Triton modules are imported
only when a kernel is launched (CUDA tensors, or the Triton interpreter switched on for tests).

The Triton interpreter is chosen by TRITON_INTERPRET=1 (or LOCALPD_TRITON_INTERPRET=1, which sets it). Triton
reads it when a kernel is decorated, so it must be set before localpd.kernels.int4_matmul / int8_matmul are
imported (safest: before anything imports triton).
"""

from __future__ import annotations

import os

import torch

from localpd.errors import LocalpdError
from localpd.quant.weights import Int4Weight, Int8Weight

GEMV_MAX_M = 16  # decode and small batches: weight streaming, optional split-K

# Autotune candidates, shared by the int4 and int8 kernels; chosen to fit sm_80/86/89 (~100 KB shared memory
# on consumer cards) as well as sm_90. GEMV: (BLOCK_N, BLOCK_K, num_warps, num_stages).
GEMV_CONFIGS = [(32, 256, 4, 3), (64, 128, 4, 3), (16, 512, 4, 3), (32, 512, 8, 2), (64, 256, 8, 3), (128, 128, 8, 2)]
# GEMM: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages).
GEMM_CONFIGS = [(64, 64, 64, 4, 3), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3),
                (128, 128, 32, 4, 4), (32, 64, 128, 4, 3)]
# Under the interpreter (slow, CPU): one small config each, no autotuning.
INTERPRET_GEMV = dict(BLOCK_N=32, BLOCK_K=128)
INTERPRET_GEMM = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64)


def _on(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read by Triton itself)."""
    return _on("TRITON_INTERPRET") or _on("LOCALPD_TRITON_INTERPRET")


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA tensors; on CPU tensors only when LOCALPD_TRITON_INTERPRET=1 asks for the interpreter
    (tests), so a process that merely has TRITON_INTERPRET set keeps the fast torch reference on the CPU."""
    if _on("LOCALPD_TRITON_INTERPRET"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return True
    return x.is_cuda


def gemv_block_m(m: int) -> tuple[int, bool]:
    """Rows a GEMV program covers and whether it uses tl.dot (which needs 16 rows on the GPU)."""
    if m <= 4:
        return 1 << (m - 1).bit_length(), False
    return 16, True


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: no point in splitting unless asked


def pick_split_k(n: int, k: int, sms: int, block_n: int = 64, min_k_per_split: int = 256) -> int:
    """Split K when there are fewer output tiles than SMs, so every SM streams part of the weights."""
    tiles = -(-n // block_n)
    if tiles >= sms:
        return 1
    return max(1, min(-(-2 * sms // tiles), k // min_k_per_split))


def _matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.T).to(x.dtype)


def int4_matmul_ref(x, packed, scales, biases, group: int) -> torch.Tensor:
    """y = x @ W.T with W dequantized in fp32; output in x.dtype. The kernels are tested against this."""
    w = Int4Weight(packed, scales, biases)
    if w.group != group:
        raise LocalpdError(f"int4 weights have group {w.group}, not {group}")
    return _matmul_ref(x, w.dequantize(torch.float32))


def int8_matmul_ref(x, data, scales, group: int) -> torch.Tensor:
    w = Int8Weight(data, scales)
    if w.group != group:
        raise LocalpdError(f"int8 weights have group {w.group}, not {group}")
    return _matmul_ref(x, w.dequantize(torch.float32))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_matmul(kernels, x, weight_args, n: int, k: int, group: int, out=None, split_k=None, path=None):
    """Run one of a format's two Triton paths; `kernels` = (gemv, gemm), autotuned or plain (interpreter).

    Both are the same kernel signature: (x, y, M, N, K, stride_xm, stride_ym, *weight_args, SPLIT_K, GROUP,
    BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, ATOMIC, DOT_PRECISION). GEMV (M <= 16): one program per BLOCK_N outputs
    and K slice, split-K partial sums atomically added into a zeroed fp32 buffer. GEMM: 2-D tiles, tl.dot.
    """
    if x.dim() != 2 or x.shape[1] != k:
        raise LocalpdError(f"expected activations of shape [M, {k}], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    path = path or ("gemv" if m <= GEMV_MAX_M else "gemm")
    if path not in ("gemv", "gemm") or (path == "gemv" and m > GEMV_MAX_M):
        raise LocalpdError(f"no {path} path for M = {m}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride() != (n, 1):
        raise LocalpdError(f"out must be a contiguous [{m}, {n}] {x.dtype} tensor")
    if m == 0 or n == 0:
        return out
    meta = dict(GROUP=group, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    interpreting = triton_interpreting()
    if path == "gemv":
        block_m, use_dot = gemv_block_m(m)
        split_k = pick_split_k(n, k, sm_count(x.device)) if split_k is None else split_k
        y = torch.zeros((m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
        meta.update(BLOCK_M=block_m, USE_DOT=use_dot, ATOMIC=split_k > 1, **(INTERPRET_GEMV if interpreting else {}))
        grid = lambda META: (1, cdiv(n, META["BLOCK_N"]), split_k)  # noqa: E731
        kernels[0][grid](x, y, m, n, k, x.stride(0), y.stride(0), *weight_args, split_k, **meta)
        if y is not out:
            out.copy_(y)
    else:
        meta.update(USE_DOT=True, ATOMIC=False, **(INTERPRET_GEMM if interpreting else {}))
        grid = lambda META: (cdiv(m, META["BLOCK_M"]), cdiv(n, META["BLOCK_N"]), 1)  # noqa: E731
        kernels[1][grid](x, out, m, n, k, x.stride(0), out.stride(0), *weight_args, 1, **meta)
    return out


def _triton_fn(name: str):
    try:
        if name == "int4":
            from localpd.kernels.int4_matmul import int4_matmul as fn
        else:
            from localpd.kernels.int8_matmul import int8_matmul as fn
    except ImportError as e:
        raise LocalpdError(f"quantized matmul on the GPU needs Triton ({e}); install it with: pip install triton")
    return fn


def _linear(x, w_shape, run, bias):
    lead, k = x.shape[:-1], x.shape[-1]
    if k != w_shape[1]:
        raise LocalpdError(f"input has {k} features but the weight expects {w_shape[1]}")
    y = run(x.reshape(-1, k))
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, w_shape[0])


def linear_int4(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    fn = _triton_fn("int4") if use_triton(x) else int4_matmul_ref
    return _linear(x, w.shape, lambda x2: fn(x2, w.packed, w.scales, w.biases, w.group), bias)


def linear_int8(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    fn = _triton_fn("int8") if use_triton(x) else int8_matmul_ref
    return _linear(x, w.shape, lambda x2: fn(x2, w.data, w.scales, w.group), bias)
