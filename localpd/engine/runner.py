"""The model runner: one scheduled step's work through the model (a CUDA graph's replay where every sequence
decodes one token, else the eager forward over a batch built from the work), then a token sampled for each row
that reaches the end of its sequence, or an embedding's vector. The scheduler learns what the forward computed
before sampling starts, so a step that fails in sampling leaves its computed pages cached. A constrained row's mask
(its grammar's allowed tokens) is computed while the forward runs: on a GPU once its kernels are launched, on the
CPU in a thread of its own where a core is spare (llguidance and the CPU kernels release the GIL)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from localpd.engine.requests import Request, StepStats
from localpd.engine.sampling import greedy_rows
from localpd.engine.scheduler import Scheduler, Work
from localpd.engine.speculate import Speculator, accept
from localpd.measure.roofline import step_cost
from localpd.model.transformer import Batch, Transformer
from localpd.kvcache.formats import KVPool, KVTraffic


@dataclass
class StepOutput:
    """What a step produced for its sampled rows: requests[i]'s outcome is a list of (token, logprob, top
    logprobs), one a token written (several where a draft held), or an embedding request's vector."""

    work: list[Work]
    requests: list[Request]
    outcomes: list
    stats: StepStats
    now: float  # when the step ended (perf_counter)


class ModelRunner:
    def __init__(self, model: Transformer, kv: KVPool, kv_traffic: KVTraffic, scheduler: Scheduler, graphs,
                 device: torch.device, drafter=None, chain=None):
        self.model, self.kv, self.kv_traffic, self.scheduler = model, kv, kv_traffic, scheduler
        self.drafter = drafter  # engine.draft_model.DraftModel, which follows every step's batch; or None
        self.graphs = graphs  # localpd.engine.cuda_graph.DecodeGraphs, or None
        self.chain = chain  # the DecodeGraphs that run chained steps (the graphs on a GPU), or None
        self.device = device
        # a CPU forward's masks: in a thread where a core is left over from the forward's threads; else after it (a
        # thread would take a core from the forward's, whose regions wait for their slowest: docs/PERF.md, issue 35)
        spare = device.type == "cpu" and (os.cpu_count() or 1) > torch.get_num_threads()
        self.mask_thread = ThreadPoolExecutor(1, "localpd-masks") if spare else None

    def run(self, work: list[Work], requests: list[Request]) -> StepOutput:
        """requests: those of the work's sampled rows (Work.sample), in order. A drafted sequence's rows are
        sampled in turn while they confirm its draft (engine.speculate.accept); its outcome lists them all."""
        t0 = time.perf_counter()
        timer = StepTimer(self.device)
        if work[0].chain:
            return self._run_chain(work, requests, t0, timer)
        embeds = [r.embed for r in requests]  # rows that end in a vector, not a token
        masks = [prepare for r in requests if not r.embed
                 and (prepare := getattr(r.sampler.constraint, "prepare", None)) is not None]
        pending = self.mask_thread.submit(prepare_all, masks) if masks and self.mask_thread is not None else None
        logits, hidden = None, None
        if self.graphs is not None and all(w.n == 1 + len(w.draft) and w.sample for w in work) and not any(embeds):
            inputs = self._decode_inputs(work)
            timer.start()
            logits = self.graphs.run(*inputs)
            if logits is not None and self.drafter is not None:
                self.drafter.follow_decode(inputs)
        if logits is None:
            batch = self._batch(work)
            timer.start()
            if any(embeds):  # the output head only where some row samples a token
                logits, hidden = self.model.forward(batch, self.kv, hidden=True, logits=not all(embeds))
            else:
                logits = self.model.forward(batch, self.kv)
            if self.drafter is not None:
                self.drafter.follow(batch)
        timer.stop()
        if pending is not None:
            pending.result()
        elif masks:  # the GPU's kernels run on meanwhile
            prepare_all(masks)
        self.scheduler.finish_step(work)
        sampled = list(zip([w for w in work if w.sample], requests))
        argmax = self._plain_greedy(sampled, logits)
        outcomes, row, drafted, accepted = [], 0, 0, 0
        for w, req in sampled:
            if req.embed:
                outcomes.append(F.normalize(hidden[row], dim=0).tolist())
            elif row in argmax:
                outcomes.append([(argmax[row], None, None)])
            elif not w.draft:
                outcomes.append([self._sample(req, logits[row], req.seq.output)])
            else:
                rows = logits[row:row + 1 + len(w.draft)]
                got = accept(w.draft, lambda i, written: self._sample(req, rows[i], req.seq.output + written))
                kept = len(got) - 1
                self.scheduler.finish_draft(w, kept)
                Speculator.verified(req.draft, len(w.draft), kept)
                drafted, accepted = drafted + len(w.draft), accepted + kept
                outcomes.append(got)
            row += 1 + len(w.draft)
        now = time.perf_counter()
        head_rows = 0 if all(embeds) else row  # rows the output head ran on
        cost = step_cost(self.model, [(w.start, w.n) for w in work], self.kv_traffic, head_rows)
        stats = StepStats(phase_of(work), sum(w.n for w in work), timer.seconds(now - t0), len(work), cost.bytes,
                          cost.flops, now - t0, drafted, accepted)
        return StepOutput(work, requests, outcomes, stats, now)

    def _run_chain(self, work: list[Work], requests: list[Request], t0: float, timer: StepTimer) -> StepOutput:
        """A step in which every sequence decodes 1 + len(draft) tokens greedily, one after another, in one replay
        (DecodeGraphs.run_chain; Engine._chain decides): each sequence's outcome is all of them, its draft then
        the tokens computed after its own, all kept."""
        steps = 1 + len(work[0].draft)
        if not all(w.chain and w.n == steps for w in work):
            raise RuntimeError("a chained step's sequences must all chain the same number of steps")
        inputs = self._decode_inputs(work)
        timer.start()
        out = self.chain.run_chain(steps, *inputs)
        timer.stop()
        tokens = out.tolist()  # one wait for the whole chain
        outcomes = []
        for i, w in enumerate(work):
            w.draft = [tokens[s][i] for s in range(steps - 1)]
            self.scheduler.finish_draft(w, steps - 1)
            outcomes.append([(tokens[s][i], None, None) for s in range(steps)])
        now = time.perf_counter()
        costs = [step_cost(self.model, [(w.start + s, 1) for w in work], self.kv_traffic, len(work))
                 for s in range(steps)]
        stats = StepStats("decode", steps * len(work), timer.seconds(now - t0), len(work), sum(c.bytes for c in costs),
                          sum(c.flops for c in costs), now - t0, passes=steps)
        return StepOutput(work, requests, outcomes, stats, now)

    def _batch(self, work: list[Work]) -> Batch:
        ps = self.kv.page_size
        ids, positions, slots, stage_slots, starts, lens, rows = [], [], [], [], [0], [], []
        for w in work:
            ids += w.ids
            pages = w.seq.table.pages
            slots += (slot_of(pages, pos, ps) for pos in range(w.start, w.start + w.n))
            if self.kv.has_stage:
                stage_slots += (w.seq.stage_row * ps + pos % ps for pos in range(w.start, w.start + w.n))
            positions += range(w.start, w.start + w.n)
            starts.append(starts[-1] + w.n)
            lens.append(w.start + w.n)
            if w.sample:  # the last row, and a drafted sequence's rows after its own token
                rows += range(starts[-1] - 1 - len(w.draft), starts[-1])
        return batch_of(ids, positions, slots, [w.seq.table.pages for w in work], lens, starts, rows, self.device,
                        stage_slots if self.kv.has_stage else None)

    def _decode_inputs(self, work: list[Work]):
        """(tokens, positions, slots, stage slots, page lists, lengths) of a step in which every sequence decodes
        one token, or verifies a draft: each of its rows then decodes as a sequence of its own over the same pages,
        its length its position + 1 (the step writes every row's key and value before any row attends, so a row
        sees the drafted tokens before it). A verification thus replays a decode graph, as plain decoding's steps do:
        an eager step launches each kernel from Python, about 9x a replayed step's time on an H100 (docs/PERF.md).
        A chained step's (Work.chain): its first step's, its own token."""
        ps = self.kv.page_size
        tokens, positions, slots, stage_slots, tables, lens = [], [], [], [], [], []
        for w in work:
            pages = w.seq.table.pages
            for p, token in enumerate(w.ids[:1] if w.chain else w.ids, w.start):  # a chain's first step
                tokens.append(token)
                positions.append(p)
                slots.append(slot_of(pages, p, ps))
                stage_slots.append(w.seq.stage_row * ps + p % ps)
                tables.append(pages)
                lens.append(p + 1)
        return tokens, positions, slots, stage_slots, tables, lens

    @staticmethod
    def _plain_greedy(sampled: list, logits: torch.Tensor | None) -> dict[int, int]:
        """{row: token} of the step's rows whose token is their argmax alone (argmax_only), a drafted sequence's
        excepted: their argmaxes in one operation. Each such row's
        _sample would take the same argmax, but in a wait of its own on a GPU."""
        rows, row = [], 0
        for w, req in sampled:
            if not w.draft and argmax_only(req):
                rows.append(row)
            row += 1 + len(w.draft)
        if len(rows) < 2:  # one row: _sample reads it without a copy
            return {}
        return dict(zip(rows, greedy_rows(logits[rows])))

    def _sample(self, req: Request, logits: torch.Tensor, output: list[int]):
        """(token, its logprob, the top logprobs) of one row; output: the reply's tokens before this row's."""
        if holds_back_eos(req, output):
            logits[list(req.eos)] = float("-inf")  # a row of this step's logits, read by nothing after
        token = req.sampler(logits, req.seq.prompt, output)
        k = req.params.logprobs
        if k is None:
            return token, None, None
        lp = torch.log_softmax(logits.float(), dim=-1)
        top = None
        if k > 0:
            vals, idx = lp.topk(k)
            top = list(zip(idx.tolist(), vals.tolist()))
        return token, float(lp[token]), top


class StepTimer:
    """A step's device time. On a GPU, CUDA events around the step's forward (its inputs already built), read
    after sampling has copied the tokens to the host (which waits for those kernels anyway), so timing adds no
    synchronisation of its own; only a step that samples nothing (a prompt chunk) waits for its end event. On the
    CPU, the wall clock of the whole step."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def start(self) -> None:
        if self.events:
            self.events[0].record()

    def stop(self) -> None:
        if self.events:
            self.events[1].record()

    def seconds(self, wall: float) -> float:
        if not self.events:
            return wall
        start, end = self.events
        if not end.query():
            end.synchronize()
        return start.elapsed_time(end) / 1e3


def holds_back_eos(req: Request, output: list[int]) -> bool:
    """Whether a row after these reply tokens may not end the reply yet (min_tokens): its end tokens are masked."""
    return bool(req.eos) and len(output) < req.params.min_tokens


def argmax_only(req: Request) -> bool:
    """Whether the request's next token is the argmax of its logits as they are and nothing else is read of them:
    a token, not an embedding; plainly greedy (Sampler.plain_greedy); no logprobs; no end tokens held back."""
    return not (req.embed or not req.sampler.plain_greedy or req.params.logprobs is not None
                or holds_back_eos(req, req.seq.output))


def prepare_all(masks: list) -> None:
    for prepare in masks:
        prepare()


def batch_of(ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], lens: list[int],
             starts: list[int], rows: list[int], device, stage_slots: list[int] | None = None) -> Batch:
    """A step's Batch from its lists: token ids, positions and KV slots a row; each sequence's pages (padded with
    page 0 to the widest), length and first row (q_starts, one more at the end); the rows to take logits of.
    The 64-bit fields are views of one tensor and the 32-bit ones of another, filled through numpy: two tensors
    (two transfers to a GPU) a step, where one each cost about 10 us of the host's time (docs/PERF.md)."""
    width = max(len(p) for p in tables)
    wide, at_w = _fields(np.int64, ids, positions, slots, rows, stage_slots or [])
    table = np.zeros((len(tables), width), np.int32)
    for i, pages in enumerate(tables):
        table[i, :len(pages)] = pages
    narrow, at_n = _fields(np.int32, table.ravel(), lens, starts)
    wide, narrow = torch.from_numpy(wide).to(device), torch.from_numpy(narrow).to(device)
    w, n = [wide[a:b] for a, b in at_w], [narrow[a:b] for a, b in at_n]
    return Batch(tokens=w[0], positions=w[1], slots=w[2], page_table=n[0].view(len(tables), width), seq_lens=n[1],
                 q_starts=n[2], logit_rows=w[3], stage_slots=None if stage_slots is None else w[4])


def _fields(dtype, *lists) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The lists in one array, each from a 16-byte boundary (as Triton likes its pointers), and their spans."""
    align = 16 // np.dtype(dtype).itemsize
    spans, at = [], 0
    for x in lists:
        spans.append((at, at + len(x)))
        at += -(-len(x) // align) * align
    out = np.zeros(at, dtype)
    for (a, b), x in zip(spans, lists):
        out[a:b] = x
    return out, spans


def slot_of(pages: list[int], pos: int, page_size: int) -> int:
    """Where position pos of a sequence with these pages keeps its key and value: page * page_size + offset."""
    return pages[pos // page_size] * page_size + pos % page_size


def slots_of(table, pos, page_size: int):
    """slot_of for many sequences at once, in numpy: table [n, width] (row i sequence i's pages), pos [..., n]
    (each sequence's positions in column i) -> their slots [..., n]."""
    return table[np.arange(table.shape[0]), pos // page_size] * page_size + pos % page_size


def phase_of(work: list[Work]) -> str:
    decode = [w.n == 1 + len(w.draft) and w.start >= len(w.seq.prompt) for w in work]
    return "decode" if all(decode) else "prefill" if not any(decode) else "mixed"
