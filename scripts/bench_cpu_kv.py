"""Decode speed on the CPU by KV page format: one engine a format over the same GGUF, greedy decode of a story
prompt, the formats taking turns for a few rounds; prints each format's median decode tok/s and how many of its
tokens equal the first format's.

    python scripts/bench_cpu_kv.py [MODEL] [--kv fp16,int8] [--tokens 100] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch

from bench_cpu_decode import MESSAGES, bench_localpd  # this script's folder
from localpd.engine import Engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--kv", default="fp16,int8", help="comma-separated KV formats (localpd.kvcache.formats)")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kvs = args.kv.split(",")
    engines = {kv: Engine(args.model, device="cpu", kv=kv, max_context=2048) for kv in kvs}
    runs: dict[str, list] = {kv: [] for kv in kvs}
    for _ in range(args.rounds):
        for kv, engine in engines.items():
            _, decode_tps, _, tokens = bench_localpd(engine, engine.encode_chat(MESSAGES), args.tokens)
            runs[kv].append((decode_tps, tokens))
    first = runs[kvs[0]][0][1]
    print(f"# {args.model}, {args.threads} threads, {args.tokens} tokens, {args.rounds} rounds")
    print("| KV pages | decode tok/s (median) | runs | tokens equal to " + kvs[0] + "'s |")
    print("|---|---|---|---|")
    for kv, got in runs.items():
        tps = sorted(t for t, _ in got)
        same = sum(a == b for a, b in zip(got[0][1], first))
        print(f"| {kv} | {tps[len(tps) // 2]:.1f} | {', '.join(f'{t:.1f}' for t in tps)} | {same}/{len(first)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
