"""Decode speed of localpd beside transformers' generate, same model, same machine, same run.

    python scripts/bench_cpu_decode.py [MODEL] [--tokens 64] [--threads N]

Both run float32 on the CPU from the same GGUF; greedy decode of a fixed number of tokens (EOS ignored).
"""

import argparse
import time

import torch

from localpd.engine import Engine
from localpd.engine.sampling import SamplingParams

MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def bench_localpd(engine, ids, n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    list(engine.generate(ids, SamplingParams(temperature=0, max_tokens=4)))  # warm-up
    t = time.perf_counter()
    handle = engine.submit(ids, params)
    events = list(handle)
    total = time.perf_counter() - t
    s = handle.stats
    return s.ttft, s.decode_tps, total, [e.token_id for e in events if e.token_id is not None]


def bench_transformers(path, ids, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        model.generate(x, max_new_tokens=4, do_sample=False)  # warm-up
        t = time.perf_counter()
        model(x)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        total = time.perf_counter() - t
    decode_tps = (n - 1) / (total - ttft)
    return ttft, decode_tps, total, out[0, len(ids):].tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(args.model, device="cpu", max_context=2048)
    ids = engine.encode_chat(MESSAGES)
    ours = bench_localpd(engine, ids, args.tokens)
    theirs = bench_transformers(engine.resolved.path, ids, args.tokens)
    same = ours[3] == theirs[3][: len(ours[3])]
    print(f"model {engine.name}, {len(ids)} prompt tokens, {args.tokens} generated, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'':14}{'TTFT ms':>10}{'decode tok/s':>14}{'total s':>10}")
    for name, r in (("localpd", ours), ("transformers", theirs)):
        print(f"{name:14}{r[0] * 1000:>10.0f}{r[1]:>14.1f}{r[2]:>10.2f}")
    print(f"decode speed ratio localpd / transformers: {ours[1] / theirs[1]:.2f}x; same greedy tokens: {same}")


if __name__ == "__main__":
    main()
