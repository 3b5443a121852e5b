"""Decode steps replayed as CUDA graphs: one graph per batch-size bucket, captured on first use.

A batch-1 decode step launches a few hundred small kernels; launched one by one from Python it is bound by the
host, not by memory bandwidth. A graph launches them all with one call. Inputs go into static buffers; rows past
the real batch (up to the bucket) decode a dummy token whose key and value land in a scratch page that no
sequence owns (and stage their keys in a scratch stage row), so padding never touches real pages.

A chain (run_chain) replays several decode steps in one graph where every row decodes greedily: each step's
argmax is the next step's input token, written by the graph itself, so the host's work between steps (sampling,
the output processor, the next step's inputs: 0.2-0.3 ms on an H100 host, a tenth of a Llama-3-8B token) comes
once a chain. The host knows each step's positions, slots and lengths in advance; only the tokens are the graph's.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from localpd.engine.runner import slots_of
from localpd.model.transformer import Batch, Transformer
from localpd.kvcache.formats import KVPool

log = logging.getLogger(__name__)
# batch sizes (rows: a verification's drafted rows count) a graph is captured for; 12 because 9-12 rows replay in
# 2.5-2.7x a one-row step's time where 16 take 3.3x (H100, Llama-3-8B int4-g128: engine.speculate.GPU_STEP_COSTS)
BUCKETS = (1, 2, 4, 8, 12, 16, 32, 64)


class DecodeGraphs:
    def __init__(self, model: Transformer, kv: KVPool, max_pages: int, scratch_page: int, scratch_row: int,
                 max_batch: int, chain: int = 1):
        """chain: the most decode steps one replay chains (run_chain); capture: replay CUDA graphs (on a GPU),
        else every run calls the model eagerly over the same static inputs (the CPU: tests, and a chain's
        reference)."""
        dev = model.device
        self.model, self.kv, self.scratch, self.scratch_row = model, kv, scratch_page, scratch_row
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.capture = dev.type == "cuda"
        self.chain = max(chain, 1)
        B, S = max_batch, self.chain
        # The graph's step inputs are views of one int32 buffer (the 64-bit ones two words an entry), the page table
        # last: a step fills its pinned host twin and copies the prefix up to its rows' table in one transfer,
        # where a tensor copy each cost the host about 0.24 ms a step on an H100 (docs/PERF.md, issue 32). A chain's
        # steps each have their fields, and one more row of tokens: step s reads tokens[s] and writes tokens[s + 1].
        P = -(-B // 4) * 4  # each field starts 16-byte aligned (Triton specializes its pointers on that)
        self.width, self.table_at = max_pages, 2 * P * (S + 1) + 7 * P * S
        n = self.table_at + B * max_pages
        self.host = torch.zeros(n, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self.buffer = torch.zeros(n, dtype=torch.int32, device=dev)
        self.copied = torch.cuda.Event() if dev.type == "cuda" else None  # the host twin is free again once done

        def fields(buf):
            at = 2 * P * (S + 1)
            wide = buf[at:at + 6 * P * S].view(torch.int64).view(3, S, P)
            return (buf[:at].view(torch.int64).view(S + 1, P), wide[0], wide[1], wide[2],
                    buf[at + 6 * P * S:self.table_at].view(S, P), buf[self.table_at:].view(B, max_pages))

        self.tokens, self.positions, self.slots, self.stage_slots, self.seq_lens, self.page_table = fields(self.buffer)
        self.host_fields = [f.numpy() for f in fields(self.host)]
        self.seq_lens.fill_(1)
        self.q_starts = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(B, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None
        self.failed = False  # a capture failed once: the engine runs eagerly from then on

    def _batch(self, b: int, step: int = 0) -> Batch:
        return Batch(self.tokens[step, :b], self.positions[step, :b], self.slots[step, :b], self.page_table[:b],
                     self.seq_lens[step, :b], self.q_starts[:b + 1], self.rows[:b], self.stage_slots[step, :b])

    def _fill(self, b: int, tokens, positions, slots, stage_slots, tables, lens, steps: int = 1) -> None:
        """Copy the inputs of `steps` chained decode steps into the static buffers: the first step's as given, step
        s's positions, slots, stage slots and lengths s tokens further on in the same pages (which the scheduler
        allocated); rows n .. b - 1 pad onto the scratch page and stage row."""
        n, ps = len(tokens), self.kv.page_size
        if self.copied is not None:
            self.copied.synchronize()  # the last step's transfer has read the host twin
        tok, pos, slot, stage, lens_, table = self.host_fields
        table[:b] = self.scratch
        for i, pages in enumerate(tables):
            table[i, :len(pages)] = pages
        tok[0, :n], tok[0, n:b] = tokens, 0
        pos[0, :n], slot[0, :n], lens_[0, :n] = positions, slots, lens
        if self.kv.has_stage:
            stage[0, :n] = stage_slots
        if steps > 1:
            later = pos[0, :n] + np.arange(1, steps)[:, None]  # [steps - 1, n]
            pos[1:steps, :n], lens_[1:steps, :n] = later, later + 1
            slot[1:steps, :n] = slots_of(table[:n], later, ps)
            if self.kv.has_stage:
                stage[1:steps, :n] = stage[0, :n] - pos[0, :n] % ps + later % ps
        pos[:steps, n:b], slot[:steps, n:b], lens_[:steps, n:b] = 0, self.scratch * ps, 1
        if self.kv.has_stage:
            stage[:steps, n:b] = self.scratch_row * ps
        end = self.table_at + b * self.width
        self.buffer[:end].copy_(self.host[:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def _steps(self, b: int, steps: int) -> torch.Tensor:
        """The model over the static inputs of b rows: one step's logits [b, vocab] where steps is 1; else `steps`
        chained decode steps, each row's argmax (as sampling.greedy_rows takes it) the next step's input token, and
        the steps' tokens [steps, b] returned."""
        if steps == 1:
            return self.model.forward(self._batch(b), self.kv)
        for s in range(steps):
            logits = self.model.forward(self._batch(b, s), self.kv)
            torch.argmax(logits.float(), dim=-1, out=self.tokens[s + 1, :b])
        return self.tokens[1:steps + 1, :b]

    def _capture(self, b: int, steps: int) -> None:
        self._fill(b, [], [], [], [], [], [], steps)  # warm-up and capture write only into the scratch page
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # Triton compiles and autotunes here, outside the capture
                self._steps(b, steps)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[b, steps] = self._steps(b, steps)
        self.pool = graph.pool()
        self.graphs[b, steps] = graph

    def fits(self, n: int) -> bool:
        """Whether a step of n rows fits the static inputs."""
        return n <= self.buckets[-1]

    def _run(self, steps: int, tokens, positions, slots, stage_slots, tables, lens) -> torch.Tensor:
        n = len(tokens)
        b = next(b for b in self.buckets if b >= n)
        if self.capture and not self.failed and (b, steps) not in self.graphs:
            try:
                self._capture(b, steps)
            except Exception:  # noqa: BLE001 - fall back to eager steps, never fail the request
                log.warning("CUDA graph capture failed; decoding without graphs", exc_info=True)
                self.failed = True
        if not self.capture or self.failed:  # the same steps, eagerly over the same inputs (no padding rows)
            self._fill(n, tokens, positions, slots, stage_slots, tables, lens, steps)
            return self._steps(n, steps)
        self._fill(b, tokens, positions, slots, stage_slots, tables, lens, steps)
        self.graphs[b, steps].replay()
        return self.outputs[b, steps]

    def run(self, tokens: list[int], positions: list[int], slots: list[int], stage_slots: list[int],
            tables: list[list[int]], lens: list[int]) -> torch.Tensor | None:
        """Logits [n, vocab] of one decode step (valid until the next run), or None where n rows do not fit."""
        if not self.fits(len(tokens)):
            return None
        return self._run(1, tokens, positions, slots, stage_slots, tables, lens)[:len(tokens)]

    def run_chain(self, steps: int, tokens: list[int], positions: list[int], slots: list[int],
                  stage_slots: list[int], tables: list[list[int]], lens: list[int]) -> torch.Tensor:
        """Each row's greedy tokens over `steps` (2 .. self.chain) chained decode steps from these first-step
        inputs, [steps, n] (valid until the next run); n must fit (fits)."""
        if not (2 <= steps <= self.chain and self.fits(len(tokens))):
            raise ValueError(f"a chain of {steps} steps over {len(tokens)} rows: at most {self.chain} steps and "
                             f"{self.buckets[-1]} rows")
        return self._run(steps, tokens, positions, slots, stage_slots, tables, lens)[:, :len(tokens)]
