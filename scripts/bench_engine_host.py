"""The engine's own time per decode step, without the model: the forward replaced by a function that returns the
step's logits at once (the real ones of a first pass, so sampling sees real rows), so what remains is the host's
work each token costs on top of the model (scheduling, the batch's tensors, sampling, the step's accounting,
detokenizing and stops, the event to the caller's thread). On the CPU that time adds to every token; on a GPU it
is the gap between graph replays (scripts/profile_decode_step.py).

    python scripts/bench_engine_host.py [--model smollm2-135m] [--steps 256] [--threads 1]

Prints microseconds a step, in total and by part.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from profile_decode_step import timed  # noqa: E402


@torch.inference_mode()
def main() -> None:
    from localpd.engine import Engine
    from localpd.engine.sampling import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", help="a registry name or file; synthetic:SHAPE works too")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(args.model, device="cpu", quant=args.quant, max_context=args.steps + 200, kv_memory="256MiB")
    try:
        vocab = engine.config.vocab_size
        prompt = torch.randint(0, vocab, (100,), generator=torch.Generator().manual_seed(0)).tolist()
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        real = engine.model.forward
        rows = []

        def keep(batch, kv, **kw):
            out = real(batch, kv, **kw)
            rows.append(out[-1:].clone())
            return out

        engine.model.forward = keep
        list(engine.submit(prompt, params))
        logits = rows[-1]
        engine.model.forward = lambda batch, kv, **kw: logits.expand(len(batch.logit_rows), -1)
        totals = collections.defaultdict(float)
        for obj, name in ((engine, "_step"), (engine.scheduler, "step"), (engine.runner, "run"),
                          (engine.runner, "_batch"), (engine.runner, "_sample"), (engine.output, "process")):
            timed(obj, name, totals)
        params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
        handle = engine.submit(prompt, params)
        events = iter(handle)
        next(events)  # the prefill's token
        totals.clear()
        t0 = time.perf_counter()
        n = sum(1 for _ in events)
        wall = time.perf_counter() - t0
        steps = max(1, totals["ModelRunner.run calls"])
        print(f"# {args.model}: {n} decode steps, the forward replaced; {args.threads} thread(s)")
        print(f"wall per token (caller's view) {wall / n * 1e6:.0f} us; " + ", ".join(
            f"{k} {v / steps * 1e6:.0f}" for k, v in totals.items() if not k.endswith("calls")) + " us a step")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
