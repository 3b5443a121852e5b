"""Decode batches and verifications of 8 to 16 rows on a GPU: the integer GEMV (kernels/gemv_dp4a.py, 4 rows a
program, so 2-4 programs read each weight tile) against the path such rows take today past gemv_kmajor.MAX_ROWS
(8): the weight dequantized for cuBLAS. Llama-3-8B's decode linears, int4-g128 and int8,
CUDA-graph replays over weight copies larger than L2; each time over the same GEMV's at one row.

    python scripts/sweep_dp4a_rows.py [--rows 8,12,16] [--json FILE]
"""

from __future__ import annotations

import itertools

import torch

from localpd.kernels import gemv_dp4a as dp, gemv_kmajor as km
from localpd.measure.bench_kernels import SHAPES, gpu_script, graph_time, kmajor_copies, write_rows


@torch.inference_mode()
def main() -> None:
    args, dev, bw = gpu_script(__doc__, lambda p: p.add_argument("--rows", default="8,12,16"))
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; us, and x the GEMV's time at one "
          f"row")
    out = []
    for (shape, n, k), fmt in itertools.product(SHAPES[:4], ("int4-g128", "int8")):
        ws = kmajor_copies(fmt, n, k, dev)
        x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        one = graph_time([lambda w=w: dp.gemv_dp4a(x1, w.words, w.factors, w.BITS, w.group) for w in ws])
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t = {"cublas": graph_time([lambda w=w: km.dequant_matmul_kmajor(x, w.words, w.factors, w.BITS, w.group)
                                       for w in ws])}
            t["dp4a"] = graph_time([lambda w=w: dp.gemv_dp4a(x, w.words, w.factors, w.BITS, w.group) for w in ws])
            w = ws[0]
            ref = dp.gemv_dp4a_ref(x, w.words, w.factors, w.BITS, w.group).double()
            y = dp.gemv_dp4a(x, w.words, w.factors, w.BITS, w.group).double()
            err = ((y - ref).norm() / ref.norm()).item()
            print(f"{shape:>8} {fmt:>9} M={m:2} | one row {one * 1e6:5.1f} | " + " | ".join(
                f"{name} {sec * 1e6:6.1f} {sec / one:4.2f}x" for name, sec in t.items())
                + f" | dp4a err {err:.1e}", flush=True)
            out.append({"shape": shape, "format": fmt, "rows": m, "one_row": one, "seconds": t, "error": err})
        del ws
        torch.cuda.empty_cache()
    write_rows(args.json, bw, out)


if __name__ == "__main__":
    main()
