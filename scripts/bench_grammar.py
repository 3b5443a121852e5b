"""Mask time per token of the grammar engines on a real vocabulary: a JSON schema's and a regex's reply decoded
token by token (the text tokenized greedily), the whole-vocabulary mask computed before each token.

    python scripts/bench_grammar.py [--engine llguidance|outlines|xgrammar|localpd] [--vocab128k]
    python scripts/bench_grammar.py --decode | --overlap [-n ROUNDS]

localpd: the whole per-token cost of localpd's constraint (mask computed, unpacked, applied; the token consumed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "email", "tags", "ok"]}
REPLY = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                    "tags": ["math", "engines", "poetry of science"], "ok": True}, separators=(",", ":"))
REGEX = r"\d{3}-\d{4} [A-Za-z ]{1,40}"
REGEX_REPLY = "555-1234 Call me back after lunch please"


def hf_tokenizer(vocab128k: bool):
    from localpd.load.gguf import GGUFFile
    from localpd.load.registry import resolve_model
    from localpd.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(GGUFFile(resolve_model("smollm2-135m").path).metadata)
    if not vocab128k:
        return tok
    from tokenizers import AddedToken

    extra = [AddedToken(f"tok{i:06d}", special=False, normalized=False) for i in range(128256 - tok.vocab_size)]
    tok.tok.add_tokens(extra)  # a 128k vocabulary: the same BPE and 79k more plain-text tokens
    return tok


def timed(steps) -> list[float]:
    out = []
    for step in steps:
        t = time.perf_counter()
        step()
        out.append(time.perf_counter() - t)
    return out


def llguidance_run(tok, schema, regex, reply_ids, n):
    import llguidance
    import torch
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    lt = llguidance.LLTokenizer(tok.tok.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_ids))
    grammar = (llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
               if schema else llguidance.LLMatcher.grammar_from_regex(regex))
    t = time.perf_counter()
    m = llguidance.LLMatcher(lt, grammar)
    compile_s = time.perf_counter() - t
    bits = allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for _ in range(n):
        m.reset()
        for tid in reply_ids:
            t = time.perf_counter()
            fill_next_token_bitmask(m, bits)
            times.append(time.perf_counter() - t)
            assert m.consume_token(tid), (m.get_error(), tok.decode([tid]))
    return compile_s, times


def outlines_run(tok, schema, regex, reply_ids, n):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    rx = build_regex_from_schema(json.dumps(schema)) if schema else regex
    eos = min(tok.eos_ids)
    vocab = {}
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if b is not None and i not in tok.eos_ids:
            vocab.setdefault(b, []).append(i)
    t = time.perf_counter()
    index = Index(rx, Vocabulary(eos, vocab))
    compile_s = time.perf_counter() - t
    import torch

    mask = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for _ in range(n):
        g = Guide(index)
        for tid in reply_ids:
            t = time.perf_counter()
            g.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            times.append(time.perf_counter() - t)
            g.advance(tid)
    return compile_s, times


def xgrammar_run(tok, schema, regex, reply_ids, n):
    import torch
    import xgrammar as xgr

    info = xgr.TokenizerInfo([tok.token_bytes(i) or b"" for i in range(tok.vocab_size)],
                             stop_token_ids=sorted(tok.eos_ids))
    compiler = xgr.GrammarCompiler(info)
    t = time.perf_counter()
    compiled = (compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":")) if schema
                else compiler.compile_regex(regex))
    compile_s = time.perf_counter() - t
    bits = xgr.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for _ in range(n):
        m = xgr.GrammarMatcher(compiled)
        for tid in reply_ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bits)
            times.append(time.perf_counter() - t)
            assert m.accept_token(tid)
    return compile_s, times


def localpd_run(tok, schema, regex, reply_ids, n):
    """localpd's own path: GrammarConstraint's mask (llguidance's bitmask, unpacked, applied to a logits row) and
    its advance, per token."""
    import torch

    from localpd.constrain.grammar import GrammarConstraint, Vocabulary, json_grammar, regex_grammar

    eos = set(tok.eos_ids)
    vocab = Vocabulary(tok, tok.vocab_size, eos)
    grammar = json_grammar(schema) if schema else regex_grammar(regex)
    t = time.perf_counter()
    GrammarConstraint(vocab, grammar, eos)
    compile_s = time.perf_counter() - t
    logits = torch.randn(tok.vocab_size)
    times = []
    for _ in range(n):
        c = GrammarConstraint(vocab, grammar, eos)
        for tid in reply_ids:
            row = logits.clone()
            t = time.perf_counter()
            c.mask(row)
            ok = c.allows(tid)
            c.advance(tid)
            times.append(time.perf_counter() - t)
            assert ok, tok.decode([tid])
    return compile_s, times


def decode_rates(repeats: int = 3):
    """Decode tok/s of the default model on the CPU's fast path (its default quant), one 64-token greedy reply each:
    plain, JSON mode with a schema, and a pattern the plain reply already matches (the mask's cost alone); best of
    `repeats`, from the engine's own stats."""
    from localpd.engine.engine import Engine
    from localpd.engine.sampling import SamplingParams

    e = Engine("smollm2-135m", device="cpu", max_context=1024)
    ask = e.encode_chat([{"role": "user", "content": "Book me three flights to Paris, with flight codes, days and "
                                                     "gates, as JSON."}])
    flights = {"type": "object", "properties": {"flights": {"type": "array", "items": {"type": "object", "properties": {
        "code": {"type": "string"}, "day": {"type": "string"}, "gate": {"type": "string"}}}}}}
    cases = {"plain (no constraint)": dict(ignore_eos=True), "JSON schema (flights)": dict(json_object=True,
             json_schema=flights), "pattern [\\s\\S]* (the plain reply)": dict(regex=r"[\s\S]*")}
    try:
        for name, kw in cases.items():
            best = max(_rate(e, ask, SamplingParams(temperature=0, max_tokens=64, **kw)) for _ in range(repeats))
            print(f"{name:45s} {best[0]:6.1f} tok/s  ({best[1]} tokens)")
    finally:
        e.close()


def overlap(rounds: int = 5, tokens: int = 64):
    """A decode step's wall time, plain and constrained, with the mask computed in a thread during the CPU forward
    (the runner's default) and after it (mask_thread None), alternating in each round; medians over every decode
    step of every round. The mask's own time per token (llguidance's bitmask, unpacked) and, threaded, how long
    sampling still waited for it."""
    from localpd.constrain.grammar import GrammarConstraint
    from localpd.engine.engine import Engine
    from localpd.engine.sampling import SamplingParams

    e = Engine("smollm2-135m", device="cpu", max_context=1024)
    ask = e.encode_chat([{"role": "user", "content": "Book me three flights to Paris, with flight codes, days and "
                                                     "gates, as JSON."}])
    flights = {"type": "object", "properties": {"flights": {"type": "array", "items": {"type": "object", "properties": {
        "code": {"type": "string"}, "day": {"type": "string"}, "gate": {"type": "string"}}}}}}
    cases = {"plain": dict(ignore_eos=True), "pattern [\\s\\S]*": dict(regex=r"[\s\S]*"),
             "JSON schema": dict(json_object=True, json_schema=flights)}
    steps, masks, waits = {}, [], []
    allowed, run, thread = GrammarConstraint.allowed, e.runner.run, e.runner.mask_thread

    def timed_allowed(c):
        if c._allowed is not None:
            return c._allowed
        t = time.perf_counter()
        out = allowed(c)
        masks.append(time.perf_counter() - t)
        return out

    def timed_run(work, requests):
        out = run(work, requests)
        if out.stats.phase == "decode":
            steps.setdefault(key, []).append(out.stats.wall_seconds)
        return out

    GrammarConstraint.allowed, e.runner.run = timed_allowed, timed_run
    mask_us = {}
    try:
        for _ in range(rounds):
            for name, kw in cases.items():
                for threaded in ((False,) if name == "plain" else (True, False)):
                    key = name + (" (mask in a thread)" if threaded else " (mask after the forward)") * (name != "plain")
                    e.runner.mask_thread = thread if threaded else None
                    masks.clear()
                    _rate(e, ask, SamplingParams(temperature=0, max_tokens=tokens, **kw))
                    mask_us.setdefault(key, []).extend(masks)
    finally:
        GrammarConstraint.allowed, e.runner.run, e.runner.mask_thread = allowed, run, thread
        e.close()
    plain = statistics.median(steps["plain"])
    print(f"{'decoding':48s} {'step ms':>8s} {'vs plain':>9s} {'mask us':>8s}")
    for key, times in steps.items():
        step = statistics.median(times)
        m = statistics.median(mask_us[key]) * 1e6 if mask_us.get(key) else 0.0
        print(f"{key:48s} {step * 1e3:8.3f} {step / plain:9.3f} {m:8.0f}   ({len(times)} steps; rounds' medians "
              f"{' '.join(f'{statistics.median(r) * 1e3:.2f}' for r in rounds_of(times, rounds))} ms)")


def rounds_of(times: list[float], n: int) -> list[list[float]]:
    k = len(times) // n
    return [times[i * k:(i + 1) * k] for i in range(n)]


def _rate(e, ids, params) -> tuple[float, int]:
    handle = e.submit(ids, params)
    for _ in handle:
        pass
    return handle.stats.decode_tps, handle.stats.output_tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="llguidance")
    ap.add_argument("--vocab128k", action="store_true")
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--decode", action="store_true", help="decode tok/s of the engine, plain and constrained")
    ap.add_argument("--overlap", action="store_true", help="a decode step's time, plain and constrained, the mask "
                                                           "computed during the forward or after it")
    a = ap.parse_args()
    if a.decode:
        return decode_rates()
    if a.overlap:
        return overlap(a.n)
    tok = hf_tokenizer(a.vocab128k)
    run = {"llguidance": llguidance_run, "outlines": outlines_run, "xgrammar": xgrammar_run, "localpd": localpd_run}[a.engine]
    for name, schema, regex, text in (("json schema", SCHEMA, None, REPLY), ("regex", None, REGEX, REGEX_REPLY)):
        ids = tok.encode(text, add_bos=False)
        compile_s, times = run(tok, schema, regex, ids, a.n)
        times.sort()
        print(f"{a.engine:10s} vocab {tok.vocab_size:6d} {name:11s} compile {compile_s * 1e3:7.1f} ms  mask per token: "
              f"median {statistics.median(times) * 1e6:6.0f} us  p90 {times[int(0.9 * len(times))] * 1e6:6.0f} us  "
              f"max {times[-1] * 1e6:6.0f} us  ({len(ids)} tokens x {a.n})")


if __name__ == "__main__":
    main()
