"""The integer GEMV (kernels/gemv_dp4a.py) against the float one (kernels/gemv_kmajor.py) and torch's int4
tinygemm on a GPU, Llama-3-8B's decode linears, int4-g128 and int8, 1 and 4 rows, as CUDA-graph replays over weight
copies larger than L2: per shape the time and % of the measured copy bandwidth of each, the activation rounding
(quantize_act) alone and the GEMV without it, and each product's error against its torch reference.

    python scripts/bench_dp4a.py [--json FILE]
"""

from __future__ import annotations

import itertools

import torch

from localpd.kernels import gemv_dp4a as dp, gemv_kmajor as km
from localpd.kernels.act_round import quantize_act
from localpd.kernels.dispatch import kmajor_matmul_ref
from localpd.measure.bench_kernels import SHAPES, gpu_script, graph_time, kmajor_copies, tinygemm, write_rows


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.inference_mode()
def main() -> None:
    args, dev, bw = gpu_script(__doc__, lambda p: p.add_argument("--rows", default="1,4"))
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; times in us, % of copy bandwidth "
          f"for the weight bytes")
    out = []
    for (shape, n, k), fmt, m in itertools.product(SHAPES, ("int4-g128", "int8"), map(int, args.rows.split(","))):
        ws = kmajor_copies(fmt, n, k, dev)
        first = ws[0]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        q, s = quantize_act(x, first.BITS)
        t = {
            "kmajor": graph_time([lambda w=w: km.gemv_kmajor(x, w.words, w.factors, w.BITS, w.group) for w in ws]),
            "dp4a": graph_time([lambda w=w: dp.gemv_dp4a(x, w.words, w.factors, w.BITS, w.group) for w in ws]),
            "quantize": graph_time([lambda: quantize_act(x, first.BITS)]),
        }
        y = torch.empty(m, n, device=dev, dtype=x.dtype)
        gemv_only = lambda w: dp.gemv_rounded(q, s, y, w.words, w.factors, w.BITS, w.group)  # noqa: E731
        t["dp4a gemv"] = graph_time([lambda w=w: gemv_only(w) for w in ws])
        if fmt == "int4-g128" and m == 1:
            fn, tb = tinygemm(torch.empty(n, k, device=dev, dtype=torch.bfloat16), 128)
            t["tinygemm"] = graph_time([lambda: fn(x)]) * first.nbytes / tb  # scaled to our bytes: same % of bw
        w = ws[0]
        errs = {"kmajor": rel(km.gemv_kmajor(x, w.words, w.factors, w.BITS, w.group), kmajor_matmul_ref(x, w)),
                "dp4a": rel(dp.gemv_dp4a(x, w.words, w.factors, w.BITS, w.group),
                            dp.gemv_dp4a_ref(x, w.words, w.factors, w.BITS, w.group)),
                "dp4a vs float": rel(dp.gemv_dp4a(x, w.words, w.factors, w.BITS, w.group), kmajor_matmul_ref(x, w))}
        cells = " | ".join(f"{name} {sec * 1e6:6.1f} {first.nbytes / sec / bw:4.0%}" for name, sec in t.items())
        print(f"{shape:>8} {fmt:>9} M={m} | {cells} | dp4a/kmajor {t['kmajor'] / t['dp4a']:.2f}x | err "
              + " ".join(f"{a} {e:.1e}" for a, e in errs.items()))
        out.append({"shape": shape, "n": n, "k": k, "format": fmt, "rows": m, "bytes": first.nbytes, "seconds": t,
                    "errors": errs})
        del ws
        torch.cuda.empty_cache()
    write_rows(args.json, bw, out)


if __name__ == "__main__":
    main()
