"""`localpd bench kernels`: our W4A16/W8A16 matmuls beside torch bf16, torch's int4 tinygemm and bitsandbytes NF4,
on Llama-3-8B shapes, in one run: time, achieved GB/s and % of the measured copy bandwidth, plus a correctness
check of each of our kernels against its torch reference on the same shapes. On a GPU every kernel is timed as
CUDA-graph replays (decode runs as a graph, so Python launch overhead is left out, for peers alike) over enough
weight copies that none is read from L2.

Without a GPU it runs the torch references on shapes scaled down 16x and says so: the numbers then only show
that the command works.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from localpd.errors import LocalpdError
from localpd.load.synthetic import SYNTHETIC
from localpd.measure.device import device_info, measure_copy_bandwidth
from localpd.kernels import cpu
from localpd.kernels import tinygemm as tinygemm_table
from localpd.kernels.dispatch import int4_matmul_ref, int8_matmul_ref, kmajor_matmul_ref, linear_int4, linear_int8
from localpd.model.linear import KERNELS
from localpd.quant.kmajor import KMajorWeight, KStripWeight, to_kmajor, to_strips
from localpd.quant.tinygemm import tinygemm_matmul, to_tinygemm
from localpd.quant.weights import Int4Weight, Int8Weight

# Llama-3-8B: (name, N, K) with q/k/v and gate/up fused as localpd runs them
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]
MS = (1, 4, 16, 512)


def random_int4(n: int, k: int, group: int, device) -> Int4Weight:
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device)
    scales = (torch.rand(n, k // group, device=device) * 0.002 + 0.001).half()
    return Int4Weight(packed, scales, (-7.5 * scales.float()).half())


def random_int8(n: int, k: int, device) -> Int8Weight:
    data = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    return Int8Weight(data, (torch.rand(n, 1, device=device) * 0.001 + 0.0005).half())


def kmajor_copies(fmt: str, n: int, k: int, device) -> list[KMajorWeight]:
    """Random [n, k] weights of fmt ("int4-g128" or "int8") in the GPU's K-major layout, as many copies as keep a
    launch's weights out of L2 (copies_for)."""
    def make():
        return to_kmajor(random_int4(n, k, 128, device) if fmt == "int4-g128" else random_int8(n, k, device))

    first = make()
    return [first] + [make() for _ in range(copies_for(first.nbytes, device) - 1)]


def copies_for(nbytes: int, device: torch.device) -> int:
    """Weight copies to rotate through so that no timed launch finds its weights in L2 (2x the L2 size)."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, -(-2 * l2 // nbytes))


def graph_time(fns: list, reps: int = 20) -> float:
    """Seconds per call of fns (one per weight copy, called in turn), timed as CUDA-graph replays so that Python
    launch overhead is not counted (decode runs as a graph); falls back to events around eager calls when a
    function cannot be captured."""
    for fn in fns:  # compile and autotune outside the capture
        fn()
    torch.cuda.synchronize()
    calls = max(len(fns), reps)
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            for i in range(calls):
                fns[i % len(fns)]()
        run = graph.replay
    except Exception:  # noqa: BLE001 - not capturable: time eager calls (launch overhead included)
        torch.cuda.synchronize()

        def run():
            for i in range(calls):
                fns[i % len(fns)]()
    run()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def gpu_script(doc: str, add_options=None) -> tuple[argparse.Namespace, torch.device, float]:
    """A GPU benchmark script's start (scripts/sweep_*.py, bench_dp4a.py): its options (--json, and what
    add_options adds to the parser) parsed, the CUDA device, its copy bandwidth measured (bytes/s)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--json", help="write every timing here")
    if add_options:
        add_options(p)
    args = p.parse_args()
    dev = torch.device("cuda")
    return args, dev, measure_copy_bandwidth(dev, 1 << 30)


def write_rows(path: str | None, copy_bw: float, rows: list) -> None:
    """A GPU benchmark script's rows as JSON, with the device and its copy bandwidth (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth": copy_bw, "rows": rows}, f, indent=1)


def cpu_time(fns: list) -> float:
    fns[0]()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fns[0]()
        best = min(best, time.perf_counter() - t0)
    return best


def tinygemm(w_dense: torch.Tensor, group: int):
    """torch's int4 kernel (gpt-fast's) over random int4 codes of w_dense's shape, held as a model holds its
    fallback (quant/tinygemm.py)."""
    n, k = w_dense.shape
    w = to_tinygemm(random_int4(n, k, group, w_dense.device), torch.bfloat16)
    return (lambda x: tinygemm_matmul(x, w)), w.nbytes


def bnb_nf4(w_dense: torch.Tensor):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    wq, state = bf.quantize_4bit(w_dense, quant_type="nf4")
    nbytes = wq.numel() * wq.element_size() + state.absmax.numel() * state.absmax.element_size()
    return (lambda x: bnb.matmul_4bit(x, wq.t(), quant_state=state)), nbytes


def run(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    if args.tinygemm_table and not gpu:
        raise LocalpdError("--tinygemm-table needs a GPU: it records where tinygemm ran faster on that card")
    scale = 1 if gpu else 16
    ms = [int(m) for m in args.m.split(",")] if args.m else (MS if gpu else (1, 16))
    dtype = torch.bfloat16 if gpu else torch.float32
    copy_bw = measure_copy_bandwidth(device, (1 << 30) if gpu else (1 << 27))
    info = device_info(device, measure=False)
    print(f"# {info.name}: measured copy bandwidth {copy_bw / 1e9:.0f} GB/s"
          + ("" if gpu else f" | no GPU: the CPU's products on shapes / 16 ({cpu.describe()})"))
    bench = graph_time if gpu else cpu_time
    rows = []
    for name, n, k in SHAPES:
        n, k = n // scale, k // scale
        w_dense = (torch.randn(n, k, device=device) * 0.02).to(dtype)
        makers = {"int4-g128": lambda: random_int4(n, k, 128, device),
                  "int4-g32": lambda: random_int4(n, k, 32, device), "int8": lambda: random_int8(n, k, device)}
        if gpu:  # the layout the model runs on a GPU (quant/kmajor.py); on the CPU its reference alone
            makers.update({"int4-g128 K-major": lambda: to_kmajor(random_int4(n, k, 128, device)),
                           "int8 K-major": lambda: to_kmajor(random_int8(n, k, device)),
                           "int4-g128 strips": lambda: to_strips(random_int4(n, k, 128, device)),
                           "int8 strips": lambda: to_strips(random_int8(n, k, device))})
        if args.formats:
            makers = {label: make for label, make in makers.items() if label in args.formats.split(",")}
        ours = {}
        for label, make in makers.items():
            first = make()
            ours[label] = [first] + [make() for _ in range(copies_for(first.nbytes, device) - 1)]
        errors = {}
        for label, ws in ours.items():  # correctness against the reference on this shape, same run
            w = ws[0]
            x = torch.randn(max(ms), k, device=device, dtype=dtype)
            if isinstance(w, (KMajorWeight, KStripWeight)):
                got, ref = KERNELS[type(w)].linear(x, w), kmajor_matmul_ref(x, w)
            elif isinstance(w, Int4Weight):
                got, ref = linear_int4(x, w), int4_matmul_ref(x, w.packed, w.scales, w.biases, w.group)
            else:
                got, ref = linear_int8(x, w), int8_matmul_ref(x, w.data, w.scales, w.group)
            errors[label] = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        if gpu:  # the fallback's layout (quant/tinygemm.py) against the int4 weight it was made from
            w, x = random_int4(n, k, 128, device), torch.randn(max(ms), k, device=device, dtype=dtype)
            got, ref = tinygemm_matmul(x, to_tinygemm(w, dtype)), int4_matmul_ref(x, w.packed, w.scales, w.biases, 128)
            errors["tinygemm"] = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        dense = "torch bf16" if gpu else "torch fp32"
        dense_ws = [w_dense] + [w_dense.clone() for _ in range(copies_for(w_dense.nbytes, device) - 1)]
        peers = {dense: ([lambda x, w=w: torch.nn.functional.linear(x, w) for w in dense_ws], w_dense.nbytes)}
        for label, make in (("tinygemm int4-g128", lambda: tinygemm(w_dense, 128)),
                            ("bnb nf4", lambda: bnb_nf4(w_dense))):
            if not gpu:
                peers[label] = (None, "n/a (GPU only)")
                continue
            try:
                fn, nbytes = make()
                peers[label] = ([fn] + [make()[0] for _ in range(copies_for(nbytes, device) - 1)], nbytes)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                peers[label] = (None, f"n/a ({type(e).__name__}: {str(e)[:60]})")
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=dtype)
            io = (m * k + m * n) * x.element_size()
            cells = {}
            for label, ws in ours.items():
                linear = KERNELS[type(ws[0])].linear  # the model's product for the format
                cells[label] = (bench([lambda w=w: linear(x, w) for w in ws]), ws[0].nbytes + io)
            for label, (fns, nbytes) in peers.items():
                if fns is None:
                    cells[label] = nbytes
                    continue
                try:
                    cells[label] = (bench([lambda fn=fn: fn(x) for fn in fns]), nbytes + io)
                except Exception as e:  # noqa: BLE001
                    cells[label] = f"n/a ({type(e).__name__})"
            rows.append({"shape": name, "n": n, "k": k, "m": m, "cells": cells, "rel_err": errors})
            print_row(rows[-1], copy_bw)
    if args.tinygemm_table:
        entries = tinygemm_table.wins(rows)
        tinygemm_table.write(Path(args.tinygemm_table), info.name, entries)
        print(f"# {args.tinygemm_table}: on {info.name} tinygemm measured faster than "
              + ("; ".join(f"{g}: {', '.join(e)}" for g, e in entries.items()) or "neither GEMV on any shape"))
    if args.json:
        out = [{**r, "cells": {k: (list(v) if isinstance(v, tuple) else v) for k, v in r["cells"].items()}}
               for r in rows]
        with open(args.json, "w") as f:
            json.dump({"device": info.name, "copy_bandwidth": copy_bw, "gpu": gpu, "rows": out}, f, indent=1)
    return 0


def print_row(r: dict, copy_bw: float) -> None:
    parts = []
    for label, cell in r["cells"].items():
        if isinstance(cell, str):
            parts.append(f"{label}: {cell}")
        else:
            seconds, nbytes = cell
            gbs = nbytes / seconds
            parts.append(f"{label}: {seconds * 1e6:.1f} us {gbs / 1e9:.0f} GB/s ({gbs / copy_bw:.0%})")
    err = " ".join(f"{k} {v:.1e}" for k, v in r["rel_err"].items())
    print(f"{r['shape']:>8} N={r['n']} K={r['k']} M={r['m']:<4} | " + " | ".join(parts) + f" | rel err vs ref: {err}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="localpd bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--m", help="comma-separated batch rows (default 1,4,16,512 on a GPU)")
    p.add_argument("--formats", help="comma-separated formats of ours to time (default all: int4-g128, int4-g32, "
                   "int8, and on a GPU int4-g128 K-major, int8 K-major)")
    p.add_argument("--json", help="write the rows as JSON")
    p.add_argument("--tinygemm-table", metavar="PATH",
                   help="on a GPU: write this card's shapes where tinygemm ran faster than our GEMVs into the table at "
                   "PATH (kernels/tinygemm_faster.json is the model's: kernels/tinygemm.py)")
    p.add_argument("--predict", action="store_true",
                   help="no timing: compile the model's batch-1 decode GEMVs for each card and predict their share "
                   "of copy bandwidth from the compiled code (no GPU needed; measure/predict.py)")
    p.add_argument("--model", choices=sorted(SYNTHETIC), metavar="MODEL",
                   help="with --predict: the synthetic model's shapes (default llama3-8b; one of %(choices)s)")
    p.add_argument("--cards", help="with --predict: comma-separated card names (default: H100 SXM, H200, RTX 4090)")
    p.add_argument("--kernels", help="with --predict: comma-separated of dp4a, kmajor, dp4a-staged (the integer GEMV "
                   "with its loads staged through shared memory, STAGES 3; default: dp4a,kmajor)")
    p.add_argument("--attention", action="store_true",
                   help="with --predict: decode attention over paged KV per format at 4k and 32k tokens, not the "
                   "GEMVs (measure/predict_attention.py)")
    p.add_argument("--kv", help="with --predict --attention: comma-separated KV formats (default bf16,int8,fp8,int4,"
                   "int8/int4)")
    p.add_argument("--step", action="store_true",
                   help="with --predict: a whole decode token (GEMVs, attention, the small launches) and its MBU "
                   "(measure/predict_step.py)")
    p.add_argument("--context", help="with --predict --step: comma-separated context lengths (default 128,4096)")
    args = p.parse_args(argv)
    if args.predict and args.step:
        from localpd.measure import predict_step

        try:
            return predict_step.run(args)
        except LocalpdError as e:
            print(f"localpd: error: {e}", file=sys.stderr)
            return 1
    if args.predict and args.attention:
        from localpd.measure import predict_attention

        return predict_attention.run(args)
    if args.predict:
        from localpd.measure import predict

        return predict.run(args)
    try:
        return run(args)
    except LocalpdError as e:
        print(f"localpd: error: {e}", file=sys.stderr)
        return 1
