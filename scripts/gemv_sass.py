"""What the GEMV compiles to, without a GPU: builds _gemv_kernel for an NVIDIA architecture with Triton's own
compiler and ptxas, disassembles the cubin (cuobjdump) and reports, per launch configuration, the main loop's
SASS instructions per weight word a thread streams, its barriers and shared-memory instructions, the widest
weight load, registers, spilled bytes and the local-memory accesses (spills) inside the loop.

A GEMV at M = 1 keeps up with DRAM only if an SM issues its instructions faster than the weights arrive; each
card's budget of instructions per 4-byte word is printed at the end (scripts/sass.py). Static counts are not
timings: they say where to look, the GPU sweep (scripts/sweep_gemv.py) decides.

    python scripts/gemv_sass.py                       # sm_90, int4-g128 and int8, plain / norm / gated, M = 1
    python scripts/gemv_sass.py --arch 89 --m 1,4 --configs all
    python scripts/gemv_sass.py --mma --arch 86,90    # the tensor-core GEMV (kernels/gemv_mma.py), any M <= 16
"""

from __future__ import annotations

import argparse
import inspect
import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from localpd.kernels.dispatch import GEMV_CONFIGS, gemv_block_m, gemv_tile_fits
from localpd.kernels.gemv_mma import MMA_CONFIGS, _gemv_mma_kernel, mma_fits
from localpd.kernels.quant_matmul import _gemv_kernel
from sass import loop_stats, print_budgets  # this script's folder
from sweep_gemv import BLOCK_K, BLOCK_N, STAGES, WARPS  # the sweep's grid (this script's folder)


def compile_gemv(bits: int, group: int, block_n: int, block_k: int, warps: int, stages: int, m: int = 1,
                 norm: bool = False, gated: bool = False, arch: int = 90, split: bool = False):
    """_gemv_kernel compiled for sm_<arch>, specialised as quant_matmul launches it on aligned bf16 tensors."""
    sig = dict(x_ptr="*bf16", y_ptr="*fp32" if split else "*bf16", M="i32", N="i32", K="i32", stride_xm="i32",
               stride_ym="i32", w_ptr="*i32", s_ptr="*fp16", b_ptr="*fp16", stride_wn="i32", stride_sn="i32",
               K_GROUPS="i32", SPLIT_K="i32", r_ptr="*bf16", g_ptr="*bf16", sum_ptr="*bf16", stride_rm="i32",
               stride_summ="i32", eps="fp32", out_bias_ptr="*bf16")
    const = dict(BITS=bits, GROUP=group, HAS_BIAS=bits == 4, BLOCK_M=gemv_block_m(m), BLOCK_N=block_n,
                 BLOCK_K=block_k, ATOMIC=split, GATED="silu" if gated else "", NORM=norm, HAS_RES=norm, OUT_BIAS=False, WORD_ALIGN=4)
    return _compile(_gemv_kernel, sig, const, ["stride_rm", "stride_summ"], arch, warps, stages)


def _compile(kernel, sig: dict, const: dict, aligned: list, arch: int, warps: int, stages: int):
    """kernel compiled for sm_<arch> with sig's argument types and const's constexprs; its pointers, N, K, the
    x/y/w/scale strides and the arguments named in aligned specialised as 16-divisible."""
    names = list(inspect.signature(kernel.fn).parameters)
    sig.update({k: "constexpr" for k in const})
    aligned = [a for a, t in sig.items() if t.startswith("*")] + ["N", "K", "stride_xm", "stride_ym", "stride_wn",
                                                                   "stride_sn", *aligned]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(kernel, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))


def compile_mma(bits: int, group: int, block_n: int, block_k: int, warps: int, arch: int = 90):
    """_gemv_mma_kernel compiled for sm_<arch>, as gemv_mma launches it on aligned bf16 tensors (no split)."""
    sig = dict(x_ptr="*bf16", y_ptr="*bf16", M="i32", N="i32", K="i32", stride_xm="i32", stride_ym="i32",
               w_ptr="*i32", s_ptr="*fp16", b_ptr="*fp16", stride_wn="i32", stride_sn="i32", K_GROUPS="i32",
               SPLIT_K="i32", out_bias_ptr="*bf16")
    const = dict(BITS=bits, GROUP=group, HAS_BIAS=bits == 4, OUT_BIAS=False, BLOCK_N=block_n, BLOCK_K=block_k,
                 ATOMIC=False, FP16=False, DOT_F32=False, WORD_ALIGN=4)
    return _compile(_gemv_mma_kernel, sig, const, [], arch, warps, 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="90", help="compute capabilities, e.g. 90,89,86")
    p.add_argument("--formats", default="int4-g128,int8")
    p.add_argument("--variants", default="plain,norm,gated", help="plain, norm (RMSNorm prologue), gated (SiLU*mul)")
    p.add_argument("--m", default="1", help="activation rows, e.g. 1,4")
    p.add_argument("--configs", default="default",
                   help="'default' (the autotuner's), 'all' (the sweep's grid) or BLOCK_N,BLOCK_K,warps,stages[;...]")
    p.add_argument("--mma", action="store_true", help="the tensor-core GEMV instead (its cost does not depend on M)")
    args = p.parse_args()
    if args.mma:
        return mma_main(args)
    if args.configs == "default":
        configs = GEMV_CONFIGS
    elif args.configs == "all":
        configs = list(itertools.product(BLOCK_N, BLOCK_K, WARPS, STAGES))
    else:
        configs = [tuple(map(int, c.split(","))) for c in args.configs.split(";")]
    print(f"# Triton {triton.__version__}; per loop trip: SASS instructions per weight word a thread loads, "
          f"barriers, shared-memory instructions, widest load, registers, spilled bytes, local-memory accesses")
    print(f"{'arch':>5} {'format':>9} {'variant':>7} {'M':>2} {'BLOCK_N,K,warps,stages':>24} {'instr/word':>10} "
          f"{'bar':>4} {'smem':>5} {'load':>12} {'regs':>4} {'spill':>5} {'local':>5}")
    for arch, fmt, variant, m, (bn, bk, warps, stages) in itertools.product(
            map(int, args.arch.split(",")), args.formats.split(","), args.variants.split(","),
            map(int, args.m.split(",")), configs):
        bits, group = (4, int(fmt.split("-g")[1])) if fmt.startswith("int4") else (8, 1 << 30)
        if not gemv_tile_fits(gemv_block_m(m), bn, bk, bits, warps):  # as the autotuner and the sweep
            continue
        kernel = compile_gemv(bits, group, bn, bk, warps, stages, m, variant == "norm", variant == "gated", arch)
        s = loop_stats(kernel, bn * bk * bits / 32 / (32 * warps))
        print(f"{arch:>5} {fmt:>9} {variant:>7} {m:>2} {f'{bn},{bk},{warps},{stages}':>24} {s.per_word:>10} "
              f"{s.barriers:>4} {s.shared:>5} {s.widest_load:>12} {s.registers:>4} {s.spilled:>5} {s.local:>5}")
    print_budgets()
    return 0


def mma_main(args) -> int:
    configs = MMA_CONFIGS if args.configs == "default" else [tuple(map(int, c.split(",")))[:3]
                                                             for c in args.configs.split(";")]
    print(f"# Triton {triton.__version__}; the tensor-core GEMV, per loop trip (any M <= 16): as below")
    print(f"{'arch':>5} {'format':>9} {'variant':>7} {'M':>2} {'BLOCK_N,K,warps':>24} {'instr/word':>10} "
          f"{'bar':>4} {'smem':>5} {'load':>12} {'regs':>4} {'spill':>5} {'local':>5}")
    for arch, fmt, (bn, bk, warps) in itertools.product(map(int, args.arch.split(",")), args.formats.split(","),
                                                         configs):
        bits, group = (4, int(fmt.split("-g")[1])) if fmt.startswith("int4") else (8, 1 << 30)
        if not mma_fits(bits, group, 4096, bk):
            continue
        s = loop_stats(compile_mma(bits, group, bn, bk, warps, arch), bn * bk * bits / 32 / (32 * warps))
        print(f"{arch:>5} {fmt:>9} {'plain':>7} {16:>2} {f'{bn},{bk},{warps}':>24} {s.per_word:>10} "
              f"{s.barriers:>4} {s.shared:>5} {s.widest_load:>12} {s.registers:>4} {s.spilled:>5} {s.local:>5}")
    print_budgets()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
