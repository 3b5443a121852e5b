"""The GEMV over strips (kernels/gemv_strip.py: all of K a program) against the model's split-K integer GEMV
(kernels/gemv_dp4a.py) on a GPU, Llama-3-8B's decode linears, int4-g128 and int8, 1 and 4 rows, each on activations
already rounded, as CUDA-graph replays over weight copies larger than L2: per shape each one's time, % of the
measured copy bandwidth for the weight bytes, the time `localpd bench kernels --predict` gives it (this card's
entry in measure/predict.py, else the H100's), and each product's error against its torch reference.

    python scripts/bench_strip.py [--json FILE] [--rows 1,4]
    python scripts/bench_strip.py --tiles [--table kernels/gemv_strip_tiles.json]   # each shape's tiles at 1 row
"""

from __future__ import annotations

import itertools
import json

import torch

from localpd.kernels import gemv_dp4a as dp, gemv_strip as gs
from localpd.kernels.act_round import quantize_act
from localpd.measure import predict
from localpd.measure.bench_kernels import SHAPES, gpu_script, graph_time, kmajor_copies, write_rows
from localpd.quant.kmajor import to_strips


TILES = [dict(num_warps=w, rows_a_lane=r, PREFETCH=pf, strips=1) for w in (2, 4) for r in (2, 4) for pf in (1, 2)] + \
        [dict(num_warps=w, rows_a_lane=2, PREFETCH=pf, strips=2) for w in (2, 4) for pf in (1, 2)] + \
        [dict(num_warps=w, rows_a_lane=1, PREFETCH=pf, strips=4) for w in (2, 4) for pf in (1, 2)]  # 8, 16 outputs
assert gs.WIDE_TILE in TILES and gs.DEFAULT_TILE in TILES


def name(tile: dict) -> str:
    return f"w{tile['num_warps']} r{tile['rows_a_lane']} pf{tile['PREFETCH']} s{tile['strips']}"


def sweep(args, dev, bw) -> None:
    """Each shape's TILES at one row; the fastest merged into args.table under this card's name."""
    card = torch.cuda.get_device_name()
    best_tiles = {}
    for (shape, n, k), fmt in itertools.product(SHAPES, ("int4-g128", "int8")):
        strips = [to_strips(w) for w in kmajor_copies(fmt, n, k, dev)]
        first = strips[0]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        q, s = quantize_act(x, first.BITS)
        y = torch.empty(1, n, device=dev, dtype=x.dtype)
        timed = [(t, graph_time([lambda w=w, t=t: gs.gemv_strip_rounded(q, s, y, w.words, w.factors, w.BITS,
                                                                         w.group, tile=t) for w in strips]))
                 for t in TILES]
        timed.sort(key=lambda r: r[1])
        tile, sec = timed[0]
        best_tiles[f"{first.BITS}:{n}:{k}"] = tile
        print(f"{shape:>8} {fmt:>9} | " + ", ".join(f"{name(t)} {sec * 1e6:.1f} us {first.nbytes / sec / bw:.0%}"
                                                   for t, sec in timed))
        del strips
        torch.cuda.empty_cache()
    if args.table:
        try:
            table = json.loads(open(args.table).read())
        except (OSError, ValueError):
            table = {}
        table.setdefault(card, {}).update(best_tiles)
        with open(args.table, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def card_entry(device_name: str) -> predict.Card:
    """measure/predict.py's entry for a device name ("NVIDIA H100 80GB HBM3": "H100 SXM"), else the H100's."""
    named = [c for c in predict.CARDS if all(w in device_name for w in c.name.replace(" SXM", "").split())]
    return (named or predict.CARDS)[0]


def predicted_us(kernel: str) -> dict:
    """{(format, linear): predicted us} for Llama-3-8B on the card this runs on."""
    card = card_entry(torch.cuda.get_device_name())
    return {(r.format, r.linear): r.predicted_us for r in predict.predict("llama3-8b", [card], kernels=(kernel,))}


@torch.inference_mode()
def main() -> None:
    def options(p):
        p.add_argument("--rows", default="1,4")
        p.add_argument("--tiles", action="store_true", help="time TILES per shape at one row instead")
        p.add_argument("--table", help="with --tiles: merge each shape's fastest tile into this table under this "
                       "card's name (kernels/gemv_strip_tiles.json: the model's launches read it)")

    args, dev, bw = gpu_script(__doc__, options)
    if args.tiles:
        return sweep(args, dev, bw)
    expected = {k: predicted_us(k) for k in ("dp4a", "strip")}
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; us, % of copy bandwidth for the "
          f"weight bytes, (predicted us at one row)")
    out = []
    for (shape, n, k), fmt, m in itertools.product(SHAPES, ("int4-g128", "int8"), map(int, args.rows.split(","))):
        ws = kmajor_copies(fmt, n, k, dev)
        strips = [to_strips(w) for w in ws]
        first = ws[0]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        q, s = quantize_act(x, first.BITS)
        y = torch.empty(m, n, device=dev, dtype=x.dtype)
        t = {"dp4a": graph_time([lambda w=w: dp.gemv_rounded(q, s, y, w.words, w.factors, w.BITS, w.group)
                                 for w in ws]),
             "strip": graph_time([lambda w=w: gs.gemv_strip_rounded(q, s, y, w.words, w.factors, w.BITS, w.group)
                                  for w in strips])}
        w, sw = ws[0], strips[0]
        y.fill_(float("nan"))  # every output written
        assert not gs.gemv_strip_rounded(q, s, y, sw.words, sw.factors, sw.BITS, sw.group).isnan().any(), shape
        errs = {"dp4a": rel(dp.gemv_dp4a(x, w.words, w.factors, w.BITS, w.group),
                            dp.gemv_dp4a_ref(x, w.words, w.factors, w.BITS, w.group)),
                "strip": rel(gs.gemv_strip(x, sw.words, sw.factors, sw.BITS, sw.group),
                             gs.gemv_strip_ref(x, sw.words, sw.factors, sw.BITS, sw.group))}
        cells = " | ".join(
            f"{name} {sec * 1e6:6.1f} {first.nbytes / sec / bw:4.0%}"
            + (f" ({expected[name][fmt, shape]:5.1f})" if m == 1 else "") for name, sec in t.items())
        print(f"{shape:>8} {fmt:>9} M={m} | {cells} | strip/dp4a {t['dp4a'] / t['strip']:.2f}x | err "
              + " ".join(f"{a} {e:.1e}" for a, e in errs.items()))
        out.append({"shape": shape, "n": n, "k": k, "format": fmt, "rows": m, "bytes": first.nbytes, "seconds": t,
                    "predicted_us": {name: expected[name][fmt, shape] for name in t} if m == 1 else None,
                    "errors": errs})
        del ws, strips
        torch.cuda.empty_cache()
    write_rows(args.json, bw, out)


if __name__ == "__main__":
    main()
