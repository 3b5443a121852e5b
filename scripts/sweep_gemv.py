"""Sweep the GEMV kernel's launch configurations on a GPU: every (BLOCK_N, BLOCK_K, num_warps, num_stages,
split-K) for Llama-3-8B's decode shapes at M = 1 (and --m), timed as CUDA-graph replays over weight copies larger
than L2, beside what quant_matmul's autotuner picks, and the experimental tensor-core GEMV (gemv_mma, any M).
Prints the best configurations per shape with % of the measured copy bandwidth and the best one's time with the
RMSNorm prologue (quant_matmul's norm, which the tuned table launches with the same tile), checks the best ones
against the torch reference, and writes every timing as JSON. --table adds each shape's fastest row-major configuration
(where it beats the autotuner) to a table of measured configurations, which quant_matmul then launches without
autotuning (kernels/gemv_tuned.json is the one shipped).

    python scripts/sweep_gemv.py --json $OUT/sweep.json --table $OUT/gemv_tuned.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import subprocess
import time
from pathlib import Path

import torch

from localpd.measure.bench_kernels import SHAPES, copies_for, graph_time, random_int4, random_int8
from localpd.measure.device import measure_copy_bandwidth
from localpd.kernels.dispatch import (cdiv, device_key, gemv_block_m, gemv_tile_fits, int4_matmul_ref,
                                     int8_matmul_ref, linear_int4, linear_int8)
from localpd.kernels.gemv_mma import gemv_mma, mma_fits
from localpd.kernels.quant_matmul import _gemv_kernel, word_align
from localpd.quant.weights import Int4Weight

BLOCK_N = (16, 32, 64, 128, 256)
BLOCK_K = (128, 256, 512, 1024)
WARPS = (1, 2, 4, 8)
STAGES = (3,)  # 1 and 3 compile to the same GEMV loop (scripts/gemv_sass.py)
SPLITS = (1, 2, 4, 8, 16)
MMA_BLOCK_N, MMA_BLOCK_K, MMA_WARPS, MMA_SPLITS = (32, 64, 128), (128, 256), (4, 8), (1, 2, 4, 8)  # gemv_mma's grid


def launch(x, y, w, cfg, norm=None):
    """One launch of the row-major GEMV with cfg = (BLOCK_N, BLOCK_K, num_warps, num_stages, split-K); norm =
    (residual, norm weight, residual-sum output) times the RMSNorm prologue the model runs before qkv and gate_up."""
    bn, bk, warps, stages, split = cfg
    r, g, summed = norm or (x, x, x)
    m, k = x.shape
    if isinstance(w, Int4Weight):
        words, scales, biases, bits, group, has_bias = w.packed, w.scales, w.biases, 4, w.group, True
    else:
        words, scales, biases, bits, has_bias = w.data.view(torch.int32), w.scales, w.scales, 8, False
        group = w.group if w.group < k else 1 << 30
    n = words.shape[0]
    if split > 1:
        y.zero_()
    _gemv_kernel[(1, cdiv(n, bn), split)](x, y, m, n, k, x.stride(0), y.stride(0), words, scales, biases,
                                          words.stride(0), scales.stride(0), scales.shape[1], split,
                                          r, g, summed, r.stride(0), summed.stride(0), 1e-5, x, BITS=bits,
                                          GROUP=group, HAS_BIAS=has_bias, BLOCK_M=gemv_block_m(m), BLOCK_N=bn,
                                          BLOCK_K=bk,
                                          ATOMIC=split > 1, NORM=norm is not None, HAS_RES=norm is not None,
                                          WORD_ALIGN=word_align(words), num_warps=warps, num_stages=stages)


def mma(x, w, cfg):
    """One gemv_mma call with cfg = ("mma", BLOCK_N, BLOCK_K, num_warps, split-K)."""
    _, bn, bk, warps, split = cfg
    if isinstance(w, Int4Weight):
        return gemv_mma(x, w.packed, w.scales, w.biases, 4, w.group, block_n=bn, block_k=bk, split_k=split,
                        num_warps=warps)
    return gemv_mma(x, w.data.view(torch.int32), w.scales, None, 8, w.group, block_n=bn, block_k=bk,
                    split_k=split, num_warps=warps)


def rel(y, w, x, fmt) -> float:
    ref = (int4_matmul_ref(x, w.packed, w.scales, w.biases, w.group) if fmt.startswith("int4")
           else int8_matmul_ref(x, w.data, w.scales, w.group))
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--formats", default="int4-g128,int8")
    p.add_argument("--shapes", default="qkv,o,gate_up,down")
    p.add_argument("--no-mma", action="store_true", help="skip the experimental tensor-core GEMV")
    p.add_argument("--no-gemv", action="store_true", help="skip the GEMV's own grid (the autotuned row stays)")
    p.add_argument("--json")
    p.add_argument("--table", help="add the fastest configurations to this table of measured ones (JSON)")
    args = p.parse_args()
    dev = torch.device("cuda")
    copy_bw = measure_copy_bandwidth(dev, 1 << 30)
    print(f"# {torch.cuda.get_device_name(dev)}: copy bandwidth {copy_bw / 1e9:.0f} GB/s, M={args.m}")
    results, tuned = [], {}
    for fmt, (name, n, k) in itertools.product(args.formats.split(","), SHAPES):
        if name not in args.shapes.split(","):
            continue
        make = (lambda: random_int4(n, k, 128, dev)) if fmt == "int4-g128" else (lambda: random_int8(n, k, dev))
        ws = [make()]
        ws += [make() for _ in range(copies_for(ws[0].nbytes, dev) - 1)]
        bits = 4 if fmt.startswith("int4") else 8
        x = torch.randn(args.m, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(args.m, n, device=dev, dtype=torch.float32)
        nbytes = ws[0].nbytes + 2 * (args.m * k + args.m * n)
        linear = linear_int4 if fmt.startswith("int4") else linear_int8
        rows = [("autotuned default", graph_time([lambda w=w: linear(x, w) for w in ws]))]
        t0 = time.time()
        for cfg in itertools.product(BLOCK_N, BLOCK_K, WARPS, STAGES, SPLITS):
            bn, bk, warps, _, split = cfg
            if (args.no_gemv or not gemv_tile_fits(args.m, bn, bk, bits, warps) or cdiv(k, bk) < split
                    or (bk * bits // 32) % 4):
                continue
            try:
                rows.append((cfg, graph_time([lambda w=w, cfg=cfg: launch(x, y, w, cfg) for w in ws], reps=10)))
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:80]}")
        if not args.no_mma:
            for cfg in itertools.product(("mma",), MMA_BLOCK_N, MMA_BLOCK_K, MMA_WARPS, MMA_SPLITS):
                if not mma_fits(bits, ws[0].group, k, cfg[2]) or cdiv(k, cfg[2]) < cfg[4]:
                    continue
                try:
                    rows.append((cfg, graph_time([lambda w=w, cfg=cfg: mma(x, w, cfg) for w in ws], reps=10)))
                except Exception as e:  # noqa: BLE001
                    print(f"  {cfg}: {type(e).__name__}: {str(e)[:80]}")
            best_mma = min((r for r in rows if r[0][0] == "mma"), key=lambda r: r[1], default=None)
            if best_mma:
                print(f"  mma best {best_mma[0]} rel err {rel(mma(x, ws[0], best_mma[0]), ws[0], x, fmt):.1e}")
        rows.sort(key=lambda r: r[1])
        best = next((r for r in rows if r[0] != "autotuned default" and r[0][0] != "mma"), None)
        err = normed = None
        print(f"{fmt:>9} {name:>7} N={n} K={k}: {len(rows)} configs in {time.time() - t0:.0f} s")
        if best:
            launch(x, y, ws[0], best[0])
            err = rel(y, ws[0], x, fmt)
            # the same tile with the RMSNorm prologue (qkv and gate_up run it): what the fusion costs in the GEMV
            norm = (torch.randn_like(x), torch.ones(k, device=dev, dtype=x.dtype), torch.empty_like(x))
            normed = graph_time([lambda w=w: launch(x, y, w, best[0], norm) for w in ws], reps=10)
            print(f"    best GEMV tile: rel err {err:.1e}; with the RMSNorm prologue {normed * 1e6:.1f} us "
                  f"({normed / best[1]:.2f}x the plain GEMV)")
        for cfg, sec in rows[:6] + [r for r in rows if r[0] == "autotuned default"]:
            print(f"    {str(cfg):<28} {sec * 1e6:7.1f} us {nbytes / sec / 1e9:6.0f} GB/s "
                  f"({nbytes / sec / copy_bw:.0%})")
        results.append({"format": fmt, "shape": name, "n": n, "k": k, "m": args.m, "bytes": nbytes, "rel_err": err,
                        "normed_best": normed, "timings": [[str(c), s] for c, s in rows]})
        default = next(s for c, s in rows if c == "autotuned default")
        if best and best[1] < default and err < 1e-2:
            bn, bk, warps, stages, split = best[0]
            tuned[f"{bits}:{ws[0].group}:{n}:{k}:{gemv_block_m(args.m)}"] = dict(
                BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, split_k=split,
                us=round(best[1] * 1e6, 2), pct_copy=round(nbytes / best[1] / copy_bw, 3))
        del ws
        torch.cuda.empty_cache()
        # after every shape, so that a run stopped by its time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(dev), "copy_bandwidth": copy_bw, "results": results},
                          f)
        if args.table:
            write_table(Path(args.table), device_key(dev), tuned, torch.cuda.get_device_name(dev))
    return 0


def write_table(path: Path, key: str, tuned: dict, device_name: str) -> None:
    """Merge this run's configurations into the table under the device's key, with where and when measured."""
    table = json.loads(path.read_text()) if path.exists() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    source = f"{device_name}, {datetime.date.today()}, commit {commit or '?'}"
    table.setdefault(key, {}).update({shape: {**cfg, "measured": source} for shape, cfg in tuned.items()})
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{len(tuned)} configurations for {key} in {path}")


if __name__ == "__main__":
    raise SystemExit(main())
