"""`localpd bench kernels`: our W4A16/W8A16 matmuls beside torch bf16, torch's int4 tinygemm and bitsandbytes NF4,
on Llama-3-8B shapes, in one run: time, achieved GB/s and % of the measured copy bandwidth, plus a correctness
check of each of our kernels against its torch reference on the same shapes.

Without a GPU it runs the torch references on shapes scaled down 16x and says so: the numbers then only show
that the command works.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from localpd.device import device_info, measure_copy_bandwidth
from localpd.kernels.dispatch import int4_matmul_ref, int8_matmul_ref, linear_int4, linear_int8
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


def timer(device: torch.device):
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50) / 1000  # flushes L2 between runs

    def cpu(fn):
        fn()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    return cpu


def tinygemm(w_dense: torch.Tensor, group: int):
    """torch's int4 kernel (gpt-fast's): packing API differs across torch versions, tried in turn."""
    n, k = w_dense.shape
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=w_dense.device)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), 8)
    except RuntimeError:
        packed = torch.ops.aten._convert_weight_to_int4pack(q, 8)
    sz = torch.rand(k // group, n, 2, device=w_dense.device, dtype=torch.bfloat16) * 0.01
    nbytes = n * k // 2 + sz.numel() * 2
    return (lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, group, sz)), nbytes


def bnb_nf4(w_dense: torch.Tensor):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    wq, state = bf.quantize_4bit(w_dense, quant_type="nf4")
    nbytes = wq.numel() * wq.element_size() + state.absmax.numel() * state.absmax.element_size()
    return (lambda x: bnb.matmul_4bit(x, wq.t(), quant_state=state)), nbytes


def run(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    scale = 1 if gpu else 16
    ms = [int(m) for m in args.m.split(",")] if args.m else (MS if gpu else (1, 16))
    dtype = torch.bfloat16 if gpu else torch.float32
    copy_bw = measure_copy_bandwidth(device, (1 << 30) if gpu else (1 << 27))
    info = device_info(device, measure=False)
    print(f"# {info.name}: measured copy bandwidth {copy_bw / 1e9:.0f} GB/s"
          + ("" if gpu else " | no GPU: CPU torch reference timings on shapes / 16, not kernel numbers"))
    bench = timer(device)
    rows = []
    for name, n, k in SHAPES:
        n, k = n // scale, k // scale
        w_dense = (torch.randn(n, k, device=device) * 0.02).to(dtype)
        ours = {"int4-g128": random_int4(n, k, 128, device), "int4-g32": random_int4(n, k, 32, device),
                "int8": random_int8(n, k, device)}
        errors = {}
        for label, w in ours.items():  # correctness against the reference on this shape, same run
            x = torch.randn(max(ms), k, device=device, dtype=dtype)
            if isinstance(w, Int4Weight):
                got, ref = linear_int4(x, w), int4_matmul_ref(x, w.packed, w.scales, w.biases, w.group)
            else:
                got, ref = linear_int8(x, w), int8_matmul_ref(x, w.data, w.scales, w.group)
            errors[label] = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        dense = "torch bf16" if gpu else "torch fp32"
        peers = {dense: ((lambda x: torch.nn.functional.linear(x, w_dense)), n * k * w_dense.element_size())}
        for label, make in (("tinygemm int4-g128", lambda: tinygemm(w_dense, 128)), ("bnb nf4", lambda: bnb_nf4(w_dense))):
            if not gpu:
                peers[label] = (None, "n/a (GPU only)")
                continue
            try:
                peers[label] = make()
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                peers[label] = (None, f"n/a ({type(e).__name__}: {str(e)[:60]})")
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=dtype)
            io = (m * k + m * n) * x.element_size()
            cells = {}
            for label, w in ours.items():
                fn = (lambda w=w: linear_int4(x, w)) if isinstance(w, Int4Weight) else (lambda w=w: linear_int8(x, w))
                cells[label] = (bench(fn), w.nbytes + io)
            for label, (fn, nbytes) in peers.items():
                if fn is None:
                    cells[label] = nbytes
                    continue
                try:
                    cells[label] = (bench(lambda fn=fn: fn(x)), nbytes + io)
                except Exception as e:  # noqa: BLE001
                    cells[label] = f"n/a ({type(e).__name__})"
            rows.append({"shape": name, "n": n, "k": k, "m": m, "cells": cells, "rel_err": errors})
            print_row(rows[-1], copy_bw)
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
    p.add_argument("--json", help="write the rows as JSON")
    return run(p.parse_args(argv))
