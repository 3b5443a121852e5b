"""Speculative decoding's payoff on this machine: decode tok/s with n-gram drafts over plain decoding's, greedy,
measured in the same run on the same engine, for prompts that ask to repeat a given text (300+ tokens) verbatim
(five texts: speculate_texts.py) and to lightly edit one, and one with nothing to repeat (a story). Each reply must
be plain decoding's, token for token.

Also the cost that decides the payoff: a step with r rows of one sequence (a verification of r - 1 drafted tokens)
over a one-row decode step, the model's forward alone.

    python scripts/bench_speculate.py [--model smollm2-135m] [--runs 3] [--max-tokens 300] [--threads 2]
                                      [--prompts repeat,repeat:bees]

With --draft MODEL, a draft model's drafting instead: the target (--model, in --quant) with and without the draft,
two engines, the replies alternating; tokens per target pass and the decode ratio.

    python scripts/bench_speculate.py --quant fp32 --draft smollm2-135m
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from localpd.engine import Engine
from localpd.engine.sampling import SamplingParams
from localpd.engine.speculate import (CPU_STEP_COSTS, DRAFT_TOKENS, MAX_DRAFT, DraftState, SpeculateConfig,
                                     Speculator, matched)
from localpd.kernels import cpu
from localpd.model.transformer import Batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculate_texts import LIGHTHOUSE, TEXTS  # noqa: E402

TEXT = LIGHTHOUSE
PROMPTS = {
    "repeat": [{"role": "user", "content": f"{TEXT}\n\nRepeat the text above word for word."}],
    "edit": [{"role": "user", "content": f"{TEXT}\n\nRewrite the text above, replacing 'lighthouse' with 'tower'."}],
    "story": [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}],
    **{f"repeat:{name}": [{"role": "user", "content": f"{text}\n\nRepeat the text above word for word."}]
       for name, text in TEXTS.items() if text is not TEXT},
}


def step_clock() -> float:
    """The clock the step costs are read on: the process's CPU seconds with one torch thread (what else a shared
    machine runs weighs little on them), the wall clock with more (CPU seconds would count every thread's, and a
    user waits on the wall clock: at two threads a one-row step waits on memory while extra rows split over both
    cores, docs/PERF.md)."""
    return time.process_time() if torch.get_num_threads() == 1 else time.perf_counter()


def fastest(calls: dict, reps: int) -> dict:
    """The fewest seconds (step_clock) each call took over reps, the calls taken in turn each rep, so that what
    else the machine runs weighs on all of them alike."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(reps):
        for key, call in calls.items():
            t0 = step_clock()
            call()
            best[key] = min(best[key], step_clock() - t0)
    return best


def on_library(lib, call):
    """call, run with lib as the CPU kernels (cpu.library()) where lib is not None."""
    def run():
        if lib is None:
            return call()
        kept = cpu.library
        cpu.library = lambda: lib
        try:
            return call()
        finally:
            cpu.library = kept
    return run


def step_costs(engine: Engine, rows: list[int], libs: dict, reps: int = 30, context: int = 400) -> dict:
    """Seconds (step_clock) of the forward of one sequence's r rows after `context` cached positions, on each
    library of libs (name -> library, None: this source's): {(name, r): seconds}."""
    kv, ps = engine.kv, engine.kv.page_size
    calls = {}
    for r in rows:
        batch = Batch.single(list(range(100, 100 + r)), context, -(-(context + r) // ps), ps, "cpu", all_logits=True)
        batch.stage_slots = None
        for name, lib in libs.items():
            calls[name, r] = on_library(lib, lambda b=batch: engine.model.forward(b, kv))
    for call in calls.values():
        call()
    return fastest(calls, reps)


def step_parts(engine: Engine, rows: list[int], libs: dict, reps: int = 15, context: int = 400) -> dict:
    """Seconds (step_clock) of each part of a step of r rows of one sequence after `context` cached positions, each
    part alone on localpd's CPU kernels, on each library of libs: every layer's four products, every layer's
    attention over the sequence's pages, the output head: {(name, part, r): seconds}."""
    model, kv, ps = engine.model, engine.kv, engine.kv.page_size
    c = model.config
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    calls = {}
    for r in rows:
        batch = Batch.single(list(range(100, 100 + r)), context, -(-(context + r) // ps), ps, "cpu", all_logits=True)
        batch.stage_slots = None
        model.forward(batch, kv)  # the pages written
        products = [(lin is L.down, lin) for L in model.layers for lin in (L.qkv, L.o, L.gate_up, L.down)]
        inputs = [rand(r, 2 * lin.weight.shape[1] if g else lin.weight.shape[1]) for g, lin in products]
        q = rand(r, c.n_heads, c.head_dim)
        scale = 1.0 / c.head_dim ** 0.5
        parts = {"linears": lambda p=products, xs=inputs: [cpu.linear(x, lin.weight, lin.bias, gated=c.act if g else None)
                                                          for (g, lin), x in zip(p, xs)],
                 "attention": lambda q=q, b=batch: [cpu.attention(q, kv.layer(li), b.page_table, b.seq_lens,
                                                                  b.q_starts, scale) for li in range(c.n_layers)],
                 "head": lambda x=rand(r, c.dim): cpu.linear(x, model.lm_head.weight, model.lm_head.bias)}
        for name, lib in libs.items():
            for part, call in parts.items():
                calls[name, part, r] = on_library(lib, call)
    return fastest(calls, reps)


def print_costs(libs: dict, costs: dict, parts: dict, rows: list[int], part_rows: list[int]) -> None:
    """The step costs over a one-row step's, each part's too, on each library; and the first library's over the
    second's where two were measured."""
    for name in libs:
        print(f"[{name}] rows a step: " + "  ".join(f"{r:>5}" for r in rows))
        print(f"[{name}] x one row:   " + "  ".join(f"{costs[name, r] / costs[name, 1]:5.2f}" for r in rows)
              + f"   (one row {costs[name, 1] * 1e3:.2f} ms)")
        for part in ("linears", "attention", "head"):
            one = parts[name, part, 1]
            print(f"[{name}] {part + ',':11} {one * 1e3:5.2f} ms at one row; x one row at "
                  + ", ".join(f"{r}: {parts[name, part, r] / one:.2f}" for r in part_rows))
    if len(libs) == 2:
        new, old = libs
        print(f"{new} over {old}, seconds of a step: "
              + ", ".join(f"{r} rows {costs[new, r] / costs[old, r]:.2f}" for r in rows))
        for part in ("linears", "attention", "head"):
            print(f"{new} over {old}, {part}: "
                  + ", ".join(f"{r} rows {parts[new, part, r] / parts[old, part, r]:.2f}" for r in part_rows))


def reply(engine: Engine, messages, max_tokens: int, speculate: SpeculateConfig):
    """The reply's token ids, its stats, and the process's CPU seconds over it (the engine thread's work: with one
    torch thread, what the reply cost whatever else the machine runs)."""
    engine.set_speculate(speculate)
    cpu0 = time.process_time()
    handle = engine.submit(engine.encode_chat(messages), SamplingParams(temperature=0, max_tokens=max_tokens))
    ids = [e.token_id for e in handle if e.token_id is not None]
    return ids, handle.stats, time.process_time() - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3, help="runs of each, alternating; the median is compared")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--draft-tokens", type=int, default=DRAFT_TOKENS)
    ap.add_argument("--threads", type=int, help="torch's threads (default: torch's)")
    ap.add_argument("--draft", help="a draft model of the target's vocabulary: its drafting measured instead")
    ap.add_argument("--quant", help="the target's weight scheme (default: its file's own)")
    ap.add_argument("--kv", help="the KV pages' format (default: the engine's, fp16 on the CPU)")
    ap.add_argument("--parts", action="store_true", help="the step costs and each part's alone, no replies")
    ap.add_argument("--prompts", help=f"comma-separated, of {', '.join(PROMPTS)} (default: all)")
    ap.add_argument("--against", help="another cpu_kernels.c (e.g. `git show main:kernels/cpu_kernels.c`): its "
                                      "step costs measured in the same run, alternating")
    args = ap.parse_args()
    prompts = args.prompts.split(",") if args.prompts else list(PROMPTS)
    if not set(prompts) <= set(PROMPTS):
        ap.error(f"--prompts takes {', '.join(PROMPTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.draft:
        return bench_draft(args, prompts)
    engine = Engine(args.model, device="cpu", max_context=2048, quant=args.quant, kv=args.kv)
    print(f"# {engine.name} | weights {engine.quant} | kv {engine.kv_dtype} | {torch.get_num_threads()} threads")
    print(f"# {engine.path}")
    libs = {"this source": None}
    if args.against:
        libs[Path(args.against).name] = cpu.open_library(cpu.build(out_dir=Path(tempfile.mkdtemp()),
                                                                    source=Path(args.against)))
    rows, part_rows = list(range(1, MAX_DRAFT + 3)), [1, 2, 5, 9, 15]
    with torch.inference_mode():
        costs = step_costs(engine, rows, libs)
        parts = step_parts(engine, part_rows, libs)
    print_costs(libs, costs, parts, rows, part_rows)
    print("speculate.CPU_STEP_COSTS as measured here: ("
          + ", ".join(f"{costs['this source', r] / costs['this source', 1]:.2f}" for r in rows) + ")")
    if args.parts:
        return
    spec = SpeculateConfig("ngram", args.draft_tokens)
    for name in prompts:
        messages = PROMPTS[name]
        reply(engine, messages, args.max_tokens, SpeculateConfig())  # warm: the prompt's pages in the prefix cache
        runs = {lib: {"plain": [], "ngram": [], "plain_cpu": [], "ngram_cpu": [], "same": True} for lib in libs}
        for _ in range(args.runs):
            for lib, r in runs.items():  # the libraries in turn each run, each's plain reply then its ngram reply
                ids, s, cpu_s = on_library(libs[lib], lambda: reply(engine, messages, args.max_tokens,
                                                                    SpeculateConfig()))()
                sids, ss, scpu = on_library(libs[lib], lambda: reply(engine, messages, args.max_tokens, spec))()
                r["plain"].append(s.decode_tps)
                r["plain_cpu"].append(len(ids) / cpu_s)
                r["ngram"].append(ss.decode_tps)
                r["ngram_cpu"].append(len(sids) / scpu)
                r["same"] &= sids == ids
                r["stats"], r["tokens"] = ss, len(ids)
        for lib, r in runs.items():
            p, q, pc, qc = (statistics.median(r[k]) for k in ("plain", "ngram", "plain_cpu", "ngram_cpu"))
            r["medians"], ss = (p, q, pc, qc), r["stats"]
            acc = f"{ss.acceptance:.0%}" if ss.acceptance is not None else "-"
            print(f"{name:14} [{lib}] prompt {ss.prompt_tokens} tokens, reply {r['tokens']} tokens | decode: plain "
                  f"{p:.1f} tok/s, ngram {q:.1f} tok/s, ratio {q / p:.2f}x | per CPU second: plain {pc:.1f}, ngram "
                  f"{qc:.1f}, ratio {qc / pc:.2f}x | drafted {ss.drafted_tokens}, accepted {acc}, "
                  f"{ss.tokens_per_pass:.2f} tokens/pass | identical: {r['same']}")
        if len(libs) == 2:
            (new, a), (old, b) = ((lib, r["medians"]) for lib, r in runs.items())
            print(f"{'':14} {new} over {old}, per CPU second: plain {a[2] / b[2]:.2f}x, ngram {a[3] / b[3]:.2f}x; "
                  f"{new}'s ngram over {old}'s plain {a[3] / b[2]:.2f}x")
        prompt = engine.encode_chat(messages)
        adaptive, oracle = bound(prompt, ids, args.draft_tokens), bound(prompt, ids, MAX_DRAFT, True)
        print(f"{'':14} replayed on the step costs (speculate.CPU_STEP_COSTS): adaptive k {adaptive:.2f}x, each draft "
              f"cut where it fails (a bound for these drafts) {oracle:.2f}x, the best copy of the text so far cut "
              f"where it fails (a bound for any drafter that copies) {copy_bound(prompt, ids, MAX_DRAFT):.2f}x")
    engine.close()


def bound(prompt: list[int], ids: list[int], limit: int, oracle: bool = False) -> float:
    """The decode ratio the greedy reply `ids` would get from prompt-lookup drafts on the cost table, a step of
    r rows costing CPU_STEP_COSTS[r - 1]: with the adaptive k (engine.speculate, as run), or with the draft cut to
    the k that knows how many of its tokens hold (the best any k policy can do with these drafts); at most limit
    drafted tokens a step."""
    speculator, state = Speculator(SpeculateConfig("ngram", limit)), DraftState()
    at, time_ = 0, 0.0
    while at < len(ids):
        tokens, room = prompt + ids[:at], len(ids) - at - 1
        if oracle:
            draft = state.index.draft(tokens, min(limit, room))
            held = matched(draft, ids[at:])[0]
            draft = draft[:max(range(len(draft) + 1), key=lambda k: (1 + min(k, held)) / CPU_STEP_COSTS[k])]
        else:
            draft = speculator.propose(state, tokens, at, room)
        kept = matched(draft, ids[at:])[0]
        if draft:
            Speculator.verified(state, len(draft), kept)
        time_ += CPU_STEP_COSTS[len(draft)]
        at += 1 + kept
    return len(ids) / time_


def copy_bound(prompt: list[int], ids: list[int], limit: int) -> float:
    """The decode ratio on the cost table if each step drafted the longest run of the text so far (prompt and
    output, any occurrence) that the greedy reply `ids` goes on with, cut to the best k: a bound for every drafter
    that copies from the text."""
    at, time_ = 0, 0.0
    while at < len(ids):
        text, want = prompt + ids[:at], ids[at:at + min(limit, len(ids) - at - 1)]
        held = max((run_length(text, j, want) for j, t in enumerate(text) if want and t == want[0]), default=0)
        k = max(range(held + 1), key=lambda k: (1 + k) / CPU_STEP_COSTS[k])
        time_ += CPU_STEP_COSTS[k]
        at += 1 + k
    return len(ids) / time_


def run_length(text: list[int], j: int, want: list[int]) -> int:
    """How many of want's tokens text has from position j on."""
    n = 0
    while n < len(want) and j + n < len(text) and text[j + n] == want[n]:
        n += 1
    return n


def bench_draft(args, prompts: list[str]) -> None:
    """Plain decoding on the target alone against the target with the draft (which also runs every step's rows),
    the replies alternating; both engines' prompt pages warm in their prefix caches."""
    plain_engine = Engine(args.model, device="cpu", max_context=2048, quant=args.quant, kv=args.kv)
    spec = SpeculateConfig("draft", args.draft_tokens)
    engine = Engine(args.model, device="cpu", max_context=2048, quant=args.quant, kv=args.kv, draft=args.draft,
                    speculate=spec)
    print(f"# target {engine.name} | weights {engine.quant} | kv {engine.kv_dtype} | draft {engine.drafter.name}, "
          f"{engine.drafter.cost:.2f}x the target's weight bytes | {torch.get_num_threads()} threads")
    for name in prompts:
        messages = PROMPTS[name]
        reply(plain_engine, messages, args.max_tokens, SpeculateConfig())
        reply(engine, messages, args.max_tokens, spec)
        plain_tps, spec_tps, same = [], [], True
        for _ in range(args.runs):
            ids, s, _ = reply(plain_engine, messages, args.max_tokens, SpeculateConfig())
            plain_tps.append(s.decode_tps)
            sids, ss, _ = reply(engine, messages, args.max_tokens, spec)
            spec_tps.append(ss.decode_tps)
            same &= sids == ids
        p, q = statistics.median(plain_tps), statistics.median(spec_tps)
        acc = f"{ss.acceptance:.0%}" if ss.acceptance is not None else "-"
        print(f"{name:14} reply {len(ids)} tokens | decode: plain {p:.1f} tok/s, draft model {q:.1f} tok/s, ratio "
              f"{q / p:.2f}x | drafted {ss.drafted_tokens}, accepted {acc}, {ss.tokens_per_pass:.2f} tokens/target "
              f"pass | identical: {same}")
    engine.close()
    plain_engine.close()


if __name__ == "__main__":
    main()
