"""Decode attention on the CPU kernels (lpd_attention, one query row), this source's library against another
cpu_kernels.c's (--against), taking turns: heads of a real model, several context lengths and KV formats, a pool of
24 layers (a decode step's, which no cache holds) with each sequence's pages in order. Prints each one's ms a layer,
the pages' bytes over the time (GB/s) and this source's time over the other's.

    python scripts/bench_cpu_attention.py --against OLD.c [--heads 32,32,64] [--ctx 192,1024,4096] [--kv fp16]
                                          [--threads 2] [--reps 5] [--shuffle] [--spread 4]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from localpd.kernels import cpu
from localpd.kvcache.formats import new_kv_pool

LAYERS = 24
PAGE = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True,
                    help="another cpu_kernels.c, e.g. `git show main:kernels/cpu_kernels.c`")
    ap.add_argument("--heads", default="32,32,64", help="query heads, KV heads, head width (default: SmolLM2-1.7B's)")
    ap.add_argument("--ctx", default="192,1024,4096", help="comma-separated context lengths")
    ap.add_argument("--kv", default="fp16", help="comma-separated KV formats (localpd.kvcache.formats)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shuffle", action="store_true",
                    help="the sequence's pages in a random order (an engine's, after some use)")
    ap.add_argument("--spread", type=int, default=1,
                    help="a pool this many times the sequence's pages (--shuffle draws them from all of it)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hq, h, d = (int(x) for x in args.heads.split(","))
    this = cpu.library()
    other = cpu.open_library(cpu.build("native", Path(tempfile.mkdtemp()), source=Path(args.against)))
    g = torch.Generator().manual_seed(0)
    print(f"# {args.threads} threads, {hq} query heads, {h} KV heads of {d}, {LAYERS} layers, fastest of {args.reps}")
    for kv in args.kv.split(","):
        for ctx in (int(c) for c in args.ctx.split(",")):
            n_pages = -(-ctx // PAGE)
            pool = new_kv_pool(kv, LAYERS, n_pages * args.spread, PAGE, h, d, torch.float32, "cpu")
            for t in (pool.k, pool.v, pool.k_scale, pool.v_scale, pool.k_zero, pool.v_zero):
                if t is not None:
                    t.copy_(torch.randint(0, 100, t.shape, generator=g) if not t.is_floating_point()
                            else torch.rand(t.shape, generator=g) * 0.02 + 0.001)
            layers = [pool.layer(i) for i in range(LAYERS)]
            pool_bytes = sum(t.numel() * t.element_size() for t in (pool.k, pool.v, pool.k_scale, pool.v_scale,
                                                                    pool.k_zero, pool.v_zero) if t is not None)
            nbytes = pool_bytes * ctx // (n_pages * args.spread * PAGE)  # the sequence's pages' bytes
            order = (torch.randperm(n_pages * args.spread, generator=g)[:n_pages] if args.shuffle
                     else torch.arange(n_pages))
            page_table = order.to(torch.int32)[None]
            lens, starts = torch.tensor([ctx], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
            q = torch.randn(1, hq, d, generator=g)
            best = {"this": float("inf"), "other": float("inf")}
            for _ in range(args.reps):
                for name, lib in (("this", this), ("other", other)):
                    t0 = time.perf_counter()
                    for layer in layers:
                        cpu.attention(q, layer, page_table, lens, starts, d ** -0.5, lib=lib)
                    best[name] = min(best[name], time.perf_counter() - t0)
            line = "  ".join(f"{n} {best[n] / LAYERS * 1e3:6.3f} ms {nbytes / best[n] / 1e9:5.1f} GB/s" for n in best)
            print(f"{kv:8s} ctx {ctx:5d}  {line}  this / other {best['this'] / best['other']:.2f}")


if __name__ == "__main__":
    main()
