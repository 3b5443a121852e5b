"""`localpd bench`: prefill and decode speed beside the device's ceilings, over prompt lengths and batch sizes.

Each sweep point submits `batch` requests of random token ids at once (so nothing comes from the prefix cache),
greedy, ignoring EOS, and reads the engine's own step accounting: bytes and FLOPs of every step, and its time.
MBU = decode bytes / decode time / bandwidth; MFU = prefill FLOPs / prefill time / peak FLOP/s, with the steps'
device time (CUDA events on a GPU: what the kernels achieve). Decode tok/s is over the steps' wall time (Python,
sampling and detokenizing included: what a user gets); on a CPU the two clocks are the same.
"""

from __future__ import annotations

import json
import resource
import threading
import time
from dataclasses import asdict, dataclass

import torch

from localpd.measure.device import DeviceInfo, cache_note, describe, device_info
from localpd.engine import Engine
from localpd.engine.requests import StepStats
from localpd.measure.roofline import step_cost, utilisation
from localpd.quant.schemes import default_scheme
from localpd.engine.sampling import SamplingParams


@dataclass
class Point:
    prompt_len: int
    batch: int
    gen_len: int
    ttft_ms: float
    prefill_tps: float
    prefill_mfu: float | None
    prefill_flops_per_byte: float
    prefill_flops_per_s: float
    decode_tps: float  # all sequences together
    decode_bytes_per_s: float
    decode_mbu: float | None  # against the measured bandwidth (else the datasheet)
    decode_mbu_peak: float | None  # against the datasheet
    decode_flops_per_byte: float
    decode_flops_per_s: float
    ceiling_tps: float | None
    peak_memory_mb: float
    note: str = ""  # why the point was skipped
    tokens_per_pass: float = 1.0  # decode tokens written per step (above 1 with speculative decoding)
    acceptance: float | None = None  # share of drafted tokens confirmed (None: nothing drafted)

    @classmethod
    def skipped(cls, prompt_len: int, batch: int, gen_len: int, note: str) -> Point:
        return cls(prompt_len, batch, gen_len, 0, 0, None, 0, 0, 0, 0, None, None, 0, 0, None, 0, note)


def run_point(engine: Engine, info: DeviceInfo, prompt_len: int, batch: int, gen_len: int, seed: int) -> Point:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    handles = [engine.submit(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
               for _ in range(batch)]
    steps: dict[int, StepStats] = {}
    lock = threading.Lock()

    def drain(h):
        for event in h:
            if event.stats is not None:
                with lock:
                    steps[id(event.stats)] = event.stats

    threads = [threading.Thread(target=drain, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h in handles:  # a long prompt's chunks before its last one reach no event
        steps.update((id(s), s) for s in h.stats.prefill_steps)
    prefill = [s for s in steps.values() if s.phase != "decode"]
    decode = [s for s in steps.values() if s.phase == "decode"]

    def totals(ss):  # a decode step's tokens are those it wrote (a verified draft's confirmed ones counted)
        return (sum(s.bytes for s in ss), sum(s.flops for s in ss), sum(s.seconds for s in ss),
                sum(s.written for s in ss))

    pb, pf, ps, _ = totals(prefill)
    db, df, ds, dt = totals(decode)
    decode_wall = sum(s.wall_seconds or s.seconds for s in decode)
    bw = info.bandwidth
    mid = prompt_len + gen_len // 2
    one_step = step_cost(engine.model, [(mid, 1)] * batch, engine.kv_traffic, batch).bytes
    if engine.device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated(engine.device) / 2**20
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return Point(
        prompt_len, batch, gen_len,
        ttft_ms=1000 * sum(h.stats.ttft for h in handles) / batch,
        prefill_tps=batch * prompt_len / ps if ps else 0.0,
        prefill_mfu=utilisation(pf, ps, info.peak_flops),
        prefill_flops_per_byte=pf / pb if pb else 0.0, prefill_flops_per_s=pf / ps if ps else 0.0,
        decode_tps=dt / decode_wall if decode_wall else 0.0, decode_bytes_per_s=db / ds if ds else 0.0,
        decode_mbu=utilisation(db, ds, bw), decode_mbu_peak=utilisation(db, ds, info.peak_bandwidth),
        decode_flops_per_byte=df / db if db else 0.0, decode_flops_per_s=df / ds if ds else 0.0,
        ceiling_tps=batch * bw / one_step if bw else None, peak_memory_mb=peak_mem,
        # a sequence's tokens a pass over the weights: a chain's passes each, steps of fewer sequences as they are
        tokens_per_pass=dt / sum(s.passes * s.batch for s in decode) if decode else 1.0,
        acceptance=sum(s.accepted for s in decode) / drafted if (drafted := sum(s.drafted for s in decode)) else None)


def fmt(x, spec=".1f", scale=1.0, suffix=""):
    return "—" if x is None else f"{x * scale:{spec}}{suffix}"


def print_table(points: list[Point]) -> None:
    head = ("prompt", "batch", "TTFT ms", "prefill tok/s", "MFU", "decode tok/s", "GB/s", "MBU", "MBU(peak)",
            "ceiling tok/s", "tok/pass", "accepted", "peak MiB")
    rows = [head]
    for p in points:
        if p.note:
            rows.append((str(p.prompt_len), str(p.batch), p.note) + ("",) * (len(head) - 3))
            continue
        rows.append((str(p.prompt_len), str(p.batch), fmt(p.ttft_ms), fmt(p.prefill_tps), fmt(p.prefill_mfu, ".1%"),
                     fmt(p.decode_tps), fmt(p.decode_bytes_per_s, ".1f", 1e-9), fmt(p.decode_mbu, ".1%"),
                     fmt(p.decode_mbu_peak, ".1%"), fmt(p.ceiling_tps), fmt(p.tokens_per_pass, ".2f"),
                     fmt(p.acceptance, ".0%"), fmt(p.peak_memory_mb, ".0f")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def plot(points: list[Point], info: DeviceInfo, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [x for p in points if not p.note for x in (p.prefill_flops_per_byte, p.decode_flops_per_byte) if x > 0]
    lo, hi = min(xs + [0.5]) / 2, max(xs + [1000]) * 2
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for bw, style, label in ((info.measured_bandwidth, "-", "measured"), (info.peak_bandwidth, "--", "datasheet")):
        if bw:
            roof = [min(bw * x, info.peak_flops or float("inf")) for x in grid]
            ax.plot(grid, roof, style, color="gray", label=f"{label} {bw / 1e9:.0f} GB/s")
    for p in points:
        if p.note:
            continue
        ax.scatter(p.prefill_flops_per_byte, p.prefill_flops_per_s, marker="o", color="tab:blue")
        ax.scatter(p.decode_flops_per_byte, p.decode_flops_per_s, marker="s", color="tab:orange")
        ax.annotate(f"P{p.prompt_len}xB{p.batch}", (p.prefill_flops_per_byte, p.prefill_flops_per_s), fontsize=7)
        ax.annotate(f"D B{p.batch}", (p.decode_flops_per_byte, p.decode_flops_per_s), fontsize=7)
    ax.scatter([], [], marker="o", color="tab:blue", label="prefill")
    ax.scatter([], [], marker="s", color="tab:orange", label="decode")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attained FLOP/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fits(args, engine_name: str, device: torch.device) -> str:
    """'' when the synthetic weights fit the device's free memory, else why not."""
    if not args.synthetic:
        return ""
    from localpd.load.synthetic import synthetic_nbytes

    need = synthetic_nbytes(args.synthetic, args.quant or default_scheme(device))
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import os

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.8 * free:
        return f"{engine_name} needs {need / 2**30:.1f} GiB of weights, {free / 2**30:.1f} GiB free: skipped"
    return ""


def run(args, build_engine) -> int:
    """`localpd bench`: build_engine(args, model, **options) is the command line's one Engine builder
    (cli.engine_args.engine_from_args), handed in so that measure/ does not reach up into cli/."""
    prompts = [int(x) for x in str(args.prompt_len).split(",")]
    batches = [int(x) for x in str(args.batch).split(",")]
    name = f"synthetic:{args.synthetic}" if args.synthetic else (args.model or "smollm2-135m")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    skip = fits(args, name, device)
    if skip:
        print(skip)
        return 0
    longest = max(prompts) + args.gen_len + 1
    context = max(longest, 256)
    engine = build_engine(args, name, device=str(device), max_context=context,
                          kv_tokens=None if device.type == "cuda" else max(batches) * context)
    info = device_info(engine.device)
    print(f"# {engine.name} | weights {engine.quant} ({engine.model.weight_bytes / 2**20:.0f} MiB per decode step) | "
          f"kv {engine.kv_dtype} | {describe(info)}")
    for note in engine.notes + [cache_note(engine.model.weight_bytes, info)]:
        if note:
            print(f"# {note}")
    points = []
    try:
        run_point(engine, info, min(prompts), 1, 2, seed=0)  # warm-up: first-call costs stay out of the table
        for i, (pl, b) in enumerate((pl, b) for pl in prompts for b in batches):
            need = b * (pl + args.gen_len)
            if need > engine.pages.n_pages * engine.pages.page_size:
                points.append(Point.skipped(pl, b, args.gen_len, f"skipped: {need} tokens exceed the KV cache"))
                continue
            points.append(run_point(engine, info, pl, b, args.gen_len, seed=i + 1))
    finally:
        engine.close()
    print_table(points)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": engine.name, "quant": engine.quant, "kv": engine.kv_dtype, "device": asdict(info),
                       "time": time.strftime("%Y-%m-%d %H:%M:%S"), "points": [asdict(p) for p in points]}, f, indent=1)
    if args.plot:
        plot(points, info, args.plot, f"{engine.name} {engine.quant} kv {engine.kv_dtype} on {info.name}")
        print(f"roofline plot: {args.plot}")
    return 0


def add_arguments(p) -> None:
    from localpd.load.synthetic import SYNTHETIC

    p.add_argument("model", nargs="?", help="registry name, .gguf file or model directory (default: smollm2-135m)")
    p.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="random weights of a real model's shapes")
    p.add_argument("--prompt-len", default="128,512", help="comma-separated prompt lengths (default 128,512)")
    p.add_argument("--gen-len", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (default 1)")
    p.add_argument("--json", help="write the table as JSON")
    p.add_argument("--plot", help="draw the roofline plot into this PNG")
