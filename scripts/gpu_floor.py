"""What a launch costs in a CUDA graph beyond its bytes, on a GPU: the floor in `localpd bench kernels --predict`'s
model (measure/predict.py: LAUNCH_US plus ROUND_TRIP_US for each round trip a program waits on in turn, fitted to
this script's first run on an H100) measured directly.

Times, as CUDA-graph replays of back-to-back launches (measure/bench_kernels.graph_time): an empty Triton kernel of
one program and of 1-16 programs an SM (the model's launch cost is a line between one and 8 an SM), and the
integer GEMV (kernels/gemv_dp4a.py, its activations already rounded, the tile the model launches) at one row over shapes from a few hundred KB of weights to Llama-3-8B's o, qkv and
down, the same over strips (kernels/gemv_strip.py: all of K a program, no split-K reduction), then one column
tile and o's shape at 1-32 slices of K (split-K) on one tile; weights rotated through copies
larger than L2; each with programmatic dependent launch on and off
(kernels/pdl.py). Prints us a launch, the weights' time at the measured copy bandwidth, and the rest: what a
launch costs that its bytes do not explain.

    python scripts/gpu_floor.py [--json FILE]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localpd.kernels import gemv_dp4a as dp, gemv_strip as gs
from localpd.kernels import pdl
from localpd.kernels.act_round import quantize_act
from localpd.measure.bench_kernels import gpu_script, graph_time, kmajor_copies, write_rows
from localpd.quant.kmajor import to_strips

GEMVS = [("int4-g128", 128, 4096), ("int4-g128", 1024, 4096), ("int4-g128", 4096, 4096), ("int4-g128", 6144, 4096),
         ("int4-g128", 4096, 14336), ("int8", 4096, 4096)]
# one column tile (128 outputs) of 4096 inputs, 32 trips of 4 blocks, cut into 1-32 slices of K: one slice walks
# the 32 trips in turn, 32 slices take one trip each and the last of them sums 32 partials (the chain of trips
# against the chain of the split-K reduction); o's shape at 1-32 slices too
SPLITS = [("int4-g128", 128, 4096, k) for k in (1, 2, 4, 8, 16, 32)] + \
         [("int4-g128", 4096, 4096, k) for k in (1, 4, 8, 32)]
SPLIT_TILE = dict(blocks=4, num_warps=4, PREFETCH=1)


@triton.jit
def _empty_kernel(x, PDL: tl.constexpr):
    pdl.wait_prior(PDL)
    if tl.program_id(0) < 0:  # never: the kernel touches nothing
        tl.store(x, 0.0)


@torch.inference_mode()
def main() -> int:
    args, dev, bw = gpu_script(__doc__)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    x = torch.empty(1, device=dev)
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s, {sms} SMs; us a launch in a "
          f"CUDA graph of back-to-back launches")
    print("| launch | weight bytes | bytes' time at copy bw | PDL off: us (rest) | PDL on: us (rest) |")
    print("|---|---|---|---|---|")
    out = []

    def gemv(fmt, n, k, split=None, tile=None, strips=False):  # (weight bytes, a launch over each weight copy)
        ws = kmajor_copies(fmt, n, k, dev)
        q, s = quantize_act(torch.randn(1, k, device=dev, dtype=torch.bfloat16), ws[0].BITS)
        y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        if strips:
            ws = [to_strips(w) for w in ws]
            return ws[0].nbytes, [lambda w=w: gs.gemv_strip_rounded(q, s, y, w.words, w.factors, w.BITS, w.group,
                                                                    tile=tile) for w in ws]
        return ws[0].nbytes, [lambda w=w: dp.gemv_rounded(q, s, y, w.words, w.factors, w.BITS, w.group, split_k=split,
                                                           tile=tile) for w in ws]

    launches = [(f"empty kernel, {g} program(s)", 0, [lambda g=g: _empty_kernel[(g,)](x, **pdl.launch_args(x))], 400)
                for g in (1, sms, 2 * sms, 4 * sms, 8 * sms, 16 * sms)]  # predict.launch_us's line between 1 and 8 an SM
    launches += [(f"GEMV {fmt} {n}x{k}", *gemv(fmt, n, k), 200) for fmt, n, k in GEMVS]
    launches += [(f"GEMV {fmt} {n}x{k} in strips", *gemv(fmt, n, k, strips=True), 200) for fmt, n, k in GEMVS]
    launches += [(f"GEMV {fmt} {n}x{k} in strips, programs of 4 outputs", *gemv(fmt, n, k, tile=gs.DEFAULT_TILE,
                                                                              strips=True), 200) for fmt, n, k in GEMVS]
    launches += [(f"GEMV {fmt} {n}x{k}, {split} slice(s) of K, b4 w4 pf1", *gemv(fmt, n, k, split, SPLIT_TILE), 200)
                 for fmt, n, k, split in SPLITS]
    for label, nbytes, fns, reps in launches:
        times = []
        for on in (False, True):  # every launch reads pdl.ENABLED (kernels/pdl.py's launch_args)
            pdl.ENABLED = on
            times.append(graph_time(fns, reps=reps))
        pdl.ENABLED = True
        ideal = nbytes / bw
        print(f"| {label} | {nbytes / 1e6:.2f} MB | {ideal * 1e6:.2f} us | " +
              " | ".join(f"{t * 1e6:.2f} ({(t - ideal) * 1e6:.2f})" for t in times) + " |")
        out.append(dict(launch=label, bytes=nbytes, seconds_pdl_off=times[0], seconds_pdl_on=times[1]))
    write_rows(args.json, bw, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
