"""The scheduler over the page allocator and prefix cache, without a model: a shadow KV array records which token
each slot holds, so every step can check that a sequence attends to exactly its own tokens and that cached pages
are never overwritten. The allocator alone: tests/kvcache/test_pages.py."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localpd.kvcache.pages import PagePool
from localpd.engine.scheduler import Scheduler, Sequence, Work


class Shadow:
    """What the model would have written: token id per (page, offset)."""

    def __init__(self, pool: PagePool):
        self.slots = {}
        self.pool = pool

    def run(self, work):
        ps = self.pool.page_size
        for w in work:
            seq = w.seq
            pages = seq.table.pages
            assert len(pages) * ps >= w.start + w.n
            for pos in range(w.start):  # the context it attends to is its own tokens
                assert self.slots.get((pages[pos // ps], pos % ps)) == seq.tokens[pos], (seq.id, pos)
            for pos in range(w.start, w.start + w.n):
                page = pages[pos // ps]
                assert page not in self.pool.cached, "wrote into a cached page"
                assert self.pool.refs[page] == 1, "wrote into a shared page"
                self.slots[(page, pos % ps)] = seq.tokens[pos]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n_pages=st.integers(4, 40), page_size=st.sampled_from([2, 4, 16]),
       budget=st.integers(1, 64), max_running=st.integers(1, 8))
def test_random_traffic_never_leaks_or_corrupts(seed, n_pages, page_size, budget, max_running):
    rng = random.Random(seed)
    pool = PagePool(n_pages, page_size, salt="s")
    sched = Scheduler(pool, budget, max_running)
    shadow = Shadow(pool)
    capacity = n_pages * page_size
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 3 * page_size))] for _ in range(3)]
    live, done, n_submitted = [], [], 0
    staged = {}  # stage row -> (sequence, page index) whose open page it holds
    for step in range(400):
        if n_submitted < 25 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(0, 2 * page_size))]
            if len(prompt) + 1 <= capacity:  # the engine rejects what cannot fit even alone
                seq = Sequence(f"s{n_submitted}", prompt, max_tokens=rng.randrange(1, 2 * page_size))
                sched.add(seq)
                live.append(seq)
                n_submitted += 1
        if live and rng.random() < 0.05:  # cancellation, running or waiting
            seq = live.pop(rng.randrange(len(live)))
            sched.remove(seq)
            done.append(seq)
        work = sched.step()
        if not work and sched.waiting and not sched.running:  # the engine ends a sequence that cannot fit alone
            seq = sched.waiting[0]
            assert len(seq.tokens) + 1 > capacity
            sched.remove(seq)
            live.remove(seq)
            done.append(seq)
        shadow.run(work)
        rows = [s.stage_row for s in sched.running]
        assert sorted(rows + sched.free_rows) == list(range(max_running)), "a stage row lost or shared"
        assert all(s.stage_row == -1 for s in sched.waiting)
        for w in work:  # a write continuing a page finds that page's earlier tokens in its stage row
            if w.start % page_size:
                assert staged.get(w.seq.stage_row) == (w.seq, w.start // page_size), "staged tokens lost"
            staged[w.seq.stage_row] = (w.seq, (w.start + w.n - 1) // page_size)
        sched.finish_step(work)
        for w in work:
            if w.sample:
                w.seq.output.append(rng.randrange(5))
                if len(w.seq.output) >= w.seq.max_tokens:
                    sched.remove(w.seq)
                    live.remove(w.seq)
                    done.append(w.seq)
        pool.check()
        if not live and n_submitted >= 25:
            break
    for seq in live:  # drain: finish what is left
        sched.remove(seq)
    pool.check()
    assert all(r == 0 for r in pool.refs), "references left behind"
    assert pool.available == n_pages
    assert not sched.running and not sched.waiting


def test_decodes_keep_running_while_a_long_prompt_is_chunked():
    pool = PagePool(64, 4)
    sched = Scheduler(pool, max_step_tokens=8, max_running=4)
    a = Sequence("a", [1, 2, 3], 10)
    sched.add(a)
    work = sched.step()
    sched.finish_step(work)
    a.output.append(7)
    long = Sequence("long", list(range(40)), 5)
    sched.add(long)
    chunks = []
    for _ in range(6):
        work = sched.step()
        assert work[0].seq is a and work[0].n == 1  # the decode is never starved
        chunks += [w.n for w in work if w.seq is long]
        sched.finish_step(work)
        a.output.append(7)
    assert chunks[:5] == [7, 7, 7, 7, 7]
    assert sum(chunks) == 40


def test_preemption_when_pages_run_out_then_recompute():
    pool = PagePool(4, 2)
    sched = Scheduler(pool, max_step_tokens=16, max_running=4)
    a, b = Sequence("a", [1, 2, 3], 8), Sequence("b", [4, 5, 6], 8)
    sched.add(a)
    sched.add(b)
    for _ in range(6):
        work = sched.step()
        sched.finish_step(work)
        for w in work:
            if w.sample:
                w.seq.output.append(9)
        pool.check()
    assert b.preemptions >= 1 and a.preemptions == 0  # the later admission yields
    assert len(a.output) == 6


@pytest.mark.parametrize("budget", [16, 64])
def test_a_prompt_that_shares_a_running_prefill_waits_for_its_pages(budget):
    """n choices of one request, or parallel requests under one system prompt: the later ones wait for the first's
    prefill to cache the shared pages, then compute only what is their own; a prompt sharing nothing goes as soon
    as the budget lets it."""
    pool = PagePool(64, 4)
    sched = Scheduler(pool, max_step_tokens=budget, max_running=8)
    system = list(range(100, 130))  # 7 full pages and 2 tokens
    first, same = Sequence("first", system + [1, 2, 3], 4), Sequence("same", system + [1, 2, 3], 4)
    other, alone = Sequence("other", system + [7, 8, 9, 10, 11], 4), Sequence("alone", [5] * 9, 4)
    seqs = (first, same, other, alone)
    for seq in seqs:
        sched.add(seq)
    prefilled, steps = dict.fromkeys(s.id for s in seqs), 0
    while not all(s.output for s in seqs):
        work = sched.step()
        steps += 1
        for w in work:
            if w.start < len(w.seq.prompt):
                prefilled[w.seq.id] = (prefilled[w.seq.id] or 0) + w.n
        if budget == 64:
            assert prefilled["alone"] == 9  # nothing to wait for: admitted with the first
        sched.finish_step(work)
        for w in work:
            if w.sample:
                w.seq.output.append(0)
        pool.check()
    assert prefilled == {"first": 33, "same": 1, "other": 7, "alone": 9}
    assert (same.cached_tokens, other.cached_tokens, pool.hit_tokens) == (32, 28, 60)
    assert steps == (4 if budget == 16 else 2)


def test_running_sequences_never_outnumber_a_steps_tokens():
    """A sequence is admitted only with tokens of the step left after the running decodes, so a budget of 3 keeps
    at most 3 running whatever max_running says: every running decode is in every step, none is left out."""
    pool = PagePool(64, 4)
    sched = Scheduler(pool, max_step_tokens=3, max_running=8)
    seqs = [Sequence(str(i), [i + 1, 50, 51], max_tokens=4) for i in range(6)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(12):
        work = sched.step()
        assert len(sched.running) <= 3 and sum(w.n for w in work) <= 3
        decoding = {s.id for s in sched.running if s.pending == 1}
        assert decoding <= {w.seq.id for w in work}
        sched.finish_step(work)
        for w in work:
            if w.sample:
                w.seq.output.append(7)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n_pages=st.integers(4, 40), page_size=st.sampled_from([2, 4, 16]),
       budget=st.integers(1, 64), max_running=st.integers(1, 8))
def test_drafts_roll_back_rejected_positions_without_leaks(seed, n_pages, page_size, budget, max_running):
    """Speculative decoding's steps: a decoding sequence computes its token and a draft, then keeps a random
    prefix of the draft. Every step must attend to the sequence's own confirmed tokens only, the pages past them
    must be released, and the prefix cache must hold pages of confirmed tokens only."""
    rng = random.Random(seed)
    pool = PagePool(n_pages, page_size, salt="s")
    sched = Scheduler(pool, budget, max_running)
    capacity = n_pages * page_size
    slots, live, n_submitted, drafted = {}, [], 0, 0
    for step in range(300):
        if n_submitted < 20 and rng.random() < 0.3:
            prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 3 * page_size))]
            if len(prompt) + 1 <= capacity:
                seq = Sequence(f"s{n_submitted}", prompt, max_tokens=rng.randrange(1, 4 * page_size))
                sched.add(seq)
                live.append(seq)
                n_submitted += 1
        for seq in sched.running:
            if seq.pending == 1:
                room = seq.max_tokens - len(seq.output) - 1
                seq.draft = [rng.randrange(4) for _ in range(rng.randrange(0, max(0, min(room, 6)) + 1))]
        work = sched.step()
        if not work and sched.waiting and not sched.running:
            seq = sched.waiting[0]
            sched.remove(seq)
            live.remove(seq)
        for w in work:
            pages, ids = w.seq.table.pages, w.ids
            assert len(pages) * page_size >= w.start + w.n
            for pos in range(w.start):  # it attends to its own confirmed tokens
                assert slots.get((pages[pos // page_size], pos % page_size)) == w.seq.tokens[pos], (w.seq.id, pos)
            for i, pos in enumerate(range(w.start, w.start + w.n)):
                page = pages[pos // page_size]
                assert page not in pool.cached and pool.refs[page] == 1, "wrote into a cached or shared page"
                slots[(page, pos % page_size)] = ids[i]
        sched.finish_step(work)
        for w in work:
            if not w.sample:
                continue
            kept = rng.randrange(len(w.draft) + 1) if w.draft else 0
            if w.draft:
                drafted += 1
                sched.finish_draft(w, kept)
                assert len(w.seq.table.pages) == max(-(-w.seq.computed // page_size), w.seq.table.registered)
            w.seq.output += w.draft[:kept] + [rng.randrange(4)]
            del w.seq.output[w.seq.max_tokens:]
            if len(w.seq.output) >= w.seq.max_tokens:
                sched.remove(w.seq)
                live.remove(w.seq)
        for page, entry in pool.cached.items():  # cached pages hold the tokens their hash names
            assert all(slots[(page, i)] == t for i, t in enumerate(entry.tokens))
        pool.check()
        if not live and n_submitted >= 20:
            break
    for seq in live:
        sched.remove(seq)
    pool.check()
    assert all(r == 0 for r in pool.refs) and pool.available == n_pages


def test_a_works_ids_are_its_span_of_prompt_and_output_then_its_draft():
    """Work.ids slices the prompt and the output without joining them: every span (in the prompt, across the
    boundary, in the output), with and without a draft, equals the joined tokens' slice."""
    seq = Sequence("a", list(range(10)), 100, output=[100, 101, 102, 103])
    for start in range(14):
        for n in range(15 - start):
            for draft in ([], [7, 8]):
                if n >= len(draft):
                    got = Work(seq, start, n, True, list(draft)).ids
                    assert got == seq.tokens[start:start + n - len(draft)] + draft, (start, n, draft)
