"""KV-cache benchmarks (issue 4): TTFT cold vs. with a cached prefix, decode attention time per KV dtype at long
contexts, and the TPOT of running streams while a long prompt is admitted, with and without chunked prefill.

    python scripts/bench_kv.py [--model smollm2-135m] [--device cpu|cuda] [--prefix 4096] [--contexts 4096,16384,32768]

Prints tables; every ratio compares numbers measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import threading
import time

import torch

from localpd.measure.bench_kernels import copies_for, graph_time
from localpd.engine import Engine
from localpd.errors import LocalpdError
from localpd.kvcache.dispatch import paged_attention, write_kv
from localpd.kvcache.formats import KV_DTYPES, check_kv_dtype, kv_bytes_per_token, new_kv_pool
from localpd.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=1)


def filler(engine: Engine, n: int, seed: int) -> list[int]:
    """n token ids of ordinary text-like tokens (ids from a seeded draw over the vocabulary's lower half)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(200, engine.config.vocab_size // 2, (n,), generator=g).tolist()


def ttft(engine: Engine, ids: list[int]) -> tuple[float, int]:
    handle = engine.submit(ids, GREEDY)
    list(handle)
    return handle.stats.ttft, handle.stats.cached_tokens


def bench_prefix(engine: Engine, prefix_len: int) -> None:
    prefix = filler(engine, prefix_len, 1)
    cold, _ = ttft(engine, prefix + filler(engine, 32, 2))
    warm, cached = ttft(engine, prefix + filler(engine, 32, 3))  # same prefix, new question
    print(f"\n## TTFT with a {prefix_len}-token prefix ({engine.device.type}, {engine.name}, kv {engine.kv_dtype})")
    print(f"cold {cold * 1000:.1f} ms | warm {warm * 1000:.1f} ms ({cached} tokens from the prefix cache) | "
          f"warm/cold {warm / cold:.1%}")


def bench_attention(c, dev: torch.device, dt: torch.dtype, contexts: list[int], batch: int, reps: int,
                    table_tokens: int = 0, chunk: int = 0) -> None:
    """Decode attention over one layer's pages: time, speed-up over the first dtype, and the KV bytes read per
    second. On a GPU the time is a CUDA-graph replay (as decode runs) rotating through enough copies of the pages
    that none is read from L2; on the CPU the best of `reps` calls. table_tokens: the page table as wide as a CUDA
    graph's (the whole context), the sequences' pages first. chunk: each sequence's last `chunk` tokens as query
    rows instead, a prefill chunk after a cached prefix (the prefill kernel; GB/s counts the pages once, though
    every block of the chunk's rows reads them)."""
    what = f"Prefill attention, a {chunk}-token chunk a sequence" if chunk else "Decode attention"
    print(f"\n## {what}, one layer, batch {batch}, {c.n_heads} q heads / {c.n_kv_heads} kv heads x "
          f"{c.head_dim} ({dev.type}{', CUDA-graph replays' if dev.type == 'cuda' else ''}"
          f"{f', a {table_tokens}-token page table' if table_tokens else ''})")
    print("| context | " + " | ".join(KV_DTYPES) + " |")
    print("|---|" + "---|" * len(KV_DTYPES))
    for ctx in contexts:
        cells, base = [], None
        for kv_dtype in KV_DTYPES:
            try:
                check_kv_dtype(kv_dtype, dev)
            except LocalpdError:
                cells.append("n/a")
                continue
            ps = 16
            pages = batch * math.ceil(ctx / ps)
            nbytes = batch * ctx * kv_bytes_per_token(kv_dtype, 1, c.n_kv_heads, c.head_dim)
            g = torch.Generator(device=dev).manual_seed(0)
            layers = [filled_layer(kv_dtype, pages, ps, c, dt, dev, g) for _ in range(copies_for(nbytes, dev))]
            table = torch.randperm(pages, generator=g, device=dev).to(torch.int32).view(batch, -1)
            if table_tokens > ctx:
                table = torch.cat([table, table.new_zeros(batch, (table_tokens - ctx) // ps)], dim=1)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            rows = chunk or 1
            starts = torch.arange(batch + 1, dtype=torch.int32, device=dev) * rows
            q = torch.randn(batch * rows, c.n_heads, c.head_dim, generator=g, device=dev, dtype=dt)
            runs = [functools.partial(paged_attention, q, layer, table, lens, starts, c.head_dim ** -0.5)
                    for layer in layers]
            seconds = graph_time(runs) if dev.type == "cuda" else timed(runs[0], reps)
            base = base or seconds
            cells.append(f"{seconds * 1e3:.3f} ms ({base / seconds:.2f}x, {nbytes / seconds / 1e9:.0f} GB/s)")
            del layers, runs
        print(f"| {ctx} | " + " | ".join(cells) + " |")


def filled_layer(kv_dtype: str, pages: int, ps: int, c, dt: torch.dtype, dev: torch.device, g: torch.Generator):
    """One layer's pages in kv_dtype, every slot written with random keys and values (in pieces)."""
    layer = new_kv_pool(kv_dtype, 1, pages, ps, c.n_kv_heads, c.head_dim, dt, dev).layer(0)
    for start in range(0, pages * ps, 8192):
        n = min(8192, pages * ps - start)
        kv = torch.randn(2, n, c.n_kv_heads, c.head_dim, generator=g, device=dev, dtype=dt)
        write_kv(layer, kv[0], kv[1], torch.arange(start, start + n, device=dev))
    return layer


def timed(fn, reps: int) -> float:
    """Best wall-clock seconds of `reps` calls (CPU)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_admission(model: str, device: str, long_len: int, streams: int, chunk: int | None) -> dict:
    """TPOT of `streams` running decodes while a long prompt arrives; chunk=None puts the whole prompt in one step."""
    engine = Engine(model, device=device, max_context=long_len + 64,
                    max_step_tokens=chunk or long_len + 64)
    gaps: list[tuple[float, float]] = []  # (when the token arrived, time since the stream's previous token)
    p = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    handles = [engine.submit(filler(engine, 24, 10 + i), p) for i in range(streams)]

    def watch(h):
        last = None
        for _ in h:
            now = time.perf_counter()
            if last is not None:
                gaps.append((now, now - last))
            last = now

    threads = [threading.Thread(target=watch, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    time.sleep(1.0)  # streams are decoding
    t0 = time.perf_counter()
    long_ttft, _ = ttft(engine, filler(engine, long_len, 99))
    t1 = time.perf_counter()
    time.sleep(0.5)  # let the streams report the step that finished the long prompt
    for h in handles:
        h.cancel()
    for t in threads:
        t.join()
    engine.close()
    during = [g for when, g in gaps if t0 < when <= t1 + 0.25]
    return dict(chunk=chunk, long_ttft=long_ttft, tpot_median=statistics.median(during or [0]),
                tpot_max=max(during or [0]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default=None)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--attention-only", action="store_true", help="only the attention table (no model load)")
    ap.add_argument("--table-tokens", type=int, default=0,
                    help="attention table: page tables this many tokens wide, as a CUDA graph's")
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="attention table: a prefill chunk of this many query rows a sequence (after a cached prefix)")
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.attention_only:
        from localpd.load.synthetic import SYNTHETIC

        dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        config = SYNTHETIC[args.model.removeprefix("synthetic:")]
        bench_attention(config, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, contexts, args.batch,
                        args.reps, args.table_tokens, args.prefill_chunk)
        return
    engine = Engine(args.model, device=args.device, max_context=args.prefix + 64)
    bench_prefix(engine, args.prefix)
    bench_attention(engine.config, engine.device, engine.compute_dtype, contexts, args.batch, args.reps)
    engine.close()
    print(f"\n## {args.streams} decoding streams while a {args.long}-token prompt is admitted")
    print("| prefill | long prompt TTFT | stream TPOT median | stream TPOT max |")
    print("|---|---|---|---|")
    for chunk in (None, 512, 128):
        r = bench_admission(args.model, args.device, args.long, args.streams, chunk)
        name = "one step" if chunk is None else f"chunks of {chunk}"
        print(f"| {name} | {r['long_ttft'] * 1000:.0f} ms | {r['tpot_median'] * 1000:.1f} ms | "
              f"{r['tpot_max'] * 1000:.1f} ms |")


if __name__ == "__main__":
    main()
