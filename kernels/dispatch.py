"""Which implementation runs a quantized linear layer, the torch references, and launch heuristics.

Nothing here imports Triton: on a CPU-only install the references run; the Triton modules are imported
only when a kernel is launched (CUDA tensors, or the Triton interpreter switched on for tests). The bitsandbytes
formats (quant/bnb.py) always run on bitsandbytes' own matmuls, on the CPU or GPU; it too is imported only then.

The Triton interpreter is chosen by TRITON_INTERPRET=1 (or LOCALPD_TRITON_INTERPRET=1, which sets it). Triton
reads it when a kernel is decorated, so it must be set before localpd.kernels.quant_matmul is
imported (safest: before anything imports triton).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from localpd.errors import LocalpdError
from localpd.kernels import cpu
from localpd.quant.bnb import LLM_INT8_THRESHOLD, BnbInt8Weight, Nf4Weight, bitsandbytes, nf4_code
from localpd.quant.codebook import CodebookWeight
from localpd.quant.int4k import Int4KWeight
from localpd.quant.int5 import Int5KWeight, Int5Weight
from localpd.quant.int6k import SubScaled
from localpd.quant.kmajor import KMajorWeight, KStripWeight
from localpd.quant.tinygemm import TinyGemmInt4, tinygemm_matmul
from localpd.quant.weights import Int4Weight, Int8Weight

GEMV_MAX_M = 16  # the most rows the GEMV path takes (it is the default only up to quant_matmul.GEMV_AUTO_M)

# GEMV autotune candidates (BLOCK_N, BLOCK_K, num_warps, num_stages), chosen to fit sm_80/86/89 (~100 KB shared
# memory on consumer cards) as well as sm_90; tiles too large for the row count are pruned before tuning
# (gemv_tile_fits). The one-warp tiles are there for the RMSNorm and SiLU prologues: a thread there holds several
# rows of the same columns, so it prepares each activation once for all of them, where at 4 warps it does so for
# one. Compiled for sm_86 at M = 1 (scripts/gemv_sass.py, Triton 3.6), their int4 loops with a prologue take 49-62
# instructions per weight word against 167-272 for the 4-warp tiles, under an RTX 3090's budget of 76. (32, 256, 1)
# counted fewer still, but spilled with the norm prologue under Triton 3.9.
GEMV_CONFIGS = [(16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (32, 512, 8, 3), (8, 512, 2, 4), (64, 256, 8, 2),
                (16, 1024, 8, 2), (8, 1024, 4, 3), (32, 128, 4, 4), (16, 256, 1, 3), (16, 512, 1, 3)]
GEMV_MAX_TILE_WORDS = 8192  # weight words in a program's tile times its rows, at most
# ... and weights times rows per thread (its products per trip; 64 words of int8, 32 of int4): beyond either the
# loop spills registers (sm_86/sm_90 code). Counted in words (64 a thread), int4 tiles of 512 products a thread
# went through: at M = 8, 21 of 24 such kernels compiled to 240-255 registers and 15 spilled, reloading up to 159
# values a trip (Triton 3.9; docs/PERF.md).
GEMV_MAX_THREAD_PRODUCTS = 256
# Under the interpreter (slow, CPU): one small config, no autotuning.
INTERPRET_GEMV = dict(BLOCK_N=32, BLOCK_K=128)
# Measured GEMV launch configurations, written by scripts/sweep_gemv.py --table: per device ("sm_90", or
# "interpreter" in tests) and "bits:group:N:K:BLOCK_M", the fastest BLOCK_N, BLOCK_K, num_warps, num_stages and
# split_k found. A shape found there skips the autotuner (whose choices were far from the best, and which times
# its candidates eagerly); any other shape is autotuned as before.
GEMV_TABLE = Path(__file__).with_name("gemv_tuned.json")
TUNED_FIELDS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "split_k")


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


@functools.cache
def gemv_table() -> dict:
    """The measured GEMV configurations ({} when none are shipped, or the file is unreadable)."""
    try:
        return json.loads(GEMV_TABLE.read_text())
    except (OSError, ValueError):
        return {}


def device_arch(device: torch.device) -> int:
    """The compute capability of a CUDA device as one number (sm_89: 89), 0 for any other device."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def device_key(device: torch.device) -> str:
    return f"sm_{device_arch(device)}" if device.type == "cuda" else "interpreter"


def tuned_gemv(device: torch.device, bits: int, group: int, n: int, k: int, block_m: int) -> dict | None:
    """The measured launch configuration of this GEMV shape on this kind of device, or None."""
    entry = gemv_table().get(device_key(device), {}).get(f"{bits}:{group}:{n}:{k}:{block_m}")
    return {f: entry[f] for f in TUNED_FIELDS} if entry else None


def gemv_block_m(m: int) -> int:
    """Rows a GEMV program covers: M rounded up to a power of two (at most 16); every row reuses the dequantized
    weights."""
    return min(16, 1 << (m - 1).bit_length())


def gemv_tile_fits(block_m: int, block_n: int, block_k: int, bits: int, warps: int) -> bool:
    """Whether a GEMV tile's partial sums for block_m rows fit in registers (GEMV_MAX_TILE_WORDS,
    GEMV_MAX_THREAD_PRODUCTS)."""
    products = block_m * block_n * block_k
    return products * bits // 32 <= GEMV_MAX_TILE_WORDS and products <= GEMV_MAX_THREAD_PRODUCTS * 32 * warps


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: no point in splitting unless asked


def pick_split_k(n: int, k: int, sms: int, block_n: int = 16, min_k_per_split: int = 512) -> int:
    """Split K when there are fewer output tiles than SMs, so every SM streams part of the weights."""
    tiles = -(-n // block_n)
    if tiles >= sms:
        return 1
    return max(1, min(-(-2 * sms // tiles), k // min_k_per_split))


@dataclass
class PreNorm:
    """The RMSNorm in front of a matmul (add_rms_norm's arguments besides x): the matmul multiplies
    RMSNorm(x + residual) * weight (x alone when residual is None) and also returns the sum x + residual, the
    residual stream that goes on. The int4/int8 GEMVs do this as they load x, so a decode step launches no norm
    kernel of its own."""

    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float


def _matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.T).to(x.dtype)


def _plus(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def _input_matmul_ref(x: torch.Tensor, w: torch.Tensor, bias, gated: str | None, norm: PreNorm | None):
    """x @ w.T (+ bias) after the fused input step: act(gate) * up of x = [gate | up] (gated: act), or the RMSNorm of
    x + residual (norm, and then (y, x + residual) is returned), each rounded to x's dtype as its own kernel
    would."""
    from localpd.kernels.fused_dispatch import act_mul_ref, add_rms_norm_ref  # it imports this module

    if norm is not None:
        h, s = add_rms_norm_ref(x, norm.residual, norm.weight, norm.eps)
        return _plus(_matmul_ref(h, w), bias), s
    return _plus(_matmul_ref(act_mul_ref(x, gated) if gated else x, w), bias)


def int4_matmul_ref(x, packed, scales, biases, group: int, bias=None, gated: str | None = None,
                    norm: PreNorm | None = None):
    """y = x @ W.T (+ bias, the layer's [N]) with W dequantized in fp32; output in x.dtype. gated ("silu" or
    "gelu_tanh"): x = [gate | up] and y = (act(gate) * up) @ W.T. norm: y = RMSNorm(x + residual) @ W.T,
    returned as (y, x + residual). The kernels are tested against this."""
    w = Int4Weight(packed, scales, biases)
    if w.group != group:
        raise LocalpdError(f"int4 weights have group {w.group}, not {group}")
    return _input_matmul_ref(x, w.dequantize(torch.float32), bias, gated, norm)


def int4k_matmul_ref(x, w: Int4KWeight, bias=None, gated: str | None = None, norm: PreNorm | None = None):
    """int4_matmul_ref for an int4-k weight (quant/int4k.py), dequantized in fp32."""
    return _input_matmul_ref(x, w.dequantize(torch.float32), bias, gated, norm)


def codebook_matmul_ref(x, w: CodebookWeight, bias=None, gated: str | None = None, norm: PreNorm | None = None):
    """int4_matmul_ref for a codebook weight (quant/codebook.py), dequantized in fp32."""
    return _input_matmul_ref(x, w.dequantize(torch.float32), bias, gated, norm)


def int5_matmul_ref(x, w: Int5Weight | Int5KWeight | SubScaled, bias=None, gated: str | None = None,
                    norm: PreNorm | None = None):
    """int4_matmul_ref for a 5- or 6-bit weight (quant/int5.py, quant/int6k.py), dequantized in fp32."""
    return _input_matmul_ref(x, w.dequantize(torch.float32), bias, gated, norm)


def int8_matmul_ref(x, data, scales, group: int, bias=None, gated: str | None = None,
                    norm: PreNorm | None = None):
    w = Int8Weight(data, scales)
    if w.group != group:
        raise LocalpdError(f"int8 weights have group {w.group}, not {group}")
    return _input_matmul_ref(x, w.dequantize(torch.float32), bias, gated, norm)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _triton_fn(name: str):
    try:
        if name == "int4":
            from localpd.kernels.quant_matmul import int4_matmul as fn
        else:
            from localpd.kernels.quant_matmul import int8_matmul as fn
    except ImportError as e:
        raise LocalpdError(f"quantized matmul on the GPU needs Triton ({e}); install it with: pip install triton")
    return fn


def check_width(x: torch.Tensor, w_shape, gated: str | None = None) -> None:
    """x's features against the weight's inputs (twice them for a gate): a one-line error where they differ."""
    if x.shape[-1] != w_shape[1] * (2 if gated else 1):
        twice = " twice (gated)" if gated else ""
        raise LocalpdError(f"input has {x.shape[-1]} features but the weight expects {w_shape[1]}{twice}")


def _linear(x, w_shape, run, gated=None, norm=None):
    """run(x2, norm) on x flattened to rows (run adds the bias); the result in x's leading shape."""
    lead, k = x.shape[:-1], x.shape[-1]
    check_width(x, w_shape, gated)
    if norm is not None and norm.residual is not None:
        norm = replace(norm, residual=norm.residual.reshape(-1, k))
    y = run(x.reshape(-1, k), norm)
    if norm is None:
        return y.reshape(*lead, w_shape[0])
    return y[0].reshape(*lead, w_shape[0]), y[1].reshape(x.shape)


def linear_int4(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None, gated: str | None = None,
                norm: PreNorm | None = None):
    """x @ W.T (+ bias); gated ("silu" or "gelu_tanh"): x = [gate | up] and the product is (act(gate) * up) @ W.T;
    norm: the product is RMSNorm(x + residual) @ W.T, returned with x + residual (PreNorm). Runs Triton on CUDA (or
    under the interpreter), localpd's CPU kernels where they take it (kernels/cpu.py), else the torch reference."""
    int4 = isinstance(w, Int4Weight)
    if use_triton(x):
        fn = _triton_fn("int4" if int4 else "int8")
    elif cpu.takes_linear(x, w, bias, norm):
        check_width(x, w.shape, gated)  # _linear checks it on the other paths
        return cpu.linear(x, w, bias, gated, norm)
    else:
        fn = int4_matmul_ref if int4 else int8_matmul_ref
    tensors = (w.packed, w.scales, w.biases) if int4 else (w.data, w.scales)
    return _linear(x, w.shape, lambda x2, n: fn(x2, *tensors, w.group, bias=bias, gated=gated, norm=n), gated, norm)


linear_int8 = linear_int4  # the same dispatch: the weight's type picks the kernel


def _linear_held(x, w, gpu_form, ref, bias, gated, norm):
    """linear_int4 for a format that localpd's CPU kernels read as it is held and Triton's kernels take in another
    form (gpu_form(w), made once), with its torch reference ref elsewhere."""
    if use_triton(x):
        return linear_int4(x, gpu_form(w), bias, gated, norm)
    if cpu.takes_linear(x, w, bias, norm):
        check_width(x, w.shape, gated)
        return cpu.linear(x, w, bias, gated, norm)
    return _linear(x, w.shape, lambda x2, n: ref(x2, w, bias=bias, gated=gated, norm=n), gated, norm)


def linear_int4k(x: torch.Tensor, w: Int4KWeight, bias: torch.Tensor | None = None, gated: str | None = None,
                 norm: PreNorm | None = None):
    """linear_int4 for an int4-k weight: localpd's CPU kernels read its super-block scales as they are; Triton's
    int4 kernels take its groups' scales and biases expanded to float16 (int4-g32, as_int4: 5 bits a weight read
    on the GPU, not 4.6); elsewhere the torch reference."""
    return _linear_held(x, w, as_int4, int4k_matmul_ref, bias, gated, norm)


def linear_codebook(x: torch.Tensor, w: CodebookWeight, bias: torch.Tensor | None = None, gated: str | None = None,
                    norm: PreNorm | None = None):
    """linear_int4 for a codebook weight: localpd's CPU kernels look its codes up as they load them; Triton's int8
    kernels take its values as int8 (as_int8: 8.5 bits a weight read on the GPU, not 4.5); elsewhere the torch
    reference."""
    return _linear_held(x, w, as_int8, codebook_matmul_ref, bias, gated, norm)


def linear_int5(x: torch.Tensor, w: Int5Weight | Int5KWeight | SubScaled, bias: torch.Tensor | None = None,
                gated: str | None = None, norm: PreNorm | None = None):
    """linear_int4 for a 5- or 6-bit weight (GGUF's Q5_0, Q5_1, Q5_K, Q6_K) or Q3_K's or Q2_K's: localpd's CPU
    kernels read its high bits beside its int4 codes and its factors; Triton's int8 kernels take its nearest int8
    (as_int8: 8.5 bits a weight read on the GPU, not 4.6 to 6.6); elsewhere the torch reference."""
    return _linear_held(x, w, as_int8, int5_matmul_ref, bias, gated, norm)


def kmajor_matmul_ref(x, w: KMajorWeight | KStripWeight, bias=None, gated: str | None = None,
                      norm: PreNorm | None = None):
    """int4_matmul_ref for a K-major weight or one in strips (quant/kmajor.py), dequantized in fp32."""
    return _input_matmul_ref(x, w.dequantize(torch.float32), bias, gated, norm)


def kmajor_rounding(rows: int, w: KMajorWeight, like: torch.Tensor) -> int:
    """The bits (4 or 8) linear_kmajor rounds a plain input of this many rows (of like's device and dtype) to for
    its integer GEMV, so that a kernel before it may round the input instead (linear_kmajor's rounded=); 0 where it
    does not take the integer GEMV."""
    from localpd.kernels import gemv_dp4a as dp

    ok = use_triton(like) and rows <= dp.MAX_ROWS and dp.takes(w.shape, w.BITS, w.group, like.dtype)
    return w.BITS if ok else 0


def linear_kmajor(x: torch.Tensor, w: KMajorWeight, bias: torch.Tensor | None = None, gated: str | None = None,
                  norm: PreNorm | None = None, rounded=None):
    """linear_int4 for the GPU's K-major int4/int8 layout: a GEMV for a few rows (kernels/gemv_dp4a.py's integer one,
    up to its MAX_ROWS, where it takes the weight and the activations' dtype; else kernels/gemv_kmajor.py's, up to
    its MAX_ROWS), else dequantize + cuBLAS, each after the input step (RMSNorm, SiLU * up) in a kernel of its own
    unless gemv_kmajor.FUSE_INPUT_STEP; the torch reference where Triton does not run. rounded (act_round.Rounded,
    where kmajor_rounding says so): x already rounded for the integer GEMV by the kernel that wrote it."""
    if not use_triton(x):
        return _linear(x, w.shape, lambda x2, n: kmajor_matmul_ref(x2, w, bias=bias, gated=gated, norm=n), gated,
                       norm)
    from localpd.kernels import gemv_dp4a as dp, gemv_kmajor as km

    def run(x2, n):
        gemv = x2.shape[0] <= km.MAX_ROWS
        if kmajor_rounding(x2.shape[0], w, x2):  # the integer GEMV, its input rounded by the input step
            q, sq, s = _rounded_input(x2, n, gated, rounded, w.BITS)
            y = dp.gemv_rounded(q, sq, torch.empty((x2.shape[0], w.shape[0]), dtype=x2.dtype, device=x2.device),
                                w.words, w.factors, w.BITS, w.group, bias=bias)
            return y if n is None else (y, s)
        if gemv and km.FUSE_INPUT_STEP:
            return km.gemv_kmajor(x2, w.words, w.factors, w.BITS, w.group, bias=bias, gated=gated, norm=n)
        product = (lambda h: km.gemv_kmajor(h, w.words, w.factors, w.BITS, w.group, bias=bias)) if gemv else \
            (lambda h: km.dequant_matmul_kmajor(h, w.words, w.factors, w.BITS, w.group, bias))
        return _after_input_step(x2, n, gated, product)

    return _linear(x, w.shape, run, gated, norm)


def _after_input_step(x2: torch.Tensor, n: PreNorm | None, gated: str | None, product):
    """product(h) of the input step's output h (RMSNorm of x2 + residual, or act(gate) * up, in a kernel of its own;
    else x2), with the new residual beside it under n."""
    from localpd.kernels.fused_dispatch import act_mul, add_rms_norm

    if n is not None:
        h, s = add_rms_norm(x2, n.residual, n.weight, n.eps)
        return product(h), s
    return product(act_mul(x2, gated) if gated else x2)


def _rounded_input(x2: torch.Tensor, n: PreNorm | None, gated: str | None, rounded, bits: int):
    """An integer GEMV's input rounded (kernels/act_round.py's q, s) and, with n, the new residual (else None):
    handed over already rounded (rounded=), or rounded by the input step's kernel (RMSNorm, SiLU * up) as it writes
    it, or by a launch of its own."""
    from localpd.kernels.act_round import quantize_act
    from localpd.kernels.fused_dispatch import act_mul_rounded, add_rms_norm_rounded

    if rounded is not None:
        assert rounded.bits == bits and n is None and not gated
        return rounded.q, rounded.s, None
    if n is not None:
        return add_rms_norm_rounded(x2, n.residual, n.weight, n.eps, bits)
    q, sq = act_mul_rounded(x2, gated, bits) if gated else quantize_act(x2, bits)
    return q, sq, None


def kstrip_rounding(rows: int, w: KStripWeight, like: torch.Tensor) -> int:
    """kmajor_rounding for a weight in strips: the bits kernels/gemv_strip.py's GEMV rounds its input to, where it
    takes this many rows of like's dtype; else 0."""
    from localpd.kernels import gemv_strip as gs

    ok = use_triton(like) and rows <= gs.MAX_ROWS and gs.takes(w.shape, w.BITS, w.group, like.dtype)
    return w.BITS if ok else 0


def linear_kstrip(x: torch.Tensor, w: KStripWeight, bias: torch.Tensor | None = None, gated: str | None = None,
                  norm: PreNorm | None = None, rounded=None):
    """linear_kmajor for a weight in strips (quant/kmajor.py): kernels/gemv_strip.py's GEMV, no split-K, up to its
    MAX_ROWS rows of 16-bit activations, its input rounded by the input step as for the integer GEMV; more rows
    (prefill) dequantized from the strips for cuBLAS, after the input step; a few rows of float32 activations
    through linear_kmajor over the weight's K-major copy, made for the call."""
    if not use_triton(x):
        return _linear(x, w.shape, lambda x2, n: kmajor_matmul_ref(x2, w, bias=bias, gated=gated, norm=n), gated,
                       norm)
    from localpd.kernels import gemv_kmajor as km, gemv_strip as gs

    def run(x2, n):
        if not kstrip_rounding(x2.shape[0], w, x2):
            assert rounded is None
            if x2.shape[0] <= km.MAX_ROWS:  # float32 rows: the float GEMV's layout
                return linear_kmajor(x2, w.kmajor(), bias, gated, n)
            return _after_input_step(x2, n, gated, lambda h: km.dequant_matmul_kmajor(
                h, w.words, w.factors, w.BITS, w.group, bias, strips=True))
        q, sq, s = _rounded_input(x2, n, gated, rounded, w.BITS)
        y = gs.gemv_strip_rounded(q, sq, torch.empty((x2.shape[0], w.shape[0]), dtype=x2.dtype, device=x2.device),
                                  w.words, w.factors, w.BITS, w.group, bias=bias)
        return y if n is None else (y, s)

    return _linear(x, w.shape, run, gated, norm)


def linear_tinygemm(x: torch.Tensor, w: TinyGemmInt4, bias: torch.Tensor | None = None, gated: str | None = None,
                    norm: PreNorm | None = None):
    """linear_int4 for a weight in torch's tinygemm layout (quant/tinygemm.py, the per-shape fallback of
    kernels/tinygemm.py): torch's kernel for every row count, after the input step (RMSNorm, SiLU * up) in a kernel
    of its own, as for the float K-major GEMV."""
    return _linear(x, w.shape, lambda x2, n: _after_input_step(x2, n, gated,
                                                               lambda h: _plus(tinygemm_matmul(h, w), bias)),
                   gated, norm)


def as_int4(w: Int4KWeight) -> Int4Weight:
    """The int4-g32 weight with w's codes (the same tensor) and its groups' scales and biases in float16, made once
    and kept on w."""
    int4 = w.__dict__.get("_as_int4")
    if int4 is None:
        scale, bias = w.group_scales()
        int4 = w.__dict__["_as_int4"] = Int4Weight(w.packed, scale.half(), bias.half())
    return int4


def as_int8(w: CodebookWeight | Int5Weight | Int5KWeight | SubScaled) -> Int8Weight:
    """The int8 weight holding w's values (a codebook's exactly: its entries times the same scales; a 5-bit weight's
    nearest, quant/int5.py), made once and kept on w."""
    int8 = w.__dict__.get("_as_int8")
    if int8 is None:
        int8 = w.__dict__["_as_int8"] = w.to_int8()
    return int8


def bnb_matmul_ref(x: torch.Tensor, w: Nf4Weight | BnbInt8Weight) -> torch.Tensor:
    """y = x @ W.T with a bitsandbytes weight dequantized in fp32 (plain torch); output in x.dtype."""
    return _matmul_ref(x, w.dequantize(torch.float32))


def bnb_nf4_matmul(x: torch.Tensor, w: Nf4Weight) -> torch.Tensor:
    """y = x @ W.T by bitsandbytes' matmul_4bit (its GEMV/GEMM kernels for the device); output in x.dtype."""
    bnb = bitsandbytes("bnb-nf4")
    state = bnb.functional.QuantState(w.absmax.reshape(-1), shape=torch.Size(w.shape), code=nf4_code(x.device),
                                      blocksize=w.blocksize, quant_type="nf4", dtype=x.dtype)
    return bnb.matmul_4bit(x, w.data.reshape(-1, 1).t(), quant_state=state)  # B transposed, as Linear4bit passes it


def bnb_int8_matmul(x: torch.Tensor, w: BnbInt8Weight) -> torch.Tensor:
    """y = x @ W.T by bitsandbytes' LLM.int8 matmul (what Linear8bitLt runs for inference, outlier threshold
    6.0). Activations go through fp16, as bitsandbytes casts them; output in x.dtype."""
    bnb = bitsandbytes("bnb-int8")
    state = bnb.MatmulLtState()  # a fresh one per call: bitsandbytes keeps the step's outlier columns in it
    state.CB, state.SCB = w.data, w.scales.reshape(-1)
    state.has_fp16_weights = state.is_training = False
    return bnb.matmul(x.half(), w.data, state=state, threshold=LLM_INT8_THRESHOLD).to(x.dtype)


def linear_bnb_nf4(x: torch.Tensor, w: Nf4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _linear(x, w.shape, lambda x2, _: _plus(bnb_nf4_matmul(x2, w), bias))


def linear_bnb_int8(x: torch.Tensor, w: BnbInt8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _linear(x, w.shape, lambda x2, _: _plus(bnb_int8_matmul(x2, w), bias))
