"""Continuous batching: which sequences run in the next engine step, and with how many tokens each.

Every step has a token budget. Running decodes come first (one token each), then prefills continue in chunks of
what is left of the budget, so a long prompt is spread over several steps while the other streams keep
decoding. When pages run out, the most recently admitted sequence is preempted: its pages are released and it
waits again, to be recomputed (mostly from the prefix cache) later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from localpd.kvcache.pages import PagePool, PageTable

MAX_STEP_TOKENS = 512  # tokens one step pushes through the model: bounds activation memory and decode stalls
MAX_RUNNING = 64


@dataclass(eq=False)
class Sequence:
    id: str
    prompt: list[int]
    max_tokens: int  # output tokens allowed (already capped by the context)
    output: list[int] = field(default_factory=list)
    table: PageTable = field(default_factory=PageTable)
    computed: int = 0  # leading tokens whose KV is in the table's pages
    cached_tokens: int = 0  # prompt tokens the prefix cache served at first admission
    admitted: bool = False  # admitted at least once (cached_tokens is final)
    preemptions: int = 0
    stage_row: int = -1  # while running: its row in the KV pool's stage (kvcache/formats.py), one of 0 .. max_running - 1
    draft: list[int] = field(default_factory=list)  # tokens guessed to follow (engine.speculate), verified next step
    chain: bool = False  # the draft holds placeholders: the next step chains decode steps greedily (Engine._chain)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens to push through the model before the next token can be sampled."""
        return len(self.prompt) + len(self.output) - self.computed


@dataclass
class Work:
    seq: Sequence
    start: int  # first position computed this step (== seq.computed)
    n: int  # tokens computed this step, the draft's included
    sample: bool  # whether this chunk reaches the end, so the step samples a token for it
    draft: list[int] = field(default_factory=list)  # drafted tokens after the sequence's own, checked this step
    chain: bool = False  # the draft's tokens are the model's own argmaxes, each computed in the step before it reads it

    @property
    def ids(self) -> list[int]:
        """The token ids this step computes (sliced from the prompt and the output, not from their joined copy:
        a decode step's one id without copying the whole context, three times a step)."""
        seq, end = self.seq, self.start + self.n - len(self.draft)
        p = len(seq.prompt)
        own = seq.output[self.start - p:end - p] if self.start >= p else \
            seq.prompt[self.start:end] + seq.output[:max(0, end - p)]
        return own + self.draft


class Scheduler:
    def __init__(self, pool: PagePool, max_step_tokens: int, max_running: int):
        self.pool = pool
        self.max_step_tokens = max_step_tokens
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.free_rows = list(range(max_running - 1, -1, -1))  # stage rows of no running sequence
        self.preemptions = 0  # since the start

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a sequence (finished, cancelled or failed) and release its pages at once."""
        if seq in self.running:
            self._stop(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.table)
        seq.computed = 0

    def _stop(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free_rows.append(seq.stage_row)
        seq.stage_row = -1

    def preempt(self, seq: Sequence) -> None:
        self._stop(seq)
        self.pool.release(seq.table)
        seq.computed = 0
        seq.draft, seq.chain = [], False
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def step(self) -> list[Work]:
        """Plan one step. Sequences that cannot fit even alone are the caller's to reject before adding."""
        budget = self.max_step_tokens
        work: list[Work] = []
        for seq in sorted(self.running, key=lambda s: s.pending > 1):  # decodes first, then prefill chunks
            if seq not in self.running:  # preempted below to make room for an earlier one
                continue
            draft, seq.draft = self._fit_draft(seq, budget), []
            chain, seq.chain = seq.chain and bool(draft), False
            n = min(seq.pending + len(draft), budget)
            if n <= 0:
                break
            while not self.pool.allocate(seq.table, seq.computed + n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            work.append(Work(seq, seq.computed, n, seq.computed + n - len(draft) == len(seq.tokens), draft, chain))
            budget -= n
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            if self._awaits_shared_pages(seq):
                continue
            tokens = seq.tokens
            hit = self.pool.match(seq.table, tokens[:-1])  # at least one token must run to give logits
            n = min(len(tokens) - hit, budget)
            if not self.pool.allocate(seq.table, hit + n):
                self.pool.release(seq.table)
                break
            self.waiting.remove(seq)
            if not seq.admitted:
                seq.admitted, seq.cached_tokens = True, hit
                self.pool.hit_tokens += hit
                self.pool.query_tokens += len(tokens)
            seq.computed = hit
            seq.stage_row = self.free_rows.pop()
            self.running.append(seq)
            work.append(Work(seq, hit, n, hit + n == len(tokens)))
            budget -= n
        return work

    def _fit_draft(self, seq: Sequence, budget: int) -> list[int]:
        """The sequence's draft, where it decodes, as much of it as the step's budget holds and free pages allow
        (a draft never preempts another sequence)."""
        if seq.pending != 1 or not seq.draft:
            return []
        draft = seq.draft[:max(budget - 1, 0)]
        while draft and not self.pool.allocate(seq.table, seq.computed + 1 + len(draft)):
            draft = draft[:len(draft) // 2]
        return draft

    def _awaits_shared_pages(self, seq: Sequence) -> bool:
        """Whether a running prefill is still computing full pages that this waiting sequence starts with (the n
        choices of one request, parallel requests under one system prompt). It waits for them, then takes them
        from the prefix cache instead of computing them a second time."""
        ps, tokens = self.pool.page_size, seq.tokens[:-1]
        for other in self.running:
            if other.pending <= 1:  # decoding: its full prompt pages are in the cache already
                continue
            shared, theirs = 0, other.tokens
            while shared + ps <= len(tokens) and tokens[shared:shared + ps] == theirs[shared:shared + ps]:
                shared += ps
            if shared > other.computed:
                return True
        return False

    def finish_step(self, work: list[Work]) -> None:
        """Advance what the step computed and offer newly full pages to the prefix cache (a drafted sequence's
        wait for finish_draft, which knows how much of the draft holds)."""
        for w in work:
            if w.seq in self.running and not w.draft:
                w.seq.computed = w.start + w.n
                self.pool.register(w.seq.table, w.seq.tokens, w.seq.computed)

    def finish_draft(self, w: Work, accepted: int) -> None:
        """A drafted sequence's step, its first `accepted` drafted tokens confirmed: its KV holds its own token and
        those; the rejected positions are rolled back (pages past them released, never offered to the prefix
        cache, whose hashes cover confirmed tokens only)."""
        if w.seq not in self.running:
            return
        w.seq.computed = w.start + 1 + accepted
        self.pool.truncate(w.seq.table, w.seq.computed)
        self.pool.register(w.seq.table, w.seq.tokens + w.draft[:accepted], w.seq.computed)
