"""The CPU kernels' products at 1 to 256 rows: lpd_linear's integer products on this source's library and on another
cpu_kernels.c's (--against), and prefill's GEMM from cpu.GEMM_ROWS rows on (lpd_prefill_gemm's integer products on
AVX512-VNNI, the float GEMM elsewhere or with LOCALPD_PREFILL_INT=0), on the four product
shapes of a decoder layer of the default model (SmolLM2-135M: qkv 960 x 576, o 576 x 576, gate_up 3072 x 576,
down 576 x 1536; --shapes smollm2-1.7b: two of SmolLM2-1.7B's layers, which no cache holds), random weights of
one scheme. The three take turns each repetition, each timed on its second call
(the first warms the caches after the others' data); the fastest of --reps is kept.

    python scripts/bench_cpu_products.py --against OLD.c [--threads 2] [--kind int4] [--reps 8] [--rows 1,2,4,16]
                                         [--march haswell] [--shapes smollm2-1.7b]

--march builds both sources for that processor (e.g. haswell: the AVX2 products, on a machine that also has
AVX-512) instead of this one's.

Prints each one's ms for the layer's four products, its time over its one-row time, this source over the other's,
and this source's integer products over prefill's GEMM (from 16 rows).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from localpd.kernels import cpu
from localpd.quant.codebook import IQ4Weight
from localpd.quant.int4k import Int4KWeight
from localpd.quant.int5 import Int5Weight
from localpd.quant.int6k import Int6KWeight
from localpd.quant.weights import Int4Weight, Int8Weight

SHAPES = {"smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
          # two layers' worth (62 MB as int4-g32): out of a 32 MiB L3, the weight streams from memory as at decode
          "smollm2-1.7b": [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)] * 2}
ROWS = "1,2,3,4,5,8,12,15,16,24,32,48,64,128"


def random_q6k(w: torch.Tensor) -> Int6KWeight:
    """Random Q6_K codes, scales and d of w's shape (the products' speed does not depend on the values)."""
    n, k = w.shape
    g = torch.Generator().manual_seed(n * k)
    return Int6KWeight.from_codes(torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8),
                                  (torch.rand(n, k // 256, generator=g) * 1e-3).half(),
                                  torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8))


def random_q5(w: torch.Tensor) -> Int5Weight:
    """Random Q5_1 codes, scales and biases of w's shape."""
    n, k = w.shape
    g = torch.Generator().manual_seed(n * k)
    return Int5Weight.from_codes(torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8),
                                 (torch.rand(n, k // 32, generator=g) * 1e-2).half(),
                                 (torch.rand(n, k // 32, generator=g) * -0.1).half())


def random_iq4(w: torch.Tensor) -> IQ4Weight:
    """Random IQ4_NL / IQ4_XS codes and scales of w's shape."""
    n, k = w.shape
    g = torch.Generator().manual_seed(n * k)
    return IQ4Weight(torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
                     (torch.rand(n, k // 32, generator=g) * 1e-2).half())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="another cpu_kernels.c, e.g. `git show main:kernels/cpu_kernels.c`")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kind", choices=("int4", "int4k", "q5", "q6k", "int8", "iq4"), default="int4",
                    help="int4: Q4_1's (groups of 32 with biases); int4k: Q4_K's (their scales quantized a "
                         "super-block); q5: Q5_1's (every 5-bit type's products); q6k: Q6_K's; iq4: IQ4_NL's "
                         "and IQ4_XS's (codebook)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--march", default="native", help="the processor both sources are built for")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2-135m",
                    help="a decoder layer's four products (1.7b: two layers', which no cache holds)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    other = cpu.open_library(cpu.build(args.march, Path(tempfile.mkdtemp()), source=Path(args.against)))
    this = cpu.library() if args.march == "native" else cpu.open_library(cpu.build(args.march, Path(tempfile.mkdtemp())))
    g = torch.Generator().manual_seed(0)
    make = {"int4": lambda w: Int4Weight.quantize_rtn(w, 32), "int8": lambda w: Int8Weight.quantize(w, 32),
            "int4k": lambda w: Int4KWeight.from_int4(Int4Weight.quantize_rtn(w, 32)), "q5": random_q5,
            "q6k": random_q6k, "iq4": random_iq4}[args.kind]
    weights = [make(torch.randn(n, k, generator=g)) for n, k in SHAPES[args.shapes]]
    rows = [int(r) for r in args.rows.split(",")]
    inputs = {m: [torch.randn(m, k, generator=g) for _, k in SHAPES[args.shapes]] for m in rows}
    # (name, library, GEMM_ROWS): lpd_linear's integer products at every row count, prefill's GEMM where it takes them
    modes = [("this", this, 1 << 30), ("other", other, 1 << 30), ("prefill", this, cpu.GEMM_ROWS)]
    best: dict = {}
    kept = cpu.GEMM_ROWS
    try:
        for _ in range(args.reps):
            for m in rows:
                for name, lib, gemm_rows in modes:
                    if name == "prefill" and m < kept:
                        continue
                    cpu.GEMM_ROWS = gemm_rows
                    for timed in (False, True):  # the first call warms the caches after the others' data
                        t0 = time.perf_counter()
                        for w, x in zip(weights, inputs[m]):
                            cpu.linear(x, w, lib=lib)
                    best[m, name] = min(best.get((m, name), float("inf")), time.perf_counter() - t0)
    finally:
        cpu.GEMM_ROWS = kept
    print(f"# {args.threads} threads, {args.kind}, {this.lpd_isa().decode()}, {args.shapes}'s products, fastest of "
          f"{args.reps}: ms (x one row)")
    one = {name: best.get((rows[0], name)) for name in ("this", "other")}
    for m in rows:
        line = f"{m:4d} rows  this {best[m, 'this'] * 1e3:7.3f} (x{best[m, 'this'] / one['this']:6.2f})  other " \
               f"{best[m, 'other'] * 1e3:7.3f} (x{best[m, 'other'] / one['other']:6.2f})  this / other " \
               f"{best[m, 'this'] / best[m, 'other']:.2f}"
        if (m, "prefill") in best:
            line += (f"  prefill {best[m, 'prefill'] * 1e3:7.3f}  this / prefill "
                     f"{best[m, 'this'] / best[m, 'prefill']:.2f}")
        print(line)


if __name__ == "__main__":
    main()
