"""One launch of each batch-1 decode GEMV (kernels/gemv_dp4a.py, int4-g128 and int8, Llama-3-8B shapes, the tile
the model launches) between cudaProfilerStart and Stop, for Nsight Compute: where a GEMV's time above its bytes
goes (stall reasons, achieved occupancy, waves, DRAM throughput). Each product runs twice unprofiled first
on another copy of the weights (compiles, warms the caches of everything but the weights, which the profiled
launch reads from a copy L2 no longer holds).

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats python3 scripts/ncu_gemv.py [--formats int4-g128,int8] [--shapes qkv,o,gate_up,down]
"""

from __future__ import annotations

import argparse

import torch

from localpd.kernels import gemv_dp4a as dp
from localpd.kernels.act_round import quantize_act
from localpd.measure.bench_kernels import SHAPES, kmajor_copies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="int4-g128")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for shape, n, k in [s for s in SHAPES if s[0] in args.shapes.split(",")]:
        for fmt in args.formats.split(","):
            ws = kmajor_copies(fmt, n, k, dev)  # the first made is out of L2 once the others are made
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            q, s = quantize_act(x, ws[0].BITS)
            y = torch.empty(1, n, device=dev, dtype=x.dtype)
            for _ in range(2):
                dp.gemv_rounded(q, s, y, ws[-1].words, ws[-1].factors, ws[-1].BITS, ws[-1].group)
            torch.cuda.synchronize()
            w = ws[0]
            print(f"{shape} {fmt}: N {n} K {k}, {w.nbytes / 1e6:.1f} MB, tile {dp.tile_for(dev, w.BITS, n, k, 1)}",
                  flush=True)
            torch.cuda.cudart().cudaProfilerStart()
            dp.gemv_rounded(q, s, y, w.words, w.factors, w.BITS, w.group)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            del ws
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
