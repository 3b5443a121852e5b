"""Sweep the integer GEMV's launch (kernels/gemv_dp4a.py's tile: blocks a trip, warps, the next trip loaded ahead,
programs an SM, the pipeliner's stages, the next trip's activations loaded ahead) on a GPU, for Llama-3-8B's decode linears at one row (activations already
rounded), int4-g128 and int8, as CUDA-graph replays over weight copies larger than L2. Prints per shape the default tile, the best one and
each one's % of the measured copy bandwidth; checks the best against the torch reference; writes every timing as
JSON.

    python scripts/sweep_dp4a.py [--json FILE] [--rows 1] [--table kernels/gemv_dp4a_tiles.json]
                                 [--formats int4-g128,int8] [--shapes qkv,o,gate_up,down,lm_head]
"""

from __future__ import annotations

import itertools
import json

import torch

from localpd.kernels import gemv_dp4a as dp
from localpd.kernels.act_round import quantize_act
from localpd.measure.bench_kernels import SHAPES, gpu_script, graph_time, kmajor_copies, write_rows

TILES = [dict(blocks=b, num_warps=w, PREFETCH=pf, per_sm=ps, stages=1, acts=0) for b, w in ((2, 2), (4, 4), (8, 4))
         for pf in (0, 1, 2) for ps in (4, 8, 12)] + \
        [dict(blocks=b, num_warps=w, PREFETCH=0, per_sm=ps, stages=st, acts=0) for b, w in ((2, 2), (4, 4))  # cp.async
         for st in (3, 4) for ps in (4, 8, 12)] + \
        [dict(blocks=b, num_warps=w, PREFETCH=pf, per_sm=ps, stages=1, acts=1) for b, w in ((2, 2), (4, 4))  # acts
         for pf in (1, 2) for ps in (4, 8, 12)]


def name(tile: dict) -> str:
    return (f"b{tile['blocks']} w{tile['num_warps']} pf{int(tile['PREFETCH'])} x{tile['per_sm']} s{tile['stages']}"
            f"{' acts' if tile.get('acts') else ''}")


@torch.inference_mode()
def main() -> int:
    def options(p):
        p.add_argument("--rows", type=int, default=1)
        p.add_argument("--formats", default="int4-g128,int8", help="of int4-g128 and int8")
        p.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="of bench_kernels.SHAPES' names")
        p.add_argument("--table", help="merge each shape's fastest tile into this table (kernels/gemv_dp4a_tiles.json)"
                       " under this card's name; the model's launches read it")
        p.add_argument("--tiles", choices=["all", "staged", "acts"], default="all",
                       help="staged: only the tiles with the pipeliner's stages (cp.async); acts: only those loading "
                       "the next trip's activations ahead; each beside the tile as set")

    args, dev, bw = gpu_script(__doc__, options)
    tiles = [t for t in TILES if args.tiles == "all" or (t["stages"] > 1 if args.tiles == "staged" else t["acts"])]
    shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; {len(tiles)} tiles a shape, "
          f"{args.rows} row(s)")
    out = []
    for (shape, n, k), fmt in itertools.product(shapes, args.formats.split(",")):
        ws = kmajor_copies(fmt, n, k, dev)
        first = ws[0]
        base = dp.tile_for(dev, first.BITS, n, k, 1)  # the tile the model launches now (table or default)
        x = torch.randn(args.rows, k, device=dev, dtype=torch.bfloat16)
        q, s = quantize_act(x, first.BITS)
        y = torch.empty(args.rows, n, device=dev, dtype=x.dtype)
        rows = []
        for tile in [{}] + tiles:
            try:
                sec = graph_time([lambda w=w, t=tile: dp.gemv_rounded(q, s, y, w.words, w.factors, w.BITS, w.group,
                                                                       tile=t) for w in ws])
                rows.append((tile, sec))
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
                print(f"  {shape} {fmt} {name(base | tile)}: {type(e).__name__} {str(e)[:80]}")
        default = rows[0][1]
        best_tile, best = min(rows, key=lambda r: r[1])
        w = ws[0]
        got = dp.gemv_rounded(q, s, y.clone(), w.words, w.factors, w.BITS, w.group, tile=best_tile)
        ref = dp.gemv_dp4a_ref(x, w.words, w.factors, w.BITS, w.group)
        err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
        ranked = sorted(rows[1:], key=lambda r: r[1])
        print(f"{shape:>8} {fmt:>9} | as set {default * 1e6:6.1f} us {first.nbytes / default / bw:4.0%} | best "
              f"{name(base | best_tile)} {best * 1e6:6.1f} us {first.nbytes / best / bw:4.0%} (err {err:.1e}) | next: "
              + ", ".join(f"{name(base | t)} {first.nbytes / sec / bw:.0%}" for t, sec in ranked[1:4]))
        out.append({"shape": shape, "n": n, "k": k, "format": fmt, "bytes": first.nbytes, "base": base,
                    "timings": [[name(base | t), sec] for t, sec in rows]})
        del ws
        torch.cuda.empty_cache()
    if args.table and args.rows == 1:
        try:
            with open(args.table) as f:
                table = json.load(f)
        except FileNotFoundError:
            table = {}
        card = table.setdefault(torch.cuda.get_device_name(), {})
        for row in out:
            timed = dict(row["timings"])
            tile = min((row["base"] | t for t in [{}] + tiles if name(row["base"] | t) in timed),
                       key=lambda t: timed[name(t)])  # the tile as set where none timed beats it
            card[f"{8 if row['format'] == 'int8' else 4}:{row['n']}:{row['k']}"] = tile
        with open(args.table, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
    write_rows(args.json, bw, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
