"""Speculative decoding's payoff on this machine: decode tok/s with n-gram drafts over plain decoding's, greedy,
measured in the same run on the same engine, for a prompt that asks to lightly edit a given text (300+ tokens) and
one with nothing to repeat (a story). Each reply must be plain decoding's, token for token.

Also the cost that decides the payoff: a step with r rows of one sequence (a verification of r - 1 drafted tokens)
over a one-row decode step, the model's forward alone.

    python scripts/bench_speculate.py [--model smollm2-135m] [--runs 3] [--max-tokens 300] [--threads 1]

With --draft MODEL, a draft model's drafting instead: the target (--model, in --quant) with and without the draft,
two engines, the replies alternating; tokens per target pass and the decode ratio.

    python scripts/bench_speculate.py --quant fp32 --draft smollm2-135m
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from localpd.engine import Engine
from localpd.engine.sampling import SamplingParams
from localpd.engine.speculate import (CPU_STEP_COSTS, DRAFT_TOKENS, MAX_DRAFT, DraftState, SpeculateConfig,
                                     Speculator, matched)
from localpd.model.transformer import Batch

TEXT = (
    "The old lighthouse stood at the edge of the harbour for more than two hundred years. Every evening the keeper "
    "climbed the narrow stairs, trimmed the wick and polished the great lens until it shone. Ships coming home from "
    "the north sea looked for its light long before they could see the coast, and the fishermen of the village said "
    "that as long as the lamp burned, no boat would be lost on the rocks below. In the winter storms the waves rose "
    "higher than the houses, and the wind tore the slates from the roofs, but the light never failed. When the "
    "keeper grew old, his daughter took his place. She learned to read the weather from the colour of the clouds "
    "and the smell of the air, and she kept a careful log of every ship that passed. Years later, when an electric "
    "lamp replaced the flame and the keepers were sent away, the villagers gathered on the quay to thank her. She "
    "told them that the light had never belonged to her or to her father, but to everyone who had ever been out at "
    "sea on a dark night and wished to find the way home. The lighthouse still stands today. Its lamp turns by "
    "itself now, and nobody climbs the stairs in the evening, but children from the village still walk out along "
    "the harbour wall to watch the beam sweep across the water, and the old fishermen still tell the story of the "
    "keeper and her father to anyone who will listen.")
PROMPTS = {
    "edit": [{"role": "user", "content": f"{TEXT}\n\nRewrite the text above, replacing 'lighthouse' with 'tower'."}],
    "story": [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}],
}


def step_costs(engine: Engine, rows: list[int], reps: int = 30, context: int = 400) -> dict[int, float]:
    """Seconds of the forward of one sequence's r rows after `context` cached positions: the fastest of reps, the
    row counts taken in turn each rep, so that what else the machine runs weighs on all of them alike."""
    kv, ps = engine.kv, engine.kv.page_size
    batches = {}
    for r in rows:
        batches[r] = Batch.single(list(range(100, 100 + r)), context, -(-(context + r) // ps), ps, "cpu",
                                  all_logits=True)
        batches[r].stage_slots = None
        for _ in range(3):
            engine.model.forward(batches[r], kv)
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(reps):
        for r in rows:
            t0 = time.perf_counter()
            engine.model.forward(batches[r], kv)
            best[r] = min(best[r], time.perf_counter() - t0)
    return best


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
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.draft:
        return bench_draft(args)
    engine = Engine(args.model, device="cpu", max_context=2048, quant=args.quant)
    print(f"# {engine.name} | weights {engine.quant} | kv {engine.kv_dtype} | {torch.get_num_threads()} threads")
    print(f"# {engine.path}")
    with torch.inference_mode():
        costs = step_costs(engine, [1, 2, 3, 4, 5, 8, 9, 12, 16])
    print("rows a step:  " + "  ".join(f"{r:>5}" for r in costs))
    print("x one row:    " + "  ".join(f"{c / costs[1]:5.2f}" for c in costs.values()))
    spec = SpeculateConfig("ngram", args.draft_tokens)
    for name, messages in PROMPTS.items():
        reply(engine, messages, args.max_tokens, SpeculateConfig())  # warm: the prompt's pages in the prefix cache
        plain_tps, spec_tps, plain_cpu, spec_cpu, same = [], [], [], [], True
        for _ in range(args.runs):
            ids, s, cpu = reply(engine, messages, args.max_tokens, SpeculateConfig())
            plain_tps.append(s.decode_tps)
            plain_cpu.append(len(ids) / cpu)
            sids, ss, scpu = reply(engine, messages, args.max_tokens, spec)
            spec_tps.append(ss.decode_tps)
            spec_cpu.append(len(sids) / scpu)
            same &= sids == ids
        p, q = statistics.median(plain_tps), statistics.median(spec_tps)
        pc, qc = statistics.median(plain_cpu), statistics.median(spec_cpu)
        acc = f"{ss.acceptance:.0%}" if ss.acceptance is not None else "-"
        print(f"{name:7} prompt {ss.prompt_tokens} tokens, reply {len(ids)} tokens | decode: plain {p:.1f} tok/s, "
              f"ngram {q:.1f} tok/s, ratio {q / p:.2f}x | per CPU second: plain {pc:.1f}, ngram {qc:.1f}, ratio "
              f"{qc / pc:.2f}x | drafted {ss.drafted_tokens}, accepted {acc}, {ss.tokens_per_pass:.2f} tokens/pass "
              f"| identical: {same}")
        prompt = engine.encode_chat(messages)
        adaptive, oracle = bound(prompt, ids, args.draft_tokens), bound(prompt, ids, MAX_DRAFT, True)
        print(f"{'':7} replayed on the step costs (speculate.CPU_STEP_COSTS): adaptive k {adaptive:.2f}x, each draft "
              f"cut where it fails (a bound for these drafts) {oracle:.2f}x")
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


def bench_draft(args) -> None:
    """Plain decoding on the target alone against the target with the draft (which also runs every step's rows),
    the replies alternating; both engines' prompt pages warm in their prefix caches."""
    plain_engine = Engine(args.model, device="cpu", max_context=2048, quant=args.quant)
    spec = SpeculateConfig("draft", args.draft_tokens)
    engine = Engine(args.model, device="cpu", max_context=2048, quant=args.quant, draft=args.draft, speculate=spec)
    print(f"# target {engine.name} | weights {engine.quant} | kv {engine.kv_dtype} | draft {engine.drafter.name}, "
          f"{engine.drafter.cost:.2f}x the target's weight bytes | {torch.get_num_threads()} threads")
    for name, messages in PROMPTS.items():
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
        print(f"{name:7} reply {len(ids)} tokens | decode: plain {p:.1f} tok/s, draft model {q:.1f} tok/s, ratio "
              f"{q / p:.2f}x | drafted {ss.drafted_tokens}, accepted {acc}, {ss.tokens_per_pass:.2f} tokens/target "
              f"pass | identical: {same}")
    engine.close()
    plain_engine.close()


if __name__ == "__main__":
    main()
