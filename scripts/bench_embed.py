"""Embedding throughput on the engine: 32 short inputs one at a time, submitted together, again from the prefix
cache, and together beside a running decode (docs/PERF.md).

    python scripts/bench_embed.py [MODEL] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from localpd.engine import Engine
from localpd.engine.engine import embeddings
from localpd.engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    e = Engine(args.model, device=args.device, max_context=2048)

    def inputs(tag: str) -> list[list[int]]:  # a fresh set each time, so that the prefix cache serves none of it
        return [e.tokenizer.encode(f"{tag} document {i}: the {i}th note about local inference, paged caches and "
                                   f"bandwidth.") for i in range(32)]

    def timed(what: str, ids: list[list[int]], run) -> None:
        t = time.perf_counter()
        run(ids)
        print(f"{what}: {len(ids)} inputs, {sum(map(len, ids))} tokens, {time.perf_counter() - t:.2f} s")

    e.embedding(inputs("warm")[0])
    timed("one at a time", inputs("Alpha"), lambda ids: [e.embedding(x) for x in ids])
    together = inputs("Beta")
    timed("together", together, lambda ids: asyncio.run(embeddings(e, ids)))
    timed("the same again (prefix cache)", together, lambda ids: asyncio.run(embeddings(e, ids)))
    story = e.submit(e.tokenizer.encode("Write a long story about the sea."),
                     SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    next(iter(story))
    timed("together beside a running decode", inputs("Gamma"), lambda ids: asyncio.run(embeddings(e, ids)))
    story.cancel()
    e.close()


if __name__ == "__main__":
    main()
