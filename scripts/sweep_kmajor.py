"""Sweep the K-major GEMV's launch (kernels/gemv_kmajor.py's tile: BLOCK_K, num_warps, PREFETCH, programs per SM)
on a GPU, for Llama-3-8B's decode linears at one row, each with the input step the model can fuse into it (RMSNorm
before qkv, gate_up and the head; SiLU * up before down) and without it, int4-g128 and int8; timed as CUDA-graph
replays over weight copies larger than L2, beside torch's int4 tinygemm. Prints per shape the default tile, the best one and
each one's % of the measured copy bandwidth, checks the best against the torch reference, writes every timing
as JSON.

    python scripts/sweep_kmajor.py [--json FILE]
"""

from __future__ import annotations

import itertools

import torch

from localpd.kernels import gemv_kmajor as km
from localpd.kernels.dispatch import PreNorm, kmajor_matmul_ref
from localpd.measure.bench_kernels import SHAPES, gpu_script, graph_time, kmajor_copies, tinygemm, write_rows

FUSED = {"qkv": "norm", "o": "", "gate_up": "norm", "down": "gated", "lm_head": "norm"}
TILES = ([dict(BLOCK_K=128, num_warps=4, PREFETCH=pf, per_sm=ps) for pf in (False, True) for ps in (1, 2, 4, 8)]
         + [dict(BLOCK_K=256, num_warps=8, PREFETCH=pf, per_sm=ps) for pf in (False, True) for ps in (2, 4)]
         + [dict(BLOCK_K=64, num_warps=4, PREFETCH=True, per_sm=ps) for ps in (4, 8)])


def name(tile: dict) -> str:
    return f"K{tile['BLOCK_K']} w{tile['num_warps']} {'pf' if tile['PREFETCH'] else 'nopf'} x{tile['per_sm']}"


@torch.inference_mode()
def main() -> int:
    args, dev, bw = gpu_script(__doc__)
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; {len(TILES)} tiles a shape")
    out = []
    for (shape, n, k), variant, fmt in itertools.product(SHAPES, ("plain", "fused"), ("int4-g128", "int8")):
        fused = FUSED[shape] if variant == "fused" else ""
        if variant == "fused" and not fused:  # o has no input step
            continue
        ws = kmajor_copies(fmt, n, k, dev)
        first = ws[0]
        x = torch.randn(1, 2 * k if fused == "gated" else k, device=dev, dtype=torch.bfloat16)
        norm = PreNorm(torch.randn(1, k, device=dev, dtype=torch.bfloat16),
                       torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5, 1e-5) if fused == "norm" else None
        kw = dict(gated="silu" if fused == "gated" else None, norm=norm)

        def call(w, tile):
            return km.gemv_kmajor(x, w.words, w.factors, w.BITS, w.group, tile=tile, **kw)

        rows = []
        for tile in [{}] + TILES:
            try:
                sec = graph_time([lambda w=w, t=tile: call(w, t) for w in ws], reps=20)
                rows.append((tile, sec))
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
                print(f"  {shape} {fmt} {name({**km.DEFAULT_TILE, **tile})}: {type(e).__name__} {str(e)[:80]}")
        nbytes = first.nbytes
        default = rows[0][1]
        best_tile, best = min(rows, key=lambda r: r[1])
        got = call(ws[0], best_tile)
        ref = kmajor_matmul_ref(x, ws[0], **kw)
        got, ref = (got[0], ref[0]) if norm is not None else (got, ref)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        tg = ""
        if fmt == "int4-g128":
            fn, tb = tinygemm(torch.empty(n, k, device=dev, dtype=torch.bfloat16), 128)
            xt = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            tsec = graph_time([lambda: fn(xt)], reps=20)
            tg = f" | tinygemm {tsec * 1e6:.1f} us {tb / tsec / bw:.0%}"
        print(f"{shape:>8} {fmt:>9} {fused or 'plain':>5} | default {default * 1e6:6.1f} us "
              f"{nbytes / default / bw:4.0%}"
              f" | best {name({**km.DEFAULT_TILE, **best_tile})}: {best * 1e6:6.1f} us {nbytes / best / bw:4.0%}"
              f" (err {err:.1e}){tg}")
        out.append({"shape": shape, "n": n, "k": k, "format": fmt, "fused": fused, "bytes": nbytes,
                    "timings": [[name({**km.DEFAULT_TILE, **t}), s] for t, s in rows]})
        del ws
        torch.cuda.empty_cache()
    write_rows(args.json, bw, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
