"""What the GEMV compiles to, without a GPU: builds _gemv_kernel for an NVIDIA architecture with Triton's own
compiler and ptxas, disassembles the cubin (cuobjdump) and reports, per launch configuration, the main loop's
SASS instructions per weight word a thread streams, its barriers and shared-memory instructions, the widest
weight load, registers and spilled bytes.

A GEMV at M = 1 keeps up with DRAM only if an SM issues its instructions faster than the weights arrive: an SM
issues at most 128 thread-instructions a clock, so at full bandwidth there are SMs * 128 * clock / (bandwidth / 4)
instruction slots per 4-byte word, printed per card at the end. Static counts are not timings: they say where to
look, the GPU sweep (scripts/sweep_gemv.py) decides.

    python scripts/gemv_sass.py                       # sm_90, int4-g128 and int8, plain / norm / gated, M = 1
    python scripts/gemv_sass.py --arch 89 --m 1,4 --configs all
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from localpd.device import card_entry
from localpd.kernels.dispatch import GEMV_CONFIGS, gemv_block_m
from localpd.kernels.quant_matmul import _gemv_kernel
from sweep_gemv import BLOCK_K, BLOCK_N, MAX_WORDS, STAGES, WARPS  # the sweep's grid (this script's folder)

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# card -> (SMs, boost clock GHz), datasheets; bandwidth from localpd.device's table, the H100's as measured here
CARDS = {"H100 SXM": (132, 1.98), "RTX 5090": (170, 2.41), "RTX 4090": (128, 2.52), "RTX 4070": (46, 2.48),
         "RTX 3090": (82, 1.70)}
H100_MEASURED = 2950  # GB/s, a 1 GiB device-to-device copy (docs/PERF.md)


@dataclass
class LoopStats:
    instructions: int  # SASS instructions in the main loop's body
    per_word: float  # ... per weight word (4 bytes) each thread loads in one trip
    barriers: int
    shared: int  # shared-memory loads and stores (a layout change goes through shared memory)
    weight_load: str  # the widest global load in the loop, e.g. LDG.E.128
    registers: int
    spilled: int  # bytes of local memory (stack) per thread


def compile_gemv(bits: int, group: int, block_n: int, block_k: int, warps: int, stages: int, m: int = 1,
                 norm: bool = False, gated: bool = False, arch: int = 90, split: bool = False):
    """_gemv_kernel compiled for sm_<arch>, specialised as quant_matmul launches it on aligned bf16 tensors."""
    names = list(inspect.signature(_gemv_kernel.fn).parameters)
    sig = dict(x_ptr="*bf16", y_ptr="*fp32" if split else "*bf16", M="i32", N="i32", K="i32", stride_xm="i32",
               stride_ym="i32", w_ptr="*i32", s_ptr="*fp16", b_ptr="*fp16", stride_wn="i32", stride_sn="i32",
               K_GROUPS="i32", SPLIT_K="i32", r_ptr="*bf16", g_ptr="*bf16", sum_ptr="*bf16", stride_rm="i32",
               stride_summ="i32", eps="fp32", out_bias_ptr="*bf16")
    const = dict(BITS=bits, GROUP=group, HAS_BIAS=bits == 4, BLOCK_M=gemv_block_m(m), BLOCK_N=block_n,
                 BLOCK_K=block_k, ATOMIC=split, GATED=gated, NORM=norm, HAS_RES=norm, OUT_BIAS=False, WORD_ALIGN=4)
    sig.update({k: "constexpr" for k in const})
    aligned = [a for a, t in sig.items() if t.startswith("*")] + ["N", "K", "stride_xm", "stride_ym", "stride_wn",
                                                                   "stride_sn", "stride_rm", "stride_summ"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(_gemv_kernel, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))


def cuobjdump(cubin: bytes) -> str:
    """The cubin's SASS and its resource usage (registers, stack), as cuobjdump prints them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout


def main_loop(sass: str) -> list[str]:
    """The opcodes of the largest loop body (a backward branch and everything from its target to it)."""
    code = [(int(a, 16), op.strip()) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best: list[str] = []
    for addr, op in code:
        jump = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", op)
        if jump and int(jump.group(1), 16) < addr:
            body = [re.sub(r"^@!?U?P\w+\s+", "", o).split()[0] for a, o in code if int(jump.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    return best


def loop_stats(kernel, words_per_thread: float) -> LoopStats:
    out = cuobjdump(kernel.asm["cubin"])
    body = main_loop(out)
    loads = [op for op in body if op.startswith("LDG")]
    widest = max(loads, key=lambda op: int((re.findall(r"\d+$", op) or ["32"])[0]), default="-")  # LDG.E: 32 bits
    regs, stack = (int(re.search(rf"{field}:(\d+)", out).group(1)) for field in ("REG", "STACK"))
    return LoopStats(len(body), round(len(body) / words_per_thread, 1), sum(op.startswith("BAR") for op in body),
                     sum(op.startswith(("LDS", "STS", "LDSM")) for op in body), widest, regs, stack)


def budgets() -> dict[str, float]:
    """Instruction slots per weight word at full bandwidth, per card."""
    slots = {}
    for card, (sms, ghz) in CARDS.items():
        gbs = H100_MEASURED if card.startswith("H100") else card_entry(card)[0]
        slots[f"{card} ({gbs} GB/s)"] = sms * 128 * ghz * 1e9 / (gbs * 1e9 / 4)
    return slots


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="90", help="compute capabilities, e.g. 90,89,86")
    p.add_argument("--formats", default="int4-g128,int8")
    p.add_argument("--variants", default="plain,norm,gated", help="plain, norm (RMSNorm prologue), gated (SiLU*mul)")
    p.add_argument("--m", default="1", help="activation rows, e.g. 1,4")
    p.add_argument("--configs", default="default",
                   help="'default' (the autotuner's), 'all' (the sweep's grid) or BLOCK_N,BLOCK_K,warps,stages[;...]")
    args = p.parse_args()
    if args.configs == "default":
        configs = GEMV_CONFIGS
    elif args.configs == "all":
        configs = list(itertools.product(BLOCK_N, BLOCK_K, WARPS, STAGES))
    else:
        configs = [tuple(map(int, c.split(","))) for c in args.configs.split(";")]
    print(f"# Triton {triton.__version__}; per loop trip: SASS instructions per weight word a thread loads, "
          f"barriers, shared-memory instructions, widest load")
    print(f"{'arch':>5} {'format':>9} {'variant':>7} {'M':>2} {'BLOCK_N,K,warps,stages':>24} {'instr/word':>10} "
          f"{'bar':>4} {'smem':>5} {'load':>12} {'regs':>4} {'spill':>5}")
    for arch, fmt, variant, m, (bn, bk, warps, stages) in itertools.product(
            map(int, args.arch.split(",")), args.formats.split(","), args.variants.split(","),
            map(int, args.m.split(",")), configs):
        bits, group = (4, int(fmt.split("-g")[1])) if fmt.startswith("int4") else (8, 1 << 30)
        if bn * bk * bits // 32 * gemv_block_m(m) > MAX_WORDS:  # as the sweep: larger tiles spill
            continue
        kernel = compile_gemv(bits, group, bn, bk, warps, stages, m, variant == "norm", variant == "gated", arch)
        s = loop_stats(kernel, bn * bk * bits / 32 / (32 * warps))
        print(f"{arch:>5} {fmt:>9} {variant:>7} {m:>2} {f'{bn},{bk},{warps},{stages}':>24} {s.per_word:>10} "
              f"{s.barriers:>4} {s.shared:>5} {s.weight_load:>12} {s.registers:>4} {s.spilled:>5}")
    print("\n# instruction slots per weight word at full bandwidth (SMs x 128 x clock / (bandwidth / 4 bytes)):")
    for card, slots in budgets().items():
        print(f"#   {card:<32} {slots:6.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
