"""Triton kernels that fuse the small elementwise steps between a layer's matmuls, so a decode step launches a
few kernels per layer instead of dozens (each torch op is its own kernel; in a CUDA graph their launch cost is
gone but each still reads and writes its tensors and takes a few microseconds).

- add_rms_norm: residual add and RMSNorm in one pass over a row (the sum is rounded to the activation dtype
  first, as the unfused torch code does, so both paths normalise the same residual stream), where the next
  matmul cannot do it as it loads its input (quant_matmul's norm: int4/int8 GEMVs).
- act_mul: act(gate) * up from the gate/up matmul's [T, 2I] output (act: SiLU, or GELU's tanh form for Gemma),
  where the down projection is dense or prefill-sized; the int4/int8 GEMVs compute it themselves as they load
  their input (quant_matmul's gated, through gate_act).
- add_rms_norm and act_mul also round their output for the GPU's integer GEMV (kernels/act_round.py) when it is
  that GEMV's input, so no launch of its own rounds it.
- qk_norm: Qwen3's RMSNorm of each query and key head over head_dim (its own weight for queries and for keys), in
  place on the qkv matmul's output, before RoPE and the KV write.
- rope: rotates query and key heads in place (HF's half-rotated layout), reading cos/sin per token. The model
  runs it only where rope_write_kv_kernel (paged_attention.py), which also writes the KV pages, cannot.

Their torch references (same signatures) are in fused_dispatch.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from localpd.kernels.act_round import round_blocks
from localpd.kernels.pdl import wait_prior


@triton.jit
def add_rms_norm_kernel(x, res, w, out_h, out_x, N, eps, s_x, s_r, s_h, s_ox, q, sq, s_q, s_sq, HAS_RES: tl.constexpr,
                        BLOCK: tl.constexpr, SLICE: tl.constexpr, ROUND_BITS: tl.constexpr = 0,
                        PDL: tl.constexpr = False):
    """Program (t, p): s = x[t] (+ res[t]) rounded to x's dtype; out_x[t] = s; out_h[t] = s * rsqrt(mean(s^2) + eps)
    * w; with ROUND_BITS (4 or 8) h is rounded for the integer GEMV into q[t], sq[t] instead (kernels/act_round.py:
    N a multiple of 32), and out_h is not written: nothing reads it then. Every program sums the whole row's squares
    (the same sum in the same order) and writes elements [p * SLICE, (p + 1) * SLICE) of it (SLICE a multiple of
    32, or BLOCK): a decode row's rounding spreads over several SMs instead of one."""
    wait_prior(PDL)  # kernels/pdl.py: what the kernel before wrote is read from here on
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    mask = d < N
    s = _residual_sum(x + t * s_x, res + t * s_r, d, mask, HAS_RES)
    sf = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / N + eps)
    if SLICE < BLOCK:  # this program's slice, loaded again (from L1)
        d = tl.program_id(1) * SLICE + tl.arange(0, SLICE)
        mask = d < N
        s = _residual_sum(x + t * s_x, res + t * s_r, d, mask, HAS_RES)
    if HAS_RES:
        tl.store(out_x + t * s_ox + d, s, mask=mask)
    h = ((s.to(tl.float32) * inv).to(tl.float32) * tl.load(w + d, mask=mask, other=0.0).to(tl.float32))
    h = h.to(out_h.dtype.element_ty)
    if ROUND_BITS:
        blk = tl.program_id(1) * (SLICE // 32) + tl.arange(0, SLICE // 32)
        round_blocks(tl.reshape(h.to(tl.float32), (SLICE // 32, 32)), blk, blk < N // 32, q + t * s_q, sq + t * s_sq,
                     SLICE // 32, ROUND_BITS)
    else:
        tl.store(out_h + t * s_h + d, h, mask=mask)


@triton.jit
def _residual_sum(x, res, d, mask, HAS_RES: tl.constexpr):
    """x[d] (+ res[d]), the sum rounded to x's dtype."""
    s = tl.load(x + d, mask=mask, other=0.0)
    if HAS_RES:
        s = (s.to(tl.float32) + tl.load(res + d, mask=mask, other=0.0).to(tl.float32)).to(x.dtype.element_ty)
    return s


@triton.jit
def qk_norm_kernel(qkv, wq, wk, D, eps, s_t, HQ: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (t, head): qkv[t, head] = RMSNorm(qkv[t, head]) * (wq for a query head (head < HQ), else wk), in
    place; the heads are D wide and consecutive, queries first."""
    wait_prior(PDL)  # kernels/pdl.py: what the kernel before wrote is read from here on
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    mask = d < D
    base = qkv + t * s_t + h * D
    x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(tl.where(h < HQ, wq, wk) + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + d, (x * inv * w).to(qkv.dtype.element_ty), mask=mask)


@triton.jit
def gate_act(g, ACT: tl.constexpr):
    """An MLP gate's activation of fp32 g: SiLU (ACT "silu"), or GELU's tanh form (ACT "gelu_tanh"), written as
    g * sigmoid(2z) for z = sqrt(2/pi) (g + 0.044715 g^3), which is 0.5 g (1 + tanh(z)) without its cancellation."""
    if ACT == "gelu_tanh":
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return g / (1.0 + tl.exp(-2.0 * z))
    else:
        return g / (1.0 + tl.exp(-g))


@triton.jit
def act_mul_kernel(gu, out, I, s_gu, s_o, q, sq, s_q, s_sq, BLOCK: tl.constexpr, ACT: tl.constexpr,
                   ROUND_BITS: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Program (t, block): out[t, j] = act(gu[t, j]) * gu[t, I + j], act rounded to the dtype first as torch does;
    with ROUND_BITS (4 or 8) the product is rounded for the integer GEMV into q[t], sq[t] instead (kernels/
    act_round.py: I a multiple of 32, BLOCK at least 32), and out is not written: nothing reads it then."""
    wait_prior(PDL)  # kernels/pdl.py: what the kernel before wrote is read from here on
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < I
    g = tl.load(gu + t * s_gu + j, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu + t * s_gu + I + j, mask=mask, other=0.0)
    a = gate_act(g, ACT).to(u.dtype).to(tl.float32)
    y = (a * u.to(tl.float32)).to(out.dtype.element_ty)
    if ROUND_BITS:
        blk = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        round_blocks(tl.reshape(y.to(tl.float32), (BLOCK // 32, 32)), blk, blk < I // 32, q + t * s_q, sq + t * s_sq,
                     BLOCK // 32, ROUND_BITS)
    else:
        tl.store(out + t * s_o + j, y, mask=mask)


@triton.jit
def rope_kernel(x, cos, sin, s_t, s_h, s_c, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, head): x[t, head] = (x1 * c - x2 * s, x2 * c + x1 * s) in place, x1/x2 its two halves of HALF
    elements each (in a tile of BLOCK, a power of two: 48 in 64 for heads of 96)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    base = x + t * s_t + h * s_h
    x1 = tl.load(base + i, mask=m).to(tl.float32)
    x2 = tl.load(base + HALF + i, mask=m).to(tl.float32)
    c = tl.load(cos + t * s_c + i, mask=m).to(tl.float32)
    s = tl.load(sin + t * s_c + i, mask=m).to(tl.float32)
    tl.store(base + i, (x1 * c - x2 * s).to(x.dtype.element_ty), mask=m)
    tl.store(base + HALF + i, (x2 * c + x1 * s).to(x.dtype.element_ty), mask=m)
