"""Speculative decoding on a GPU (issue 30), in one run:

1. Greedy replies with prompt-lookup drafts against plain decoding's on the same engine (verification steps replay
   decode graphs as plain steps do), three requests at once so that steps mix drafted and plain sequences, for
   each KV format that allows drafts: tokens equal, drafted, kept, tokens per pass; and a model drafting for
   itself (engine.draft_model, on graphs of its own).
2. What a verification step costs: the model's forward over r rows of one sequence (eager, as a verification runs)
   over a one-row decode step replayed from its CUDA graph, r = 1 .. 16, on a model of real size (random weights):
   the table speculate.step_costs should hold for a GPU.

    python scripts/gpu_speculate.py [--model synthetic:llama3-8b] [--quant int4-g128] [--context 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from localpd.engine import Engine
from localpd.engine.sampling import SamplingParams
from localpd.engine.speculate import SpeculateConfig, step_costs
from localpd.model.transformer import Batch


def replies(engine: Engine, prompts: list[list[int]], max_tokens: int, spec: SpeculateConfig):
    """The greedy replies' token ids, submitted together, and their stats."""
    engine.set_speculate(spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    handles = [engine.submit(p, params) for p in prompts]
    ids = [[e.token_id for e in h if e.token_id is not None] for h in handles]
    return ids, [h.stats for h in handles]


def repeating_prompts(vocab: int, n: int, gen: torch.Generator) -> list[list[int]]:
    """Prompts that repeat a span of their own, so that prompt lookup has something to find."""
    out = []
    for i in range(n):
        span = torch.randint(0, vocab, (40 + 9 * i,), generator=gen).tolist()
        out.append(span + torch.randint(0, vocab, (7,), generator=gen).tolist() + span + span[:5])
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for r, q in zip(a, b) for x, y in zip(r, q))
    first = [next((i for i, (x, y) in enumerate(zip(r, q)) if x != y), None) for r, q in zip(a, b)]
    return f"{same}/{sum(map(len, a))} tokens equal (first difference per reply: {first})"


def check_replies(model: str, quant: str, max_tokens: int, device: str, strict: bool) -> bool:
    """Plain decoding cold (the prompts computed afresh), plain decoding warm (their pages from the prefix cache) and
    prompt lookup warm; strict: the drafted replies must equal plain decoding's (a model whose top logits are not
    near-ties: a random 8B model's are, and its warm and cold replies differ by float rounding alone)."""
    ok = True
    gen = torch.Generator().manual_seed(0)
    for kv in (None, "fp32"):
        engine = Engine(model, device=device, quant=quant, kv=kv, max_context=512, kv_memory="512MiB")
        prompts = repeating_prompts(engine.config.vocab_size, 3, gen)
        cold, _ = replies(engine, prompts, max_tokens, SpeculateConfig())
        warm, stats0 = replies(engine, prompts, max_tokens, SpeculateConfig())
        spec, stats = replies(engine, prompts, max_tokens, SpeculateConfig("ngram", 8, adaptive=False))
        drafted = sum(s.drafted_tokens for s in stats)
        kept = sum(s.accepted_tokens for s in stats)
        passes = sum(s.decode_steps for s in stats)
        written = sum(s.decode_written for s in stats)
        tps0 = statistics.median(s.decode_tps for s in stats0)
        tps = statistics.median(s.decode_tps for s in stats)
        same = spec == warm
        ok &= same or not strict
        print(f"{'ok ' if same or not strict else 'BAD'} {model} {quant} kv {engine.kv_dtype}: drafted against plain "
              f"(warm): {agreement(warm, spec)}; plain warm against cold: {agreement(cold, warm)}; drafted {drafted}, "
              f"kept {kept}, {written / max(passes, 1):.2f} tokens/pass; median decode {tps:.1f} tok/s drafted, "
              f"{tps0:.1f} plain", flush=True)
        engine.close()
    return ok


def check_draft_model(model: str, quant: str | None, max_tokens: int, device: str) -> bool:
    """The model drafting for itself (engine.draft_model, both on CUDA graphs): greedy replies equal plain decoding's
    on the same engine, nearly every draft kept, and the decode rates of both."""
    gen = torch.Generator().manual_seed(1)
    engine = Engine(model, device=device, quant=quant, max_context=512, kv_memory="512MiB", draft=model,
                    speculate=SpeculateConfig("draft", 4, adaptive=False))
    prompts = repeating_prompts(engine.config.vocab_size, 3, gen)
    replies(engine, prompts, max_tokens, SpeculateConfig())  # cold: graphs captured, prompts cached
    plain, stats0 = replies(engine, prompts, max_tokens, SpeculateConfig())
    drafted, stats = replies(engine, prompts, max_tokens, SpeculateConfig("draft", 4, adaptive=False))
    kept = sum(s.accepted_tokens for s in stats) / max(1, sum(s.drafted_tokens for s in stats))
    ok = drafted == plain and kept > 0.8
    print(f"{'ok ' if ok else 'BAD'} {model} {quant} drafting for itself: {agreement(plain, drafted)}; {kept:.0%} of "
          f"drafts kept; median decode {statistics.median(s.decode_tps for s in stats):.1f} tok/s drafted, "
          f"{statistics.median(s.decode_tps for s in stats0):.1f} plain", flush=True)
    engine.close()
    return ok


def time_forward(call, reps: int, device: str) -> float:
    """Median seconds of call over reps, the GPU synchronised around each."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(reps + 3):
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def row_costs(model: str, quant: str, context: int, reps: int, device: str) -> None:
    engine = Engine(model, device=device, quant=quant, max_context=context + 160, kv_tokens=context + 160)
    kv, ps = engine.kv, engine.kv.page_size
    n_pages = -(-(context + 16) // ps)
    with torch.inference_mode():
        prefix = Batch.single(list(range(100, 100 + context)), 0, n_pages, ps, device)
        prefix.stage_slots = None
        engine.model.forward(prefix, kv)  # the context's pages written
        eager = {}
        for r in range(1, 17):
            batch = Batch.single(list(range(200, 200 + r)), context, n_pages, ps, device, all_logits=True)
            batch.stage_slots = None
            eager[r] = time_forward(lambda b=batch: engine.model.forward(b, kv), reps, device)
    graphed = {}
    with torch.inference_mode():
        if engine.graphs is not None:  # a verification of r - 1 drafted tokens as the engine runs it: r decode rows
            g = engine.graphs
            g.buckets = sorted(set(range(1, 17)) | set(g.buckets))  # each r its own graph: the cost of exactly r rows
            pages = list(range(n_pages))
            for r in range(1, 17):
                pos = list(range(context, context + r))
                inputs = (list(range(200, 200 + r)), pos, [p for p in pos], [p % ps for p in pos], [pages] * r,
                          [p + 1 for p in pos])
                graphed[r] = time_forward(lambda i=inputs: g.run(*i), reps, device)
    # a one-row decode step as the engine runs it: plain greedy decoding's time per token (graph replays)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    engine.set_speculate(SpeculateConfig())
    tps = []
    for _ in range(3):
        h = engine.submit(list(range(300, 300 + context)), params)
        for _ in h:
            pass
        tps.append(h.stats.decode_tps)
    step = 1 / statistics.median(tps)
    table = step_costs(device)
    print(f"# {model} {quant}, kv {engine.kv_dtype}, {context} tokens of context; a plain decode step (CUDA graph, "
          f"sampling included) {step * 1e3:.3f} ms; eager one-row forward {eager[1] * 1e3:.3f} ms")
    print("rows:                 " + " ".join(f"{r:6}" for r in eager))
    print("eager ms:             " + " ".join(f"{t * 1e3:6.2f}" for t in eager.values()))
    print("x graph step:         " + " ".join(f"{t / step:6.2f}" for t in eager.values()))
    print("x eager one row:      " + " ".join(f"{t / eager[1]:6.2f}" for t in eager.values()))
    if graphed:
        print("graph ms:             " + " ".join(f"{t * 1e3:6.2f}" for t in graphed.values()))
        print("graph x one row:      " + " ".join(f"{t / graphed[1]:6.2f}" for t in graphed.values()))
    print("speculate.step_costs: " + " ".join(f"{table[r - 1]:6.2f}" for r in eager if r - 1 < len(table)))
    engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--quant", default="int4-g128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = ap.parse_args()
    ok = check_replies("synthetic:smollm2-135m", "int4-g32", args.max_tokens, args.device, strict=True)
    ok &= check_replies(args.model, args.quant, args.max_tokens, args.device, strict=False)
    ok &= check_draft_model("synthetic:smollm2-135m", None, args.max_tokens, args.device)  # the draft's scheme
    row_costs(args.model, args.quant, args.context, args.reps, args.device)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
