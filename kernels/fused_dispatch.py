"""The small fused steps of a layer (residual add + RMSNorm, an MLP gate's activation * up, RoPE, Qwen3's per-head
RMSNorm of queries and keys): torch references, and launchers of their Triton kernels (kernels/fused.py) for CUDA
tensors or under the interpreter (see dispatch.use_triton). Nothing here imports Triton unless a kernel is
launched."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localpd.errors import LocalpdError
from localpd.kernels.dispatch import cdiv, use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s) * weight, s) for s = x + residual in x's dtype (s = x without a residual); x, residual [T, N]."""
    s = x if residual is None else x + residual
    return rms_norm_ref(s, weight, eps), s


def qk_norm_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, n_heads: int, n_kv_heads: int,
                eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm of every query and key head over head_dim, in place on qkv [T, (n_heads + 2 n_kv_heads) *
    head_dim] (the values are left as they are); q_weight and k_weight [head_dim]. Returns qkv."""
    d = q_weight.shape[0]
    heads = qkv[:, :(n_heads + n_kv_heads) * d].unflatten(1, (n_heads + n_kv_heads, d))
    heads[:, :n_heads] = rms_norm_ref(heads[:, :n_heads], q_weight, eps)
    heads[:, n_heads:] = rms_norm_ref(heads[:, n_heads:], k_weight, eps)
    return qkv


GATE_ACTS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}  # an MLP gate's activations


def act_mul_ref(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up for gate_up = [gate | up] along the last dimension; act one of GATE_ACTS."""
    gate, up = gate_up.chunk(2, dim=-1)
    return GATE_ACTS[act](gate) * up


def add_rms_norm_rounded_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                             bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from localpd.kernels.act_round import quantize_act_ref

    h, s = add_rms_norm_ref(x, residual, weight, eps)
    return (*quantize_act_ref(h, bits), s)


def act_mul_rounded_ref(gate_up: torch.Tensor, act: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    from localpd.kernels.act_round import quantize_act_ref

    return quantize_act_ref(act_mul_ref(gate_up, act), bits)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in place on x [T, heads, head_dim] (HF's half-rotated layout); cos/sin [T, head_dim // 2]. Returns x."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :].float(), sin[:, None, :].float()
    x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
    return x


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def _kernel_takes(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether the Triton step runs on rows x (and the others given): Triton at hand, 2-D, last dimension dense."""
    return use_triton(x) and x.dim() == 2 and all(t.stride(-1) == 1 for t in (x, *others) if t is not None)


def _check_act(act: str) -> None:
    if act not in GATE_ACTS:
        raise LocalpdError(f"unknown MLP activation {act!r}; localpd knows {', '.join(GATE_ACTS)}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not _kernel_takes(x, residual):
        return add_rms_norm_ref(x, residual, weight, eps)
    return _add_rms_norm(x, residual, weight, eps, 0)[:2]


def add_rms_norm_rounded(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                         bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm whose normalised rows are rounded for the integer GEMV of a bits-wide weight
    (kernels/act_round.py, N a multiple of 32): (q, scales, x + residual)."""
    if not _kernel_takes(x, residual):
        return add_rms_norm_rounded_ref(x, residual, weight, eps, bits)
    _, s, q, sq = _add_rms_norm(x, residual, weight, eps, bits)
    return q, sq, s


def _add_rms_norm(x, residual, weight, eps: float, bits: int):
    """(normalised rows, x + residual, q, scales); with bits the rows are rounded into q and scales and not
    written (x stands for them as a pointer the kernel does not store through), else q and scales are h."""
    from localpd.kernels.act_round import empty_rounded
    from localpd.kernels.fused import add_rms_norm_kernel
    from localpd.kernels.pdl import launch_args

    T, N = x.shape
    h = x if bits else torch.empty_like(x)
    s = x if residual is None else torch.empty_like(x)
    r = x if residual is None else residual
    q, sq = empty_rounded(T, N, x.device) if bits else (h, h)
    if T:
        block = triton_block(N)
        piece = norm_slice(T, N)
        add_rms_norm_kernel[(T, cdiv(N, piece))](x, r, weight, h, s, N, eps, x.stride(0), r.stride(0), h.stride(0),
                                                 s.stride(0), q, sq, q.stride(0), sq.stride(0),
                                                 HAS_RES=residual is not None, BLOCK=block, SLICE=piece,
                                                 ROUND_BITS=bits, num_warps=_warps(block), enable_fp_fusion=not bits,
                                                 **launch_args(x))
    return h, s, q, sq


def act_mul(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    _check_act(act)
    if not _kernel_takes(gate_up):
        return act_mul_ref(gate_up, act)
    return _act_mul(gate_up, act, 0)[0]


def act_mul_rounded(gate_up: torch.Tensor, act: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """act_mul's output rounded for the integer GEMV of a bits-wide weight (kernels/act_round.py, I a multiple of
    32): (q, scales)."""
    _check_act(act)
    if not _kernel_takes(gate_up):
        return act_mul_rounded_ref(gate_up, act, bits)
    return _act_mul(gate_up, act, bits)[1:]


def _act_mul(gate_up, act: str, bits: int):
    """(act(gate) * up, q, scales); with bits the product is rounded into q and scales and not written (gate_up
    stands for it as a pointer the kernel does not store through), else q and scales are the product."""
    from localpd.kernels.act_round import empty_rounded
    from localpd.kernels.fused import act_mul_kernel
    from localpd.kernels.pdl import launch_args

    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up if bits else torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    q, sq = empty_rounded(T, I, gate_up.device) if bits else (out, out)
    block = max(32, min(1024, triton_block(I)))
    if T:
        act_mul_kernel[(T, cdiv(I, block))](gate_up, out, I, gate_up.stride(0), out.stride(0), q, sq, q.stride(0),
                                            sq.stride(0), BLOCK=block, ACT=act, ROUND_BITS=bits,
                                            num_warps=_warps(block), enable_fp_fusion=not bits,
                                            **launch_args(gate_up))
    return out, q, sq


def qk_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, n_heads: int, n_kv_heads: int,
            eps: float) -> torch.Tensor:
    d = q_weight.shape[0]
    if not use_triton(qkv) or qkv.dim() != 2 or qkv.stride(-1) != 1:
        return qk_norm_ref(qkv, q_weight, k_weight, n_heads, n_kv_heads, eps)
    from localpd.kernels.fused import qk_norm_kernel
    from localpd.kernels.pdl import launch_args

    if qkv.shape[0]:
        block = triton_block(d)
        qk_norm_kernel[(qkv.shape[0], n_heads + n_kv_heads)](qkv, q_weight, k_weight, d, eps, qkv.stride(0),
                                                              HQ=n_heads, BLOCK=block, num_warps=_warps(block),
                                                              **launch_args(qkv))
    return qkv


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in place on x [T, heads, head_dim] (a strided view is fine: the q and k heads of a qkv output)."""
    T, H, D = x.shape
    if not use_triton(x) or x.stride(-1) != 1 or D % 2 or D < 4 or cos.stride(-1) != 1:
        return rope_ref(x, cos, sin)
    from localpd.kernels.fused import rope_kernel

    if T and H:
        rope_kernel[(T, H)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), HALF=D // 2,
                            BLOCK=triton_block(D // 2), num_warps=1)
    return x


# Rows up to this many (decode batches, a verification's rows) spread each row's add_rms_norm over programs of
# NORM_SLICE elements: one program a row took 3.0-3.5 us for a 4096-wide row on an H100, 7% of a Llama-3-8B decode
# step for two launches a layer (scripts/profile_decode_step.py, docs/PERF.md); more rows fill the SMs anyway.
NORM_SPREAD_ROWS = 16
NORM_SLICE = 512


def norm_slice(rows: int, n: int) -> int:
    """The elements of a row one add_rms_norm program writes: NORM_SLICE (a multiple of 32) for a few rows wider
    than it, else the whole (padded) row."""
    block = triton_block(n)
    return NORM_SLICE if rows <= NORM_SPREAD_ROWS and block > NORM_SLICE else block


def triton_block(n: int) -> int:
    """The power of two that covers n (a Triton tile size)."""
    return 1 << max(0, (n - 1).bit_length())
