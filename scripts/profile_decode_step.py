"""Where a batch-1 decode token's time goes on a GPU: the engine's wall clock per token, its steps' device time,
the decode graph replayed alone, and the graph's kernels one by one (torch.profiler over replays), one layer's
launches in order with their mean time over the layers and the weight bytes each product reads.

    python scripts/profile_decode_step.py [--model llama3-8b] [--quant int4-g128] [--context 128] [--steps 64]

Prints one table: the kernels of a layer in launch order (mean us over layers and replays, share of the replay),
then the kernels outside the layers (embedding, final norm, head, sampling's argmax), then the gaps: the replay's
time less the sum of its kernels' times (launch latency between dependent kernels; with programmatic dependent
launch a kernel's start overlaps its predecessor, so the sum can pass the replay).
"""

from __future__ import annotations

import argparse
import collections

import torch


def timed(obj, name: str, totals: dict) -> None:
    """Wrap obj.name so that its host seconds add up in totals[Class.name] (calls in totals[Class.name calls])."""
    import time

    fn, key = getattr(obj, name), f"{type(obj).__name__}.{name}"

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            totals[key] += time.perf_counter() - t0
            totals[key + " calls"] += 1

    setattr(obj, name, wrapper)


def short(name: str) -> str:
    return name.split("(")[0].replace("void ", "")[:60]


@torch.inference_mode()
def main() -> None:
    from localpd.engine import Engine
    from localpd.engine.sampling import SamplingParams
    from localpd.measure.device import measure_copy_bandwidth

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--quant", default="int4-g128")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--chain", type=int, default=None, help="decode steps a step chains (default: the engine's)")
    args = ap.parse_args()
    bw = measure_copy_bandwidth(torch.device("cuda"), 1 << 30)
    engine = Engine(f"synthetic:{args.model}", device="cuda", quant=args.quant,
                    max_context=args.context + args.steps + 16, kv_memory="2GiB", cuda_graphs=True,
                    decode_chain=args.chain)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
        vocab = engine.config.vocab_size
        list(engine.submit(torch.randint(0, vocab, (args.context,)).tolist(), params))  # compiles, captures
        totals = collections.defaultdict(float)
        for obj, name in ((engine, "_step"), (engine.scheduler, "step"), (engine.runner, "run"),
                          (engine.graphs, "_fill"), (engine.graphs, "run"), (engine.graphs, "run_chain"),
                          (engine.runner, "_sample"),
                          (engine.output, "process")):
            timed(obj, name, totals)
        h = engine.submit(torch.randint(0, vocab, (args.context,)).tolist(), params)
        events = iter(h)
        next(events)  # the prefill step's token: the host times below are the decode steps'
        totals.clear()
        list(events)
        n = max(1, totals["ModelRunner.run calls"])
        print(f"host us a step ({int(n)} steps; ModelRunner.run holds DecodeGraphs.run and _sample, which waits "
              "for the replay): " + ", ".join(f"{k} {v / n * 1e6:.0f}" for k, v in totals.items()
                                               if not k.endswith("calls")))
        s = h.stats
        wall = s.decode_seconds / max(1, s.output_tokens - 1)
        dev = s.decode_step_seconds / max(1, s.decode_steps)
        nbytes = engine.model.weight_bytes
        print(f"# {torch.cuda.get_device_name()} | copy bandwidth {bw / 1e9:.0f} GB/s | {args.model} {args.quant} B=1 "
              f"| weights {nbytes / 1e9:.2f} GB a token")
        print(f"engine wall per token {wall * 1e3:.3f} ms ({1 / wall:.1f} tok/s, MBU {nbytes / wall / bw:.1%}); "
              f"steps' device time {dev * 1e3:.3f} ms ({1 / dev:.1f} tok/s); host share {(wall - dev) / wall:.1%}")
        graphs = engine.graphs
        graph = graphs.graphs[1, 1]  # one decode step (the reply's last steps, too few to chain, captured it)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(100):
            graph.replay()
        t1.record()
        t1.synchronize()
        rep = t0.elapsed_time(t1) / 1e3 / 100
        print(f"graph replay alone {rep * 1e3:.3f} ms ({1 / rep:.1f} tok/s, MBU {nbytes / rep / bw:.1%}); "
              f"host and sampling per token {(wall - rep) * 1e3:.3f} ms")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.replays):
                graph.replay()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                          and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()),
                         key=lambda e: e.time_range.start)
        per = len(kernels) // args.replays
        print(f"{len(kernels)} kernels in {args.replays} replays: {per} a replay")
        if per * args.replays != len(kernels) or per == 0:
            return
        layers = engine.config.n_layers
        step = kernels[:per]
        names = [short(e.name) for e in step]
        # the layer's launch pattern: the sequence that repeats `layers` times
        body = (per - (per % layers)) // layers
        lead = next((i for i in range(per - body * layers + 1)
                     if all(names[i + j] == names[i + j % body] for j in range(body * layers))), None)
        dur = collections.defaultdict(float)
        for r in range(args.replays):
            for i, e in enumerate(kernels[r * per:(r + 1) * per]):
                dur[i] += (e.time_range.end - e.time_range.start) / args.replays
        span = sum(((kernels[(r + 1) * per - 1].time_range.end - kernels[r * per].time_range.start)
                    for r in range(args.replays))) / args.replays
        total = sum(dur.values())
        print(f"replay span {span:.1f} us, kernels' sum {total:.1f} us, gaps {span - total:.1f} us "
              f"({(span - total) / span:.1%})")
        print("| launch | kernel | mean us | x per token | us per token | share |")
        print("|---|---|---|---|---|---|")
        if lead is None:
            for i, n in enumerate(names):
                print(f"| {i} | {n} | {dur[i]:.2f} | 1 | {dur[i]:.2f} | {dur[i] / span:.1%} |")
            return
        for j in range(body):
            mean = sum(dur[lead + l * body + j] for l in range(layers)) / layers
            print(f"| layer {j} | {names[lead + j]} | {mean:.2f} | {layers} | {mean * layers:.1f} | "
                  f"{mean * layers / span:.1%} |")
        for i in list(range(lead)) + list(range(lead + body * layers, per)):
            print(f"| outside {i} | {names[i]} | {dur[i]:.2f} | 1 | {dur[i]:.2f} | {dur[i] / span:.1%} |")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
