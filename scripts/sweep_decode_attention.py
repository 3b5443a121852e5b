"""The decode attention kernel's launch constants swept on a GPU (issue 32): tokens per tile (DECODE_TILE_ELEMS), the
programs the splits aim at per SM (DECODE_PROGRAMS_PER_SM) and warps per program (DECODE_WARPS), for each KV format,
one layer of Llama-3-8B heads at batch 1, CUDA-graph replays over a graph-width page table, pages rotated past L2
(scripts/bench_kv.py's measurement). Prints each format's time per setting and its best against the default.

    python scripts/sweep_decode_attention.py [--contexts 32768] [--formats bf16,int8,int4]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

from localpd.kvcache import dispatch
from localpd.kvcache.formats import kv_bytes_per_token
from localpd.load.synthetic import SYNTHETIC
from localpd.measure.bench_kernels import copies_for, graph_time

sys.path.insert(0, str(Path(__file__).parent))
from bench_kv import filled_layer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="32768")
    ap.add_argument("--formats", default="bf16,int8,int4")
    ap.add_argument("--table-tokens", type=int, default=131072)
    args = ap.parse_args()
    c, dev, dt = SYNTHETIC["llama3-8b"], torch.device("cuda"), torch.bfloat16
    default = (dispatch.DECODE_TILE_ELEMS, dispatch.DECODE_PROGRAMS_PER_SM, dispatch.DECODE_WARPS)
    settings = list(itertools.product((8192, 16384, 32768), (2, 4, 8), (4, 8)))
    print(f"# default: tile {default[0]} elements, {default[1]} programs an SM, {default[2]} warps")
    for ctx in (int(x) for x in args.contexts.split(",")):
        for kv_dtype in args.formats.split(","):
            ps, g = 16, torch.Generator(device=dev).manual_seed(0)
            pages = -(-ctx // ps)
            nbytes = ctx * kv_bytes_per_token(kv_dtype, 1, c.n_kv_heads, c.head_dim)
            layers = [filled_layer(kv_dtype, pages, ps, c, dt, dev, g) for _ in range(copies_for(nbytes, dev))]
            table = torch.randperm(pages, generator=g, device=dev).to(torch.int32).view(1, -1)
            table = torch.cat([table, table.new_zeros(1, (args.table_tokens - ctx) // ps)], dim=1)
            lens = torch.full((1,), ctx, dtype=torch.int32, device=dev)
            starts = torch.arange(2, dtype=torch.int32, device=dev)
            q = torch.randn(1, c.n_heads, c.head_dim, generator=g, device=dev, dtype=dt)
            times = {}
            for s in settings:
                dispatch.DECODE_TILE_ELEMS, dispatch.DECODE_PROGRAMS_PER_SM, dispatch.DECODE_WARPS = s
                runs = [functools.partial(dispatch.paged_attention, q, layer, table, lens, starts, c.head_dim ** -0.5)
                        for layer in layers]
                try:
                    times[s] = graph_time(runs)
                except Exception as e:  # noqa: BLE001 - a setting that does not compile (registers, shared memory)
                    print(f"  {kv_dtype} {ctx} {s}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            dispatch.DECODE_TILE_ELEMS, dispatch.DECODE_PROGRAMS_PER_SM, dispatch.DECODE_WARPS = default
            best = min(times, key=times.get)
            base = times.get(default)
            print(f"{kv_dtype:10} {ctx:6}: default {base * 1e6:7.1f} us ({nbytes / base / 1e9:5.0f} GB/s); best {best} "
                  f"{times[best] * 1e6:7.1f} us ({nbytes / times[best] / 1e9:5.0f} GB/s, {base / times[best]:.2f}x) | "
                  + " ".join(f"{s[0] // 1024}k/{s[1]}/{s[2]}:{t * 1e6:.0f}" for s, t in times.items()), flush=True)
            del layers


if __name__ == "__main__":
    main()
